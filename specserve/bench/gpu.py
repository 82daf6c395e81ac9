"""The engine's speed on a GPU (issue 55), on random weights of real shapes (random weights time like trained
ones), each figure against one measured in the same run:

- the device's copy bandwidth (bytes read + written per second of a large device-to-device copy): the
  roofline's ceiling;
- batch-1 decode at a cached context: one forward and the greedy pick per token, as tokens/s and as a share
  of the roofline (the bytes a decode step must read, weights and KV, x tokens/s / copy bandwidth);
- T(k) / T(1) for k = 1..16: the verification forward of k tokens at batch 1, the cost curve the
  load-aware planner reads (also drawn: verify-cost.png);
- output tokens/s of the whole engine at 1 / 8 / 32 / 128 concurrent requests (`--concurrency`) of
  `--input-len` random prompt tokens and `--output-len` generated ones;
- Hugging Face transformers' eager `generate` with a static cache, the same shapes on the same device: the
  anchor.

The weights are random (`load_format="dummy"`: the engine reads config.json alone).

    python -m specserve.bench.gpu [--shape qwen3-8b] [--context 1024] [--out DIR]

Eager execution (CUDA graphs are not captured yet). `--device cpu --shape tiny` runs it anywhere (the suite
does, as a check of the script itself).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import transformers

from specserve import LLM, SamplingParams
from specserve.cli_args import int_list
from specserve.models.loader import load_model
from specserve.platform import resolve_platform
from specserve.worker.cuda_graphs import graph_config
from specserve.worker.model_runner import ModelRunner, PieceInput, kv_bytes_per_block

BLOCK = 16
KS = range(1, 17)
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


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of `fn()` (one warm-up call first)."""
    fn()
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_bandwidth(device: torch.device, num_bytes: int, repeats: int) -> float:
    """Bytes read + written per second by a device-to-device copy of `num_bytes`."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * num_bytes / timed(lambda: dst.copy_(src), device, repeats)


def config_dir(config, directory: Path) -> str:
    """A model directory holding `config` alone: what load_format "dummy" needs."""
    directory.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(directory)
    return str(directory)


def decode_bytes(model, context: int, dtype: torch.dtype) -> int:
    """What one decode step reads: every weight but the input embedding's unread rows, and the KV cache."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())  # (tied ones once)
    if not model.config.tie_word_embeddings:
        embedding = model.input_embedding().weight
        weights -= embedding.numel() * embedding.element_size()
    return weights + kv_bytes_per_block(model, BLOCK, dtype) * context // BLOCK


def engine_timings(model, platform, dtype: torch.dtype, context: int, repeats: int, eager: bool) -> dict:
    """Batch-1 decode and T(k) at a cached `context`, on specserve's runner (through CUDA graphs unless
    `eager`, where the platform captures them)."""
    device = platform.device
    table = list(range(-(-(context + max(KS)) // BLOCK)))
    graphs = graph_config(platform, eager, model, max(KS), 1, max(KS), len(table))
    runner = ModelRunner(model, len(table), BLOCK, dtype, graphs=graphs)
    prompt = torch.randint(0, model.config.vocab_size, (context,)).tolist()
    for at in range(0, context, 2048):  # the context's KV, in prompt chunks
        runner.forward([PieceInput(prompt[at : at + 2048], at, table)], [0])

    def verify(k: int):
        piece = PieceInput(prompt[:k], context, table, checkpoint=True)
        return lambda: runner.forward([piece], list(range(k))).logits.argmax(-1)

    costs = {k: timed(verify(k), device, repeats) for k in KS}
    return {"decode_s": costs[1], "verify_s": costs}


def transformers_decode_s(config, dtype: torch.dtype, device: torch.device, context: int, new: int) -> float:
    """Seconds per decoded token of transformers' eager greedy `generate` with a static cache."""
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    ids = torch.randint(0, config.vocab_size, (1, context), device=device)

    def generate(n: int):
        return lambda: model.generate(
            ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, cache_implementation="static"
        )

    one, many = timed(generate(1), device, 2), timed(generate(new), device, 2)
    return (many - one) / (new - 1)


def throughput(model_dir: str, args: argparse.Namespace, concurrency: int, eager: bool) -> float:
    """Output tokens/s of the engine serving `concurrency` requests at once, prompts of random tokens."""
    llm = LLM(
        model_dir,
        device=args.device,
        dtype=args.dtype,
        enforce_eager=eager,
        load_format="dummy",
        max_num_seqs=concurrency,
        max_model_len=args.input_len + args.output_len,
    )
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    vocab = llm.engine.vocab_size
    prompts = [torch.randint(0, vocab, (args.input_len,)).tolist() for _ in range(concurrency)]
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=2))  # warm-up
    synchronize(llm.engine.config.platform.device)
    start = time.perf_counter()
    llm.generate(prompts, params)
    synchronize(llm.engine.config.platform.device)
    seconds = time.perf_counter() - start
    del llm
    release_memory()  # the next engine's cache budget is measured from what is allocated
    return concurrency * args.output_len / seconds


def release_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run(args: argparse.Namespace, workdir: Path) -> dict:
    platform = resolve_platform(args.device)
    device, dtype = platform.device, getattr(torch, args.dtype)
    config = transformers.Qwen3Config(**SHAPES[args.shape])
    model_dir = config_dir(config, workdir / args.shape)
    bandwidth = copy_bandwidth(device, args.copy_bytes, args.repeats)
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
    del model
    release_memory()
    for mode, eager in modes.items():
        result["runs"][mode]["output_tokens_per_s"] = {
            c: throughput(model_dir, args, c, eager) for c in args.concurrency
        }
    if not args.no_transformers:
        hf_s = transformers_decode_s(config, dtype, device, args.context, args.new_tokens)
        result["transformers_tokens_per_s"] = 1 / hf_s
        for run in result["runs"].values():
            run["vs_transformers"] = run["decode_tokens_per_s"] * hf_s
    return result


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
        shape = f"{result['input_len']} in / {result['output_len']} out"
        lines.append(
            f"[{mode}] output tokens/s at {shape}, by concurrent requests: "
            + "  ".join(f"{c}: {t:.0f}" for c, t in run["output_tokens_per_s"].items())
        )
    return "\n".join(lines)


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
    parser.add_argument("--out", default=None, help="directory for gpu-bench.json and verify-cost.png")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as workdir:
        result = run(args, Path(workdir))
    print(report(result))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu-bench.json").write_text(json.dumps(result, indent=1) + "\n")
        plot(result, out / "verify-cost.png")


if __name__ == "__main__":
    main()
