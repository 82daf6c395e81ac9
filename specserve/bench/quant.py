"""Weight-only quantization on this CPU: kernel timings, batch-1 decode against llama.cpp, the verification
cost curve T(q)/T(1), and quality (greedy agreement with fp32, perplexity on Python source).

    OMP_WAIT_POLICY=PASSIVE python -m specserve.bench.quant kernels
    OMP_WAIT_POLICY=PASSIVE python -m specserve.bench.quant decode --model qwen2.5-coder-1.5b

`decode` loads fp32, int8 and int4 engines and llama.cpp (llama-cpp-python, `pip install
'specserve[bench]'`) on the same GGUF with the same thread count, and times them in interleaved rounds,
so that the printed ratios compare runs under the same load (absolute figures drift on this shared
machine). Then T(q) for q = 1..16 (one forward over q new tokens after `--context` cached ones, logits for
all q rows, as verification needs), the same way; then quality, unless `--no-quality`.
OMP_WAIT_POLICY=PASSIVE (set before Python starts) keeps idle OpenMP threads from spinning against the
other engines and the neighbours (see specserve/layers/linear.py).
"""

from __future__ import annotations

import argparse
import gc
import importlib
import inspect
import json
import os
import statistics
import time

import torch

from specserve.config import SamplingParams
from specserve.engine.model_runner import PieceInput
from specserve.engine.sequence import Sequence
from specserve.layers.linear import onednn_linear_padded, onednn_pack
from specserve.layers.quant import quantize_linear
from specserve.llm import LLM

MODES = ("fp32", "int8", "int4")
KERNEL_SHAPES = [("q/o", 1536, 1536), ("k/v", 1536, 256), ("gate/up", 1536, 8960), ("down", 8960, 1536)]
KERNEL_SHAPES += [("lm_head", 1536, 151936)]
KERNEL_M = [1, 2, 4, 8, 16, 64, 256]
CACHE_FLUSH_BYTES = 256 * 2**20  # weights cycled past the 32 MiB L3, as in a real forward
# Source files the quality checks read: prompts for greedy agreement, text for perplexity (disjoint sets).
PROMPT_MODULES = ["csv", "statistics", "string", "difflib", "glob", "fnmatch", "colorsys", "calendar"]
PROMPT_MODULES += ["queue", "json.decoder"]
PERPLEXITY_MODULES = ["textwrap", "shlex", "fractions", "heapq", "bisect", "dataclasses", "argparse"]


def _median_ms(times: list[float]) -> float:
    return 1e3 * statistics.median(times)


# ------------------------------------------------------------------------------------------------ kernels


def bench_kernels(rounds: int, m_values: list[int]) -> dict:
    """ms per call of fp32 oneDNN, int8 and int4 (g32, g128) linears at each (shape, M), interleaved."""
    results: dict = {}
    for name, k, n in KERNEL_SHAPES:
        copies = max(1, CACHE_FLUSH_BYTES // (n * k * 4))
        weights = [torch.randn(n, k) / k**0.5 for _ in range(copies)]
        packed = [onednn_pack(w) for w in weights]
        kernels = {
            "fp32": [lambda x, w=w: onednn_linear_padded(x, w, None) for w in packed],
            "int8": [quantize_linear(w, None, "int8") for w in weights],
            "int4 g32": [quantize_linear(w, None, "int4", 32) for w in weights],
            "int4 g128": [quantize_linear(w, None, "int4", 128) for w in weights],
        }
        del weights
        print(f"\n{name} {k}->{n}: ms per call, median of {rounds} (x = speed relative to fp32)", flush=True)
        results[name] = {}
        for m in m_values if n < 100_000 else [v for v in m_values if v <= 16]:
            x = torch.randn(m, k)
            times: dict[str, list[float]] = {kn: [] for kn in kernels}
            with torch.inference_mode():
                for calls in kernels.values():
                    calls[0](x)  # first calls allocate and set up primitives
                for _ in range(rounds):
                    for kn, calls in kernels.items():
                        start = time.perf_counter()
                        for call in calls:
                            call(x)
                        times[kn].append((time.perf_counter() - start) / len(calls))
            med = {kn: _median_ms(t) for kn, t in times.items()}
            results[name][m] = med
            cells = "  ".join(f"{kn} {v:8.3f} x{med['fp32'] / v:4.2f}" for kn, v in med.items())
            print(f"  M={m:4d}  {cells}", flush=True)
    return results


# ------------------------------------------------------------------------------------------------ engines


class LlamaCpp:
    """llama.cpp through llama-cpp-python: greedy decode and timed forwards, logits for every row."""

    def __init__(self, gguf_path: str, threads: int, n_ctx: int):
        from llama_cpp import Llama

        self.llm = Llama(
            model_path=gguf_path,
            n_threads=threads,
            n_threads_batch=threads,
            n_ctx=n_ctx,
            n_batch=n_ctx,
            logits_all=True,  # verification needs logits for every row; decode is unaffected
            verbose=False,
        )

    def decode_seconds(self, prompt: list[int], new_tokens: int) -> float:
        """Seconds for new_tokens - 1 greedy steps after the prompt (prefill and first token excluded)."""
        llm = self.llm
        llm.reset()
        llm.eval(prompt)
        token = int(llm.scores[llm.n_tokens - 1].argmax())
        start = time.perf_counter()
        for _ in range(new_tokens - 1):
            llm.eval([token])
            token = int(llm.scores[llm.n_tokens - 1].argmax())
        return time.perf_counter() - start

    def prepare(self, context: list[int]) -> None:
        self.llm.reset()
        self.llm.eval(context)

    def forward_seconds(self, context_len: int, tokens: list[int]) -> float:
        self.llm.n_tokens = context_len  # eval() drops the KV cache past n_tokens
        start = time.perf_counter()
        self.llm.eval(tokens)
        return time.perf_counter() - start


class Specserve:
    """One of our engines, timed like LlamaCpp."""

    def __init__(self, model: str, quantization: str | None, max_model_len: int):
        self.llm = LLM(
            model, quantization=quantization, max_model_len=max_model_len, kv_cache_memory="512MiB"
        )
        self.context: Sequence | None = None

    def decode_seconds(self, prompt: list[int], new_tokens: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        out = self.llm.generate([{"prompt_token_ids": prompt}], params)[0]
        return out.metrics.finish_time - out.metrics.first_token_time

    def prepare(self, context: list[int]) -> None:
        engine = self.llm.engine
        self.context = Sequence("bench-context", list(context), SamplingParams(), max_tokens=1)
        engine.block_manager.grow(self.context, len(context) + 16)  # room for q <= 16
        engine.runner.forward([PieceInput(list(context), 0, self.context.block_table)], [len(context) - 1])

    def forward_seconds(self, context_len: int, tokens: list[int]) -> float:
        piece = PieceInput(tokens, context_len, self.context.block_table)
        start = time.perf_counter()
        self.llm.engine.runner.forward([piece], list(range(len(tokens))))
        return time.perf_counter() - start

    def release(self) -> None:
        if self.context is not None:
            self.llm.engine.block_manager.free(self.context)
            self.context = None


def source_tokens(tokenizer, modules: list[str]) -> list[list[int]]:
    return [tokenizer(inspect.getsource(importlib.import_module(m))).input_ids for m in modules]


def bench_decode(engines: dict, prompt: list[int], new_tokens: int, rounds: int) -> dict[str, float]:
    """Median decode tokens/s per engine over interleaved rounds."""
    times: dict[str, list[float]] = {name: [] for name in engines}
    for engine in engines.values():
        engine.decode_seconds(prompt, 4)  # warm-up
    for r in range(rounds):
        for name, engine in engines.items():
            times[name].append(engine.decode_seconds(prompt, new_tokens))
        line = ", ".join(f"{n} {(new_tokens - 1) / t[-1]:.2f}" for n, t in times.items())
        print(f"  round {r + 1}: tok/s {line}", flush=True)
    return {name: (new_tokens - 1) / statistics.median(t) for name, t in times.items()}


def bench_verify_curve(engines: dict, context: list[int], q_max: int, rounds: int) -> dict[str, dict]:
    """Median T(q) in ms per engine for q = 1..q_max, one forward each, interleaved across engines."""
    drafts = [(7 * i + 11) % 1000 + 100 for i in range(q_max)]
    for engine in engines.values():
        engine.prepare(context)
    times: dict[str, dict[int, list[float]]] = {n: {q: [] for q in range(1, q_max + 1)} for n in engines}
    for _ in range(rounds):
        for q in range(1, q_max + 1):
            for name, engine in engines.items():
                times[name][q].append(engine.forward_seconds(len(context), drafts[:q]))
    for engine in engines.values():
        if isinstance(engine, Specserve):
            engine.release()
    return {name: {q: _median_ms(t) for q, t in per_q.items()} for name, per_q in times.items()}


# ------------------------------------------------------------------------------------------------ quality


def greedy_outputs(llm: LLM, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


def agreement(reference: list[list[int]], other: list[list[int]]) -> dict[str, float]:
    """prefix: share of tokens before the first divergence (strict); positionwise: of equal positions."""
    total = sum(len(r) for r in reference)
    prefix = 0
    for r, o in zip(reference, other):
        prefix += next((i for i, (a, b) in enumerate(zip(r, o)) if a != b), len(r))
    same = sum(a == b for r, o in zip(reference, other) for a, b in zip(r, o))
    return {"prefix": prefix / total, "positionwise": same / total}


def perplexity(llm: LLM, text_tokens: list[int], window: int, windows: int) -> float:
    """exp(mean next-token NLL) over `windows` disjoint windows of `window` tokens (each scored alone)."""
    engine = llm.engine
    nll, count = 0.0, 0
    for w in range(windows):
        tokens = text_tokens[w * window : (w + 1) * window]
        seq = Sequence("bench-ppl", tokens, SamplingParams(), max_tokens=1)
        engine.block_manager.grow(seq, len(tokens))
        try:
            out = engine.runner.forward(
                [PieceInput(tokens, 0, seq.block_table)], list(range(len(tokens) - 1))
            )
        finally:
            engine.block_manager.free(seq)
        logp = out.logits.log_softmax(-1)
        targets = torch.tensor(tokens[1:])
        nll -= float(logp[torch.arange(len(targets)), targets].sum())
        count += len(targets)
    return float(torch.tensor(nll / count).exp())


def profile_decode(llm: LLM, prompt: list[int], steps: int) -> str:
    """Where a decode step's time goes, by operator (self CPU time)."""
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=2))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        llm.generate([{"prompt_token_ids": prompt}], params)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)


# ------------------------------------------------------------------------------------------------ driver


def run(args: argparse.Namespace) -> dict:
    from specserve.bench.decode import copy_bandwidth_gb_s
    from specserve.models.gguf import gguf_source
    from specserve.models.loader import resolve_model

    threads = torch.get_num_threads()
    print(
        f"torch {torch.__version__}, {threads} threads, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}"
    )
    max_len = max(args.prompt_len + args.new_tokens, args.context + 16) + 16
    engines: dict = {}
    for mode in MODES:
        start = time.perf_counter()
        engines[mode] = Specserve(args.model, None if mode == "fp32" else mode, max_len)
        print(f"loaded {mode} in {time.perf_counter() - start:.0f} s", flush=True)
    gguf_path = gguf_source(resolve_model(args.model))
    if args.llama and gguf_path is not None:
        engines["llama.cpp"] = LlamaCpp(str(gguf_path), threads, n_ctx=max_len + 16)
    tokenizer = engines["fp32"].llm.tokenizer
    text = source_tokens(tokenizer, PROMPT_MODULES)
    bandwidth = copy_bandwidth_gb_s()
    print(f"copy bandwidth {bandwidth:.1f} GB/s; llama.cpp on {gguf_path}")

    print(
        f"\nbatch-1 greedy decode: {args.prompt_len}-token prompt, {args.new_tokens} new tokens, "
        f"median of {args.rounds} interleaved rounds"
    )
    decode = bench_decode(engines, text[0][: args.prompt_len], args.new_tokens, args.rounds)
    base = decode.get("llama.cpp")
    for name, rate in decode.items():
        vs = f"  {rate / base:.2f}x llama.cpp" if base else ""
        print(f"  {name:10s} {rate:6.2f} tok/s  {rate / decode['fp32']:.2f}x fp32{vs}")

    print(f"\nT(q): one forward over q tokens after {args.context} cached ones, median of {args.rounds} (ms)")
    context = [t for p in text for t in p][: args.context]
    curve = bench_verify_curve(engines, context, 16, args.rounds)
    print("   q " + "".join(f"{name:>20s}" for name in curve))
    for q in range(1, 17):
        cells = "".join(f"{ms[q]:10.1f} {ms[q] / ms[1]:5.2f}x   " for ms in curve.values())
        print(f"  {q:2d} {cells}")
    result = {"threads": threads, "bandwidth_gb_s": bandwidth, "decode_tokens_per_s": decode, "t_q_ms": curve}

    if args.profile:
        print("\nint4 decode profile (self CPU time by operator):")
        print(profile_decode(engines["int4"].llm, text[0][: args.prompt_len], 16))
    engines.pop("llama.cpp", None)
    gc.collect()
    if args.quality:
        result["quality"] = quality(engines, tokenizer, args)
    print(json.dumps(result))
    return result


def quality(engines: dict, tokenizer, args: argparse.Namespace) -> dict:
    prompts = [p[: args.prompt_len] for p in source_tokens(tokenizer, PROMPT_MODULES)]
    outputs = {name: greedy_outputs(e.llm, prompts, 64) for name, e in engines.items()}
    out: dict = {"agreement_with_fp32": {}, "perplexity": {}}
    print(
        f"\ngreedy agreement with fp32, {len(prompts)} prompts x 64 tokens (prefix = up to first divergence)"
    )
    for name in ("int8", "int4"):
        out["agreement_with_fp32"][name] = a = agreement(outputs["fp32"], outputs[name])
        print(f"  {name}: prefix {100 * a['prefix']:.1f}%, positionwise {100 * a['positionwise']:.1f}%")
    text = [t for p in source_tokens(tokenizer, PERPLEXITY_MODULES) for t in p]
    windows = min(args.ppl_windows, len(text) // args.ppl_window)
    sources = ", ".join(PERPLEXITY_MODULES)
    print(f"\nperplexity on {windows} x {args.ppl_window} tokens of stdlib source ({sources})")
    for name, engine in engines.items():
        out["perplexity"][name] = ppl = perplexity(engine.llm, text, args.ppl_window, windows)
        print(f"  {name}: {ppl:.4f} ({ppl / out['perplexity']['fp32'] - 1:+.2%} vs fp32)", flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    kern = sub.add_parser("kernels", help="linear kernels at the Qwen2.5-Coder-1.5B shapes")
    kern.add_argument("--rounds", type=int, default=7)
    kern.add_argument("--m", type=int, nargs="+", default=KERNEL_M)
    dec = sub.add_parser("decode", help="decode vs llama.cpp, T(q)/T(1), quality")
    dec.add_argument("--model", default="qwen2.5-coder-1.5b")
    dec.add_argument("--prompt-len", type=int, default=128)
    dec.add_argument("--new-tokens", type=int, default=64)
    dec.add_argument("--context", type=int, default=256, help="cached tokens before the q timed ones")
    dec.add_argument("--rounds", type=int, default=5)
    dec.add_argument("--no-llama", dest="llama", action="store_false")
    dec.add_argument("--no-quality", dest="quality", action="store_false")
    dec.add_argument("--profile", action="store_true", help="profile int4 decode steps by operator")
    dec.add_argument("--ppl-window", type=int, default=512)
    dec.add_argument("--ppl-windows", type=int, default=6)
    args = parser.parse_args(argv)
    if os.environ.get("OMP_WAIT_POLICY", "").upper() != "PASSIVE":
        print("note: OMP_WAIT_POLICY=PASSIVE is not set; timings suffer while other processes run")
    torch.manual_seed(0)
    if args.command == "kernels":
        print(json.dumps(bench_kernels(args.rounds, args.m)))
    else:
        run(args)


if __name__ == "__main__":
    main()
