"""Weight-only quantization on this CPU: kernel timings, batch-1 decode against llama.cpp, the verification
cost curve T(q)/T(1), and quality (greedy agreement with fp32, perplexity on Python source).

    python -m specserve.bench.quant kernels
    python -m specserve.bench.quant decode --model qwen2.5-coder-1.5b

`decode` runs one phase per mode (fp32, int8, int4; the 1.5B engines do not all fit in this machine's
memory together). In the int8 and int4 phases the layers on specserve's kernel (layers/kernels) run
beside the same mode on torch's kernel (`int4 torch`: the path before it, and the fallback; `--no-torch`
drops it), and llama.cpp (llama-cpp-python, `pip install 'specserve[bench]'`) on the same GGUF with the
same thread count stays loaded throughout, where installed: engines of one phase are timed round by round
in turn, so their ratios are measured under the same load (absolute figures drift on this shared
machine), and ratios between phases go through llama.cpp when it runs. Per phase: batch-1 greedy decode
tokens/s and the share of the read-bandwidth roofline it reaches (weight bytes a token reads / bandwidth);
T(q) for q = 1..16 (one forward over q new tokens after `--context` cached ones, logits for all q rows, as
verification needs); and, unless `--no-quality`, perplexity on Python source and greedy outputs
(compared with fp32's at the end; `--no-agreement` skips them). `--profile` adds an operator profile of
int4 decode steps.
On a machine shared with other jobs, OMP_WAIT_POLICY=PASSIVE (set before Python starts) keeps idle
OpenMP threads from spinning against the neighbours (see specserve/layers/linear.py); on a quiet one
leave it unset: it costs llama.cpp, whose threads meet at a barrier several times per layer, up to half
its speed (the 1.5B at 2 threads here: 6.3-7.6 tokens/s with it, 12.7-16.2 without), ours ~10%.
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

from specserve.bench.spec_decode import CachedContext
from specserve.config import SamplingParams
from specserve.core.cache_groups import PagedEntry
from specserve.layers import kernels
from specserve.layers.linear import PackedLinear, onednn_linear_padded, onednn_pack
from specserve.layers.quant import (
    Int4Linear,
    Int8Linear,
    QuantizedLinear,
    kernel_call,
    quantize_int4,
    quantize_int8,
    quantize_linear,
)
from specserve.llm import LLM
from specserve.worker.model_runner import PieceInput

# mode -> (quantization, dtype): fp32 and bf16 pinned (unquantized, dtype "auto" means either, by CPU); the
# quantized modes run with "auto" (fp32 around their kernels), as a user gets them.
MODES = {
    "fp32": (None, "float32"),
    "bf16": (None, "bfloat16"),
    "int8": ("int8", "auto"),
    "int4": ("int4", "auto"),
}
KERNEL_SHAPES = [("q/o", 1536, 1536), ("k/v", 1536, 256), ("gate/up", 1536, 8960), ("down", 8960, 1536)]
KERNEL_SHAPES += [("lm_head", 1536, 151936)]
KERNEL_M = [1, 2, 4, 8, 16, 64, 256]
CACHE_FLUSH_BYTES = 256 * 2**20  # weights cycled past the 32 MiB L3, as in a real forward
# Greedy agreement runs on two prompt sets: coding requests through the chat template (how an instruct
# model is used) and raw code to continue (the first tokens of stdlib modules: many near ties, harsher).
CHAT_TASKS = [
    "checks whether a string is a palindrome",
    "computes the nth Fibonacci number iteratively",
    "performs binary search on a sorted list",
    "merges two sorted lists",
    "implements a stack class with push, pop and peek",
    "counts word frequencies in a text",
    "flattens a nested list",
    "returns the prime numbers below n",
    "transposes a matrix given as a list of lists",
    "parses one CSV line into fields, handling quoted values",
]
PROMPT_MODULES = ["csv", "statistics", "string", "difflib", "glob", "fnmatch", "colorsys", "calendar"]
PROMPT_MODULES += ["queue", "json.decoder"]
# Perplexity text: other stdlib modules' source.
PERPLEXITY_MODULES = ["textwrap", "shlex", "fractions", "heapq", "bisect", "dataclasses", "argparse"]


def _median_ms(times: list[float]) -> float:
    return 1e3 * statistics.median(times)


# ------------------------------------------------------------------------------------------------ kernels


def _int8pack(weight: torch.Tensor):
    scales = weight.abs().amax(dim=1) / 127
    q = torch.round(weight / scales[:, None]).to(torch.int8)
    scales = scales.to(torch.bfloat16)
    return lambda x: torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), q, scales).float()


AVX2, VNNI = kernels.ISA_NAMES.index("avx2"), kernels.ISA_NAMES.index("avx512_vnni")


def _on_path(layer: QuantizedLinear, isa: int):
    """A quantized layer's forward with its kernel pinned to one ISA path."""
    op = torch.ops.specserve.int4_linear if isinstance(layer, Int4Linear) else torch.ops.specserve.int8_linear
    buffers = [getattr(layer, name) for name in layer.KERNEL_BUFFERS]
    return lambda x: kernel_call(lambda *args: op(*args, isa), x, layer.bias, *buffers)


def bench_kernels(rounds: int, m_values: list[int]) -> dict:
    """ms per call of each linear kernel at each (shape, M), interleaved: fp32 oneDNN, int8 and int4 on
    specserve's kernel (where built; with AMX, also on its VNNI path alone; with AVX-512, also on the AVX2
    path of CPUs without it) and on torch's (int8 as two int4 planes; int4 at group sizes 32 and 128),
    torch's per-channel int8 kernel (for comparison); then each kernel's T(M)/T(1) per shape."""
    results: dict = {}
    for name, k, n in KERNEL_SHAPES:
        copies = max(1, CACHE_FLUSH_BYTES // (n * k * 4))
        weights = [torch.randn(n, k) / k**0.5 for _ in range(copies)]
        packed = [onednn_pack(w) for w in weights]
        calls_of = {
            "fp32": [lambda x, w=w: onednn_linear_padded(x, w, None) for w in packed],
            "int8 torch": [Int8Linear(*quantize_int8(w, 32), use_kernel=False) for w in weights],
            # torch's per-channel int8 kernel: measured, not used (see specserve/layers/quant.py)
            "int8pack": [_int8pack(w) for w in weights],
            "int4 torch": [Int4Linear(quantize_int4(w, 32), use_kernel=False) for w in weights],
            "int4 torch g128": [Int4Linear(quantize_int4(w, 128), use_kernel=False) for w in weights],
        }
        ops = kernels.ops()
        if ops is not None:
            calls_of["int8"] = [quantize_linear(w, None, "int8") for w in weights]
            calls_of["int4"] = [quantize_linear(w, None, "int4") for w in weights]
            best = kernels.ISA_NAMES.index(kernels.isa_name())
            # the layers pick AMX from a few rows on: VNNI alone beside it; AVX2 as CPUs without AVX-512 run
            pinned = {"vnni": VNNI} if best > VNNI else {}
            pinned |= {"avx2": AVX2} if best > AVX2 else {}
            for path, isa in pinned.items():
                for mode in ("int8", "int4"):
                    calls_of[f"{mode} {path}"] = [_on_path(layer, isa) for layer in calls_of[mode]]
        del weights
        print(f"\n{name} {k}->{n}: ms per call, median of {rounds} (x = speed relative to fp32)", flush=True)
        results[name] = {}
        for m in m_values if n < 100_000 else [v for v in m_values if v <= 16]:
            x = torch.randn(m, k)
            times: dict[str, list[float]] = {kn: [] for kn in calls_of}
            with torch.inference_mode():
                for calls in calls_of.values():
                    calls[0](x)  # first calls allocate and set up primitives
                for _ in range(rounds):
                    for kn, calls in calls_of.items():
                        start = time.perf_counter()
                        for call in calls:
                            call(x)
                        times[kn].append((time.perf_counter() - start) / len(calls))
            med = {kn: _median_ms(t) for kn, t in times.items()}
            results[name][m] = med
            cells = "  ".join(f"{kn} {v:8.3f} x{med['fp32'] / v:4.2f}" for kn, v in med.items())
            print(f"  M={m:4d}  {cells}", flush=True)
        if 1 in results[name]:  # the cost of verifying M - 1 drafted tokens, per kernel
            print(f"{name} T(M)/T(1):")
            for kn, t1 in results[name][1].items():
                cells = "  ".join(f"M={m} {med[kn] / t1:5.2f}" for m, med in results[name].items() if m > 1)
                print(f"  {kn:16s} {cells}", flush=True)
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

    def __init__(self, model: str, mode: str, max_model_len: int, torch_kernel: bool = False):
        """`mode`: one of MODES; `torch_kernel`: quantized layers on torch's int4 kernel instead of
        specserve's (layers/kernels)."""
        quantization, dtype = MODES[mode]
        previous = os.environ.get(kernels.ENV_VAR)
        if torch_kernel:
            os.environ[kernels.ENV_VAR] = "1"  # read when the layers are built
        try:
            self.llm = LLM(
                model,
                quantization=quantization,
                dtype=dtype,
                max_model_len=max_model_len,
                kv_cache_memory="512MiB",
            )
        finally:
            if previous is None:
                os.environ.pop(kernels.ENV_VAR, None)
            else:
                os.environ[kernels.ENV_VAR] = previous
        self.cached: CachedContext | None = None
        self.weight_bytes = weight_bytes_per_token(self.llm.engine.model)

    def decode_seconds(self, prompt: list[int], new_tokens: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        out = self.llm.generate([{"prompt_token_ids": prompt}], params)[0]
        return out.metrics.finish_time - out.metrics.first_token_time

    def prepare(self, context: list[int]) -> None:
        self.cached = CachedContext(self.llm, context, 16)  # room for q <= 16

    def forward_seconds(self, context_len: int, tokens: list[int]) -> float:
        return self.cached.forward_seconds(tokens)

    def release(self) -> None:
        if self.cached is not None:
            self.cached.release()
            self.cached = None


def weight_bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes of weights a batch-1 decode step reads: every linear layer as stored (quantized codes, scales
    and minimums, or fp32 / bf16), a head tied to the embedding included; not the embedding rows it
    indexes."""
    total, has_head = 0, False
    for name, module in model.named_modules():
        if isinstance(module, Int4Linear | Int8Linear):
            total += sum(b.numel() * b.element_size() for b in module.buffers())
        elif isinstance(module, PackedLinear):  # fp32 only
            total += module.in_features * module.out_features * 4
        elif isinstance(module, torch.nn.Linear):
            total += module.weight.numel() * module.weight.element_size()
        else:
            continue
        has_head |= name.endswith("lm_head")
    if not has_head:
        embedding = model.model.embed_tokens.weight
        total += embedding.numel() * embedding.element_size()
    return total


def read_bandwidth_gb_s(size_mb: int = 1024, repeats: int = 5) -> float:
    """Best-of-n read bandwidth: a sum over a large fp32 tensor (what batch-1 decode does to its weights)."""
    data = torch.ones(size_mb * 2**20 // 4)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return data.numel() * 4 / best / 1e9


def source_tokens(tokenizer, modules: list[str]) -> list[list[int]]:
    return [tokenizer(inspect.getsource(importlib.import_module(m))).input_ids for m in modules]


def chat_prompts(tokenizer) -> list[list[int]]:
    prompts = []
    for task in CHAT_TASKS:
        messages = [{"role": "user", "content": f"Write a Python function that {task}."}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompts.append(tokenizer(text, add_special_tokens=False).input_ids)
    return prompts


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
        scratch = PagedEntry()
        engine.block_manager.grow(scratch, len(tokens))
        try:
            out = engine.runner.forward(
                [PieceInput(tokens, 0, scratch.block_table)], list(range(len(tokens) - 1))
            )
        finally:
            engine.block_manager.free(scratch)
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
    """One phase per mode (fp32, bf16, int8, int4 do not fit in memory together here). In a quantized phase
    the mode runs on specserve's kernel and on torch's side by side; llama.cpp, where installed, stays
    loaded: engines of one phase are timed in turn, round by round, under the same load."""
    from specserve.models.gguf import gguf_source
    from specserve.models.loader import load_tokenizer, resolve_model

    threads = torch.get_num_threads()
    wait = os.environ.get("OMP_WAIT_POLICY")
    print(f"torch {torch.__version__}, {threads} threads, OMP_WAIT_POLICY={wait}, load {os.getloadavg()}")
    print(f"specserve kernels: {kernels.isa_name()}")
    model_dir = resolve_model(args.model, need_weights=False)
    tokenizer = load_tokenizer(model_dir)
    sources = source_tokens(tokenizer, PROMPT_MODULES)
    prompt_sets = {"chat": chat_prompts(tokenizer), "code": [p[: args.prompt_len] for p in sources]}
    context = [t for p in sources for t in p][: args.context]
    text = [t for p in source_tokens(tokenizer, PERPLEXITY_MODULES) for t in p]
    windows = min(args.ppl_windows, len(text) // args.ppl_window)
    max_len = max(args.prompt_len + args.new_tokens, args.context + 16, args.ppl_window) + 16
    gguf_path = gguf_source(model_dir)
    llama = None
    if args.llama and gguf_path:
        try:
            llama = LlamaCpp(str(gguf_path), threads, n_ctx=max_len + 16)
        except ImportError:
            print("llama-cpp-python is not installed (pip install 'specserve[bench]'): llama.cpp skipped")
    bandwidth = read_bandwidth_gb_s()
    print(f"read bandwidth {bandwidth:.1f} GB/s; llama.cpp: {gguf_path if llama else 'not run'}")

    decode: dict[str, dict[str, float]] = {}  # phase -> engine -> tokens/s
    curves: dict[str, dict] = {}  # phase -> engine -> q -> ms
    outputs: dict[str, dict[str, list[list[int]]]] = {}
    ppl: dict[str, float] = {}
    weight_bytes: dict[str, int] = {}
    for mode in args.modes:
        start = time.perf_counter()
        ours = {mode: Specserve(args.model, mode, max_len)}
        if MODES[mode][0] and args.torch and kernels.ops() is not None:
            ours[f"{mode} torch"] = Specserve(args.model, mode, max_len, torch_kernel=True)
        weight_bytes.update({name: engine.weight_bytes for name, engine in ours.items()})
        print(f"\n== {mode} (loaded in {time.perf_counter() - start:.0f} s)", flush=True)
        engines = {**ours, **({"llama.cpp": llama} if llama else {})}
        decode[mode] = bench_decode(engines, prompt_sets["code"][0], args.new_tokens, args.rounds)
        curves[mode] = bench_verify_curve(engines, context, 16, args.rounds)
        if args.profile and mode == "int4":
            print("int4 decode profile (self CPU time by operator):")
            print(profile_decode(ours[mode].llm, prompt_sets["code"][0], 16))
        if args.quality:
            for name, engine in ours.items():
                ppl[name] = perplexity(engine.llm, text, args.ppl_window, windows)
                print(f"  {name} perplexity {ppl[name]:.4f}", flush=True)
                if args.agreement:
                    outputs[name] = {n: greedy_outputs(engine.llm, ps, 64) for n, ps in prompt_sets.items()}
        del ours, engines
        gc.collect()

    print(
        f"\nbatch-1 greedy decode: {args.prompt_len}-token prompt, {args.new_tokens} new tokens, "
        f"median of {args.rounds} rounds, engines of a phase in turn"
    )
    fp32_rate = decode.get("fp32", {}).get("fp32")
    for mode, rates in decode.items():
        for name, rate in rates.items():
            if name == "llama.cpp":
                continue
            roofline = rate * weight_bytes[name] / 1e9 / bandwidth
            line = f"  {name:10s} {rate:6.2f} tok/s | {weight_bytes[name] / 1e9:.2f} GB a token, "
            line += f"{roofline:.0%} of the roofline"
            if name != mode:
                line += f" | {mode} is {rates[mode] / rate:.2f}x this"
            if llama:
                vs_llama = rate / rates["llama.cpp"]
                line += f" | {vs_llama:.2f}x llama.cpp ({rates['llama.cpp']:.2f} tok/s in this phase)"
                if "fp32" in decode:  # through llama.cpp, timed in both phases
                    fp32_vs_llama = decode["fp32"]["fp32"] / decode["fp32"]["llama.cpp"]
                    line += f" | {vs_llama / fp32_vs_llama:.2f}x fp32"
            elif fp32_rate:
                line += f" | {rate / fp32_rate:.2f}x fp32 (across phases)"
            print(line)
    print(f"\nT(q)/T(1): one forward over q tokens after {args.context} cached ones")
    columns = {name: ms for curve in curves.values() for name, ms in curve.items() if name != "llama.cpp"}
    if llama:
        columns["llama.cpp"] = next(iter(curves.values()))["llama.cpp"]
    print("   q" + "".join(f"{name:>12s}" for name in columns))
    print("   1" + "".join(f"{ms[1]:9.1f} ms" for ms in columns.values()))
    for q in range(2, 17):
        print(f"  {q:2d}" + "".join(f"{ms[q] / ms[1]:11.2f}x" for ms in columns.values()))
    result = {
        "threads": threads,
        "kernels": kernels.isa_name(),
        "read_bandwidth_gb_s": bandwidth,
        "weight_bytes_per_token": weight_bytes,
        "decode": decode,
        "t_q_ms": curves,
    }
    if args.quality:
        result["perplexity"] = ppl
        names = ", ".join(PERPLEXITY_MODULES)
        print(f"\nperplexity on {windows} x {args.ppl_window} tokens of stdlib source ({names})")
        for name, value in ppl.items():
            vs = f" ({value / ppl['fp32'] - 1:+.2%} vs fp32)" if "fp32" in ppl else ""
            print(f"  {name}: {value:.4f}{vs}")
    if args.quality and args.agreement and "fp32" in outputs:
        result["agreement_with_fp32"] = {
            m: {name: agreement(outputs["fp32"][name], outputs[m][name]) for name in prompt_sets}
            for m in outputs
            if m != "fp32"
        }
        print("\ngreedy agreement with fp32 over the first 64 tokens of 10 prompts: share of tokens before")
        print("the first divergence (strict), and share of equal positions")
        for mode, per_set in result["agreement_with_fp32"].items():
            cells = [
                f"{s}: {100 * a['prefix']:.1f}% / {100 * a['positionwise']:.1f}%" for s, a in per_set.items()
            ]
            print(f"  {mode}: " + ", ".join(cells))
    print(json.dumps(result))
    return result


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
    dec.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    dec.add_argument("--no-torch", dest="torch", action="store_false", help="skip torch's int4 kernel")
    dec.add_argument("--no-quality", dest="quality", action="store_false")
    dec.add_argument("--no-agreement", dest="agreement", action="store_false", help="perplexity only")
    dec.add_argument("--profile", action="store_true", help="profile int4 decode steps by operator")
    dec.add_argument("--ppl-window", type=int, default=512)
    dec.add_argument("--ppl-windows", type=int, default=6)
    args = parser.parse_args(argv)
    if os.environ.get("OMP_WAIT_POLICY", "").upper() == "PASSIVE":
        print("note: OMP_WAIT_POLICY=PASSIVE slows llama.cpp's threads most: set it only beside other jobs")
    else:
        print("note: OMP_WAIT_POLICY=PASSIVE is not set; timings suffer while other processes run")
    torch.manual_seed(0)
    if args.command == "kernels":
        print(json.dumps(bench_kernels(args.rounds, args.m)))
    else:
        run(args)


if __name__ == "__main__":
    main()
