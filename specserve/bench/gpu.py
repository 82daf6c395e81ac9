"""The engine's speed on a GPU (issue 55), on random weights of real shapes (random weights time like trained
ones), each figure against one measured in the same run:

- the device's copy bandwidth (bytes read + written per second of a large device-to-device copy): the
  roofline's ceiling;
- batch-1 decode at a cached context: one forward and the greedy pick per token, as tokens/s and as a share
  of the roofline (the bytes a decode step must read, weights and KV, x tokens/s / copy bandwidth);
- T(k) / T(1) for k = 1..16: the verification forward of k tokens at batch 1, the cost curve the
  load-aware planner reads (also drawn: verify-cost.png);
- the same decode and T(8) / T(1) for a `--draft-shape` model with dense, int4 and int8 weights (the
  quantized linears' Triton kernel against cuBLAS; `--no-quantized` skips it);
- the whole engine serving 1 / 8 / 32 / 128 concurrent requests (`--concurrency`) of `--input-len` prompt
  tokens and `--output-len` generated ones: output tokens/s per device and per user (the median of
  1 / TPOT);
- Hugging Face transformers' eager `generate` with a static cache, the same shapes on the same device: the
  anchor;
- the same serving with speculation (`--spec-concurrency`, default `--concurrency`; `--spec-k` drafts a
  round): a `--draft-shape` draft model (Qwen3-0.6B's) and the n-gram drafter, beside plain decoding: per
  device, per user, and the share of drafts accepted (also drawn: pareto.png, tokens/s per user against
  per device). `--budget-s` starts no speculative run (nor the quantized timings, which come last) once
  that many seconds have passed.

The weights are random (`load_format="dummy"`: the engine reads config.json alone), the draft model's too:
it is unrelated to the target, so it accepts next to nothing, and its figures are the cost of speculation
without its gain. The n-gram drafter proposes from the prompts (a random block repeated) and the output so
far: what it accepts is what the random target's greedy output happens to repeat.

    python -m specserve.bench.gpu [--shape qwen3-8b] [--context 1024] [--out DIR]

With `--out`, gpu-bench.json holds the figures measured so far after each phase (a run stopped by a timeout
keeps them); the plots are drawn at the end.

The figures come with CUDA graphs and again eager (`enforce_eager`); speculation with graphs alone.
`--device cpu --shape tiny --draft-shape tiny` runs it anywhere (the suite does, as a check of the script
itself; a draft of the target's shape gets the target's weights, one seed, and accepts every draft).
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import transformers

from specserve import LLM, SamplingParams
from specserve.bench.serve.metrics import RequestRecord, Sla, summarize
from specserve.bench.serve.report import plot_pareto
from specserve.bench.spec_decode import default_configs
from specserve.cli_args import int_list
from specserve.core.spec_stats import SpecStats
from specserve.layers.weight_storage import weight_tensors
from specserve.models.loader import load_model
from specserve.platform import Platform, resolve_platform
from specserve.worker.cuda_graphs import graph_config
from specserve.worker.model_runner import ModelRunner, PieceInput, kv_bytes_per_block

BLOCK = 16
KS = range(1, 17)
QUANTIZATIONS = ("int4", "int8")
PERIOD = 32  # tokens of the random block a prompt repeats
_QWEN3 = dict(rms_norm_eps=1e-6, max_position_embeddings=40960, rope_theta=1_000_000.0)
SHAPES = {  # text configs of the released models (transformers.Qwen3Config keys)
    "qwen3-8b": dict(
        _QWEN3,
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=False,
    ),
    "qwen3-0.6b": dict(
        _QWEN3,
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
    ),
    "tiny": dict(
        _QWEN3,
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    ),
}


def timed(fn, platform: Platform, repeats: int) -> float:
    """Median seconds of `fn()` (one warm-up call first)."""
    fn()
    times = []
    for _ in range(repeats):
        platform.synchronize()
        start = time.perf_counter()
        fn()
        platform.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_bandwidth(platform: Platform, num_bytes: int, repeats: int) -> float:
    """Bytes read + written per second by a device-to-device copy of `num_bytes`."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=platform.device)
    dst = torch.empty_like(src)
    return 2 * num_bytes / timed(lambda: dst.copy_(src), platform, repeats)


def config_dir(config, directory: Path) -> str:
    """A model directory holding `config` alone: what load_format "dummy" needs."""
    directory.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(directory)
    return str(directory)


def decode_bytes(model, context: int, dtype: torch.dtype) -> int:
    """What one decode step reads: every weight (quantized layers' buffers too; a storage once, so tied
    weights and fused or stacked layers' views count once) but the input embedding's unread rows, and the
    KV cache."""
    sizes = {}
    for t in weight_tensors(model):
        if t.is_mkldnn:  # oneDNN's packed fp32 weights (the CPU's): opaque, a storage of their own
            sizes[id(t)] = t.numel() * t.element_size()
        else:
            sizes[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
    weights = sum(sizes.values())
    if not model.config.tie_word_embeddings:
        embedding = model.input_embedding().weight
        weights -= embedding.numel() * embedding.element_size()
    return weights + kv_bytes_per_block(model, BLOCK, dtype) * context // BLOCK


def engine_timings(model, platform, dtype: torch.dtype, context: int, repeats: int, eager: bool) -> dict:
    """Batch-1 decode and T(k) at a cached `context`, on specserve's runner (through CUDA graphs unless
    `eager`, where the platform captures them)."""
    table = list(range(-(-(context + max(KS)) // BLOCK)))
    graphs = graph_config(platform, eager, model, max(KS), 1, max(KS), len(table))
    runner = ModelRunner(model, len(table), BLOCK, dtype, graphs=graphs)
    prompt = torch.randint(0, model.config.vocab_size, (context,)).tolist()
    for at in range(0, context, 2048):  # the context's KV, in prompt chunks
        runner.forward([PieceInput(prompt[at : at + 2048], at, table)], [0])

    def verify(k: int):
        piece = PieceInput(prompt[:k], context, table, checkpoint=True)
        return lambda: runner.forward([piece], list(range(k))).logits.argmax(-1)

    costs = {k: timed(verify(k), platform, repeats) for k in KS}
    return {"decode_s": costs[1], "verify_s": costs}


def quantized_timings(
    args, workdir: Path, platform, dtype: torch.dtype, bandwidth: float, eager: bool
) -> dict:
    """Batch-1 decode and T(8) / T(1) of a `--draft-shape` model with dense (`dtype`), int4 and int8
    weights (random ones, quantized on the host as a checkpoint's are), each decode as a share of the
    roofline of the bytes it reads: the quantized linears against the dense ones."""
    model_dir = config_dir(transformers.Qwen3Config(**SHAPES[args.draft_shape]), workdir / "quantized")
    by_weights = {}
    for quantization in (None, *QUANTIZATIONS):
        model, _, _ = load_model(
            model_dir, dtype, platform=platform, load_format="dummy", quantization=quantization
        )
        timings = engine_timings(model, platform, dtype, args.context, args.repeats, eager)
        by_weights[quantization or args.dtype] = {
            "decode_tokens_per_s": 1 / timings["decode_s"],
            "roofline_share": decode_bytes(model, args.context, dtype) / timings["decode_s"] / bandwidth,
            "verify_ratio_8": timings["verify_s"][8] / timings["decode_s"],
        }
        del model
        release_memory()
    return {"shape": args.draft_shape, "by_weights": by_weights}


def transformers_decode_s(config, dtype: torch.dtype, platform: Platform, context: int, new: int) -> float:
    """Seconds per decoded token of transformers' eager greedy `generate` with a static cache."""
    with torch.device(platform.device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    ids = torch.randint(0, config.vocab_size, (1, context), device=platform.device)

    def generate(n: int):
        return lambda: model.generate(
            ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, cache_implementation="static"
        )

    one, many = timed(generate(1), platform, 2), timed(generate(new), platform, 2)
    return (many - one) / (new - 1)


def repeating_prompts(vocab_size: int, count: int, length: int, seed: int) -> list[list[int]]:
    """`count` prompts of `length` tokens, each a random block of up to PERIOD tokens repeated: the n-gram
    drafter finds matches in them; to the other configurations (random weights) any tokens time alike."""
    generator = torch.Generator().manual_seed(seed)
    period = max(1, min(PERIOD, length // 2))
    blocks = torch.randint(0, vocab_size, (count, period), generator=generator)
    return blocks.repeat(1, -(-length // period))[:, :length].tolist()


def serve(
    model_dir: str, args: argparse.Namespace, concurrency: int, eager: bool, speculative: dict | None = None
) -> dict:
    """The engine serving `concurrency` requests at once (the same prompts for every configuration), with
    `speculative` (a speculative config) or without: output tokens/s per device and per user (the median of
    1 / TPOT), and with speculation the drafts verified and the share of them accepted."""
    llm = LLM(
        model_dir,
        device=args.device,
        dtype=args.dtype,
        enforce_eager=eager,
        load_format="dummy",
        max_num_seqs=concurrency,
        max_model_len=args.input_len + args.output_len,
        speculative_config=speculative,
    )
    vocab, platform = llm.engine.vocab_size, llm.engine.config.platform
    prompts = repeating_prompts(vocab, concurrency, args.input_len, seed=concurrency)
    # Warm-up at the same concurrency, on prompts of their own (no prefix to reuse): the kernels compile
    # and the decode and verification steps' graphs are captured outside the timing.
    warm = repeating_prompts(vocab, concurrency, min(args.input_len, 2 * PERIOD), seed=2**20 + concurrency)
    llm.generate(warm, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    platform.synchronize()
    start = time.perf_counter()
    outputs = llm.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    )
    platform.synchronize()
    seconds = time.perf_counter() - start
    del llm
    release_memory()  # the next engine's cache budget is measured from what is allocated
    records = [
        RequestRecord(
            start=out.metrics.arrival_time,
            end=out.metrics.finish_time,
            chunk_times=[out.metrics.first_token_time],
            prompt_tokens=len(out.prompt_token_ids),
            output_tokens=len(out.outputs[0].token_ids),
        )
        for out in outputs
    ]
    summary = summarize(records, seconds, Sla())
    figures = {
        "output_tokens": summary["total_output_tokens"],
        "output_tokens_per_s": summary["output_throughput"],
        "user_tokens_per_s": summary["user_tokens_per_s"]["p50"],
    }
    if speculative is not None:
        stats = SpecStats.total(out.spec_stats for out in outputs)
        figures.update(
            draft_tokens=stats.num_draft_tokens,
            acceptance_rate=stats.acceptance_rate,
            tokens_per_round=stats.mean_acceptance_length,
        )
    return figures


def release_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run(args: argparse.Namespace, workdir: Path, save: Callable[[dict], None] = lambda result: None) -> dict:
    """Every figure; `save` is handed the results so far after each measured phase (a run killed by a
    timeout keeps what it measured)."""
    started = time.monotonic()
    platform = resolve_platform(args.device)
    device, dtype = platform.device, getattr(torch, args.dtype)
    config = transformers.Qwen3Config(**SHAPES[args.shape])
    model_dir = config_dir(config, workdir / args.shape)
    bandwidth = copy_bandwidth(platform, args.copy_bytes, args.repeats)
    model, _, _ = load_model(model_dir, dtype, platform=platform, load_format="dummy")
    read_bytes = decode_bytes(model, args.context, dtype)
    result = {
        "device": torch.cuda.get_device_name(device) if platform.is_cuda else "cpu",
        "shape": args.shape,
        "dtype": args.dtype,
        "context": args.context,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "copy_bandwidth_GBps": bandwidth / 1e9,
        "runs": {},  # "graphs" (where the platform captures them) and "eager"
    }
    modes = {"graphs": False, "eager": True} if platform.captures_graphs else {"eager": True}
    for mode, eager in modes.items():
        timings = engine_timings(model, platform, dtype, args.context, args.repeats, eager)
        result["runs"][mode] = {
            "decode_tokens_per_s": 1 / timings["decode_s"],
            "roofline_share": read_bytes / timings["decode_s"] / bandwidth,
            "verify_ratio": {k: t / timings["decode_s"] for k, t in timings["verify_s"].items()},
        }
    save(result)
    del model
    release_memory()
    for mode, eager in modes.items():
        served = result["runs"][mode]["serving"] = {}
        for c in args.concurrency:
            served[c] = serve(model_dir, args, c, eager)
            save(result)
    if not args.no_transformers:
        hf_s = transformers_decode_s(config, dtype, platform, args.context, args.new_tokens)
        result["transformers_tokens_per_s"] = 1 / hf_s
        for run in result["runs"].values():
            run["vs_transformers"] = run["decode_tokens_per_s"] * hf_s
        save(result)
    deadline = started + args.budget_s if args.budget_s is not None else float("inf")
    if not args.no_speculation:
        draft_dir = config_dir(transformers.Qwen3Config(**SHAPES[args.draft_shape]), workdir / "draft")
        mode = next(iter(modes))  # with CUDA graphs where the platform captures them
        result["speculative"] = speculation(
            model_dir,
            draft_dir,
            args,
            mode,
            modes[mode],
            deadline,
            lambda spec: save(result | {"speculative": spec}),
        )
    if not args.no_quantized and time.monotonic() < deadline:  # last: the figures come first
        eager = next(iter(modes.values()))  # with CUDA graphs where the platform captures them
        result["quantized"] = quantized_timings(args, workdir, platform, dtype, bandwidth, eager)
        save(result)
    return result


def speculation(
    model_dir: str,
    draft_dir: str,
    args: argparse.Namespace,
    mode: str,
    eager: bool,
    deadline: float,
    save: Callable[[dict], None] = lambda spec: None,
) -> dict:
    """The serving runs again with each drafter (a draft model of `--draft-shape`, the n-gram drafter) at
    each `--spec-concurrency`, lowest first, until the monotonic clock passes `deadline`; the rest are
    listed as skipped. `save` is handed the results so far after each run."""
    configs = default_configs(draft_dir, [args.spec_k])
    found: dict[str, dict[int, dict]] = {name: {} for name, _ in configs}
    skipped = []
    spec = {
        "mode": mode,
        "k": args.spec_k,
        "draft_shape": args.draft_shape,
        "note": "random weights: the draft model is unrelated to the target (its acceptance means nothing);"
        " the n-gram drafter accepts what the random target's greedy output repeats of its context",
        "configs": found,
        "skipped": skipped,
    }
    for concurrency in sorted(args.spec_concurrency):
        for name, config in configs:
            if time.monotonic() > deadline:
                skipped.append(f"{name} at {concurrency}")
            else:
                found[name][concurrency] = serve(model_dir, args, concurrency, eager, config)
                save(spec)
    return spec


def report(result: dict) -> str:
    lines = [
        f"{result['shape']} ({result['dtype']}, random weights) on {result['device']}, context "
        f"{result['context']}",
        f"copy bandwidth {result['copy_bandwidth_GBps']:.0f} GB/s (read + written)",
    ]
    if "transformers_tokens_per_s" in result:
        lines.append(
            f"transformers eager generate (static cache): {result['transformers_tokens_per_s']:.1f} tokens/s"
        )
    for mode, run in result["runs"].items():
        lines.append(
            f"[{mode}] batch-1 decode {run['decode_tokens_per_s']:.1f} tokens/s = "
            f"{run['roofline_share']:.0%} of the roofline"
            + (f", {run['vs_transformers']:.2f}x transformers" if "vs_transformers" in run else "")
        )
        lines.append(
            f"[{mode}] T(k)/T(1): " + "  ".join(f"{k}: {r:.2f}" for k, r in run["verify_ratio"].items())
        )
        lines.append(_serving_line(mode, result, run["serving"]))
    quantized = result.get("quantized")
    if quantized:
        points = [
            f"{name}: {f['decode_tokens_per_s']:.1f} ({f['roofline_share']:.0%}, {f['verify_ratio_8']:.2f})"
            for name, f in quantized["by_weights"].items()
        ]
        lines.append(
            f"[{quantized['shape']}, by weights] batch-1 decode tokens/s (roofline share, T(8)/T(1)): "
            + "  ".join(points)
        )
    spec = result.get("speculative")
    if spec:
        lines.append(f"[speculation, k={spec['k']}, {spec['draft_shape']} draft] {spec['note']}")
        lines += [
            _serving_line(f"{spec['mode']} + {name}", result, by) for name, by in spec["configs"].items()
        ]
        if spec["skipped"]:
            lines.append("skipped (--budget-s): " + ", ".join(spec["skipped"]))
    return "\n".join(lines)


def _serving_line(label: str, result: dict, served: dict) -> str:
    """Output tokens/s per device by concurrent requests, per user and accepted drafts in brackets."""

    def point(figures: dict) -> str:
        text = f"{figures['output_tokens_per_s']:.0f} ({figures['user_tokens_per_s']:.1f}/user"
        if "acceptance_rate" in figures:
            text += f", {figures['acceptance_rate']:.0%} of {figures['draft_tokens']} drafts accepted"
        return text + ")"

    shape = f"{result['input_len']} in / {result['output_len']} out"
    points = "  ".join(f"{c}: {point(figures)}" for c, figures in served.items())
    return f"[{label}] output tokens/s at {shape}, by concurrent requests: {points}"


def pareto_runs(result: dict) -> list[dict]:
    """Each serving run, plain and speculative, as an operating point of the sweep report's Pareto plot."""
    lines = {mode: run["serving"] for mode, run in result["runs"].items()}
    spec = result.get("speculative")
    if spec:
        lines.update({f"{spec['mode']} + {name}": by for name, by in spec["configs"].items()})
    return [
        {
            "label": label,
            "concurrency": int(c),
            "output_throughput": figures["output_tokens_per_s"],
            "user_tokens_per_s": {"p50": figures["user_tokens_per_s"]},
            "error": None,
        }
        for label, served in lines.items()
        for c, figures in served.items()
    ]


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    for mode, run in result["runs"].items():
        ks, ratios = zip(*sorted(run["verify_ratio"].items()))
        ax.plot(ks, ratios, marker="o", label=mode)
    ax.legend()
    ax.set(
        xlabel="tokens verified (k)", ylabel="T(k) / T(1)", title=f"{result['shape']} on {result['device']}"
    )
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    shape = f"{result['input_len']} in / {result['output_len']} out"
    title = f"{result['shape']} on {result['device']}, {shape} (random weights)"
    plot_pareto(pareto_runs(result), path.with_name("pareto.png"), title)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shape", choices=list(SHAPES), default="qwen3-8b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=64, help="of transformers' generate")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--copy-bytes", type=int, default=2**30)
    parser.add_argument("--concurrency", type=int_list, default="1,8,32,128")
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--no-transformers", action="store_true")
    parser.add_argument("--draft-shape", choices=list(SHAPES), default="qwen3-0.6b")
    parser.add_argument("--spec-k", type=int, default=4, help="draft tokens a round")
    parser.add_argument("--spec-concurrency", type=int_list, default=None, help="default: --concurrency")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="start no speculative run (nor the quantized timings) after this many seconds",
    )
    parser.add_argument("--no-speculation", action="store_true")
    parser.add_argument(
        "--no-quantized", action="store_true", help="skip the int4 / int8 decode of a --draft-shape model"
    )
    parser.add_argument(
        "--out", default=None, help="directory for gpu-bench.json, verify-cost.png and pareto.png"
    )
    args = parser.parse_args(argv)
    args.spec_concurrency = args.spec_concurrency or args.concurrency
    if args.output_len < 2:
        parser.error("--output-len must be at least 2 (per-user speed is 1 / time per output token)")
    if SHAPES[args.draft_shape]["vocab_size"] != SHAPES[args.shape]["vocab_size"]:
        parser.error(f"--draft-shape {args.draft_shape} has another vocabulary than --shape {args.shape}")
    out = Path(args.out) if args.out else None
    save = (lambda result: None) if out is None else functools.partial(write_results, out / "gpu-bench.json")
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as workdir:
        result = run(args, Path(workdir), save)
    print(report(result))
    if out is not None:
        save(result)
        plot(result, out / "verify-cost.png")


def write_results(path: Path, result: dict) -> None:
    """`result` as JSON at `path`, whole or not at all: a run killed mid-write keeps the previous file."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(result, indent=1) + "\n")
    os.replace(partial, path)


if __name__ == "__main__":
    main()
