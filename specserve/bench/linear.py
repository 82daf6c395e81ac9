"""Benchmark of fp32 linear-layer kernels on this CPU, at the Qwen2.5-Coder-1.5B shapes.

Run as `python -m specserve.bench.linear`. For every (shape, M) it times each kernel and prints ms per
call and the achieved bandwidth of the weight read (weight bytes / time): at small M a linear layer is bound
by memory bandwidth, so GB/s says how close a kernel gets to the read roofline (the best kernels here reach
40-47 GB/s on a quiet machine, about twice the ~22 GB/s copy bandwidth).

Weights are cycled through enough copies to overflow the last-level cache, as in a real forward where each
layer's weight was evicted since its last use. Kernels are timed round-robin (one call of each in turn, many
rounds) so that load from other processes on the shared machine hits them all alike; the table reports the
median and, in brackets, the minimum, from which the GB/s column is computed.

Noise: on this shared 2-core VM, memory bandwidth also depends on neighbours, so absolute numbers drift by
~20% between runs; the ratios between kernels of one run are what to read. Worse, while any other process
is busy, every multi-threaded call (oneDNN always; MKL at M > 1) waits out a scheduler slice with libgomp's
default spin-wait policy: ~7.7 ms per call, whatever its size. Run it on a quiet machine, or with
`OMP_WAIT_POLICY=PASSIVE`, which removes those stalls.

`--invariance` prints instead, for every kernel the engine may use (fp32, bf16, int4, int8), whether a row of
an M-row call is bitwise the row computed alone, at the same shapes (see layers/linear.py, layers/quant.py).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from specserve.layers.linear import onednn_linear, onednn_linear_padded, onednn_pack
from specserve.layers.quant import Int4Linear, Int8Linear, group_size_for, quantize_int4, quantize_int8

# (name, in_features, out_features) of Qwen2.5-Coder-1.5B's linear layers
QWEN_1_5B_SHAPES = [
    ("q/o", 1536, 1536),
    ("k/v", 1536, 256),
    ("gate/up", 1536, 8960),
    ("down", 8960, 1536),
    ("lm_head", 1536, 151936),
]
M_VALUES = [1, 2, 4, 8, 16, 32, 64]
CACHE_FLUSH_BYTES = 256 * 2**20  # comfortably above the 32 MiB L3

Kernel = Callable[[torch.Tensor], torch.Tensor]


def _kernels(weight: torch.Tensor, bias: torch.Tensor | None, m: int) -> dict[str, Kernel]:
    """Every candidate for one weight copy; setup (packing, transposing) happens here, outside the timing."""
    weight_t = weight.t().contiguous()
    plain = onednn_pack(weight, 1)  # hint 1: oneDNN keeps the plain [out, in] layout
    blocked = onednn_pack(weight)  # the blocked layout PackedLinear uses
    mkl_packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, m)
    return {
        "F.linear": lambda x: F.linear(x, weight, bias),
        "addmm W^T": (lambda x: torch.addmm(bias, x, weight_t))
        if bias is not None
        else (lambda x: x @ weight_t),
        # MKL's packed GEMM only works for the exact M it was packed for (other M fall back to F.linear on
        # the dense weight, which it therefore also keeps: 2x memory).
        "mkl packed(M)": lambda x: torch.ops.mkl._mkl_linear(x, mkl_packed, weight, bias, m),
        "onednn plain": lambda x: onednn_linear(x, plain, bias),
        "onednn blocked": lambda x: onednn_linear(x, blocked, bias),
        "PackedLinear": lambda x: onednn_linear_padded(x, blocked, bias),  # blocked, M < 4 padded to 4
    }


def bench_shape(
    in_features: int, out_features: int, m_values: list[int], rounds: int, bias: bool = False
) -> dict[int, dict[str, list[float]]]:
    """{M: {kernel: [seconds per call, one per round]}}."""
    weight_bytes = in_features * out_features * 4
    copies = max(1, -(-CACHE_FLUSH_BYTES // weight_bytes)) if weight_bytes < CACHE_FLUSH_BYTES else 1
    weights = [torch.randn(out_features, in_features) / in_features**0.5 for _ in range(copies)]
    biases = [torch.randn(out_features) if bias else None for _ in range(copies)]
    results: dict[int, dict[str, list[float]]] = {}
    for m in m_values:
        sets = [_kernels(w, b, m) for w, b in zip(weights, biases, strict=True)]
        x = torch.randn(m, in_features)
        names = list(sets[0])
        times: dict[str, list[float]] = {name: [] for name in names}
        with torch.inference_mode():
            for name in names:  # warm-up: first calls allocate and JIT oneDNN primitives
                for ks in sets:
                    ks[name](x)
            for _ in range(rounds):
                for name in names:
                    start = time.perf_counter()
                    for ks in sets:
                        ks[name](x)
                    times[name].append((time.perf_counter() - start) / copies)
        results[m] = times
        del sets
    return results


def _invariance_kernels(weight: torch.Tensor) -> dict[str, Kernel]:
    blocked, bf16 = onednn_pack(weight), weight.to(torch.bfloat16)
    kernels = {
        "F.linear fp32": lambda x: F.linear(x, weight),
        "onednn blocked": lambda x: onednn_linear(x, blocked, None),
        "PackedLinear": lambda x: onednn_linear_padded(x, blocked, None),
        "F.linear bf16": lambda x: F.linear(x.to(torch.bfloat16), bf16),
    }
    group = group_size_for(weight.shape[1], weight.shape[0])
    if group is not None:
        q4, q8 = quantize_int4(weight, group), quantize_int8(weight, group)
        kernels.update({"int4": Int4Linear(q4), "int8": Int8Linear(*q8)})
        if kernels["int4"].on_kernel:  # torch's kernel, for comparison
            kernels.update({"int4 torch": Int4Linear(q4, use_kernel=False)})
            kernels.update({"int8 torch": Int8Linear(*q8, use_kernel=False)})
    return kernels


def invariance_report(in_features: int, out_features: int, m_values: list[int]) -> list[str]:
    """One line per kernel: the M at which some row differs from that row computed alone, and by how much."""
    weight = torch.randn(out_features, in_features) / in_features**0.5
    x = torch.randn(max(m_values), in_features)
    lines = []
    with torch.inference_mode():
        for name, kernel in _invariance_kernels(weight).items():
            alone = torch.cat([kernel(x[i : i + 1]) for i in range(len(x))]).float()
            bad = {m: (kernel(x[:m]).float() - alone[:m]).abs().max().item() for m in m_values}
            bad = {m: d for m, d in bad.items() if d > 0}
            verdict = f"differs at M = {sorted(bad)}, up to {max(bad.values()):.2g}" if bad else "invariant"
            lines.append(f"  {name:<15} {verdict}")
    return lines


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def packed_memory_report(in_features: int = 1536, out_features: int = 151936) -> str:
    """Resident memory of a dense weight, with its oneDNN packed copy, and of the packed copy alone."""
    gc.collect()
    base = _rss_bytes()
    weight = torch.randn(out_features, in_features)
    dense = _rss_bytes() - base
    packed = onednn_pack(weight, 1)
    both = _rss_bytes() - base
    del weight
    only_packed = _rss_bytes() - base
    del packed
    return (
        f"memory, {in_features}->{out_features} fp32: dense {dense / 2**20:.0f} MiB, dense+packed "
        f"{both / 2**20:.0f} MiB, packed only {only_packed / 2**20:.0f} MiB"
    )


def _environment_note() -> str:
    thp = os.environ.get("THP_MEM_ALLOC_ENABLE", "0")
    omp = os.environ.get("OMP_WAIT_POLICY", "default")
    with open("/proc/self/smaps_rollup") as f:
        huge = next((line.split(":")[1].strip() for line in f if line.startswith("AnonHugePages")), "?")
    return f"OMP_WAIT_POLICY={omp}, THP_MEM_ALLOC_ENABLE={thp} (AnonHugePages now {huge})"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, nargs="+", default=M_VALUES, help="rows per call")
    parser.add_argument("--shapes", nargs="+", default=[s[0] for s in QWEN_1_5B_SHAPES], help="names to run")
    parser.add_argument("--extra", nargs="+", default=[], metavar="IN:OUT", help="more shapes, e.g. 896:128")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--bias", action="store_true", help="time with a bias (q/k/v in Qwen have one)")
    parser.add_argument("--invariance", action="store_true", help="check batch invariance instead of timing")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    extra = [(spec, *map(int, spec.split(":"))) for spec in args.extra]
    shapes = [s for s in QWEN_1_5B_SHAPES if s[0] in args.shapes] + extra
    if args.invariance:
        isa = torch.backends.cpu.get_cpu_capability()
        print(
            f"torch {torch.__version__}, {isa}, {torch.get_num_threads()} threads; M-row calls vs rows alone"
        )
        for name, k, n in shapes:
            print(f"{name} {k}->{n}", *invariance_report(k, n, args.m), sep="\n", flush=True)
        return
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average {load}")
    print(packed_memory_report())  # first, before the timing loops leave freed memory in the heap
    print(_environment_note())
    print("ms per call: median [min] of rounds; GB/s = weight bytes / min time (best achieved)")
    for name, k, n in shapes:
        results = bench_shape(k, n, args.m, args.rounds, args.bias)
        kernels = list(next(iter(results.values())))
        gb = k * n * 4 / 1e9
        print(f"\n{name} {k}->{n} ({gb * 1e3:.1f} MB of weight)")
        print(f"{'M':>4} " + " ".join(f"{kn:>22}" for kn in kernels))
        for m, times in results.items():
            cells = []
            for kn in kernels:
                med, low = statistics.median(times[kn]), min(times[kn])
                cells.append(f"{med * 1e3:7.2f} [{low * 1e3:6.2f}] {gb / low:4.1f}")
            print(f"{m:>4} " + " ".join(f"{c:>22}" for c in cells))
    print(f"\nload average at the end {', '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
