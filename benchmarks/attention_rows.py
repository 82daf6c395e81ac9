"""One layer's decode and verification attention: a piece of `--rows` rows at the end of a cache of `ctx`
tokens, Qwen2.5-1.5B's heads (12 query, 2 KV, 128 dims), fp32, 2 threads; specserve's kernel
(`paged_attention_rows`) and, with `--sdpa`, the gather + SDPA fallback in the same process.

Hot: the cache in L2 (repeated calls); cold: after streaming a 96 MB buffer, as after a layer's weights.
Min and median of `--calls` calls each. Run from the repository root:

    .venv/bin/python benchmarks/attention_rows.py 256 1000 2000 --rows 1 8 16 [--sdpa]
"""

import argparse
import os
import time

import torch

from specserve.layers import kernels
from specserve.layers.attention import KVCache, sdpa_paged_attention
from specserve.layers.metadata import ForwardMetadata

BLOCK, HEADS, KV_HEADS, DIM = 16, 12, 2, 128


def timings(q, cache, meta, calls: int, junk: torch.Tensor) -> tuple[list[float], list[float]]:
    """Sorted seconds of `calls` hot calls, then `calls` cold ones."""
    hot, cold = [], []
    for _ in range(calls):
        start = time.perf_counter()
        sdpa_paged_attention(q, cache, meta, DIM**-0.5)
        hot.append(time.perf_counter() - start)
    for _ in range(calls):
        junk.add_(1.0)
        start = time.perf_counter()
        sdpa_paged_attention(q, cache, meta, DIM**-0.5)
        cold.append(time.perf_counter() - start)
    return sorted(hot), sorted(cold)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("contexts", type=int, nargs="*", default=[256], help="cached tokens to time")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16])
    parser.add_argument("--calls", type=int, default=60)
    parser.add_argument("--sdpa", action="store_true", help="time the gather + SDPA fallback too")
    args = parser.parse_args()
    torch.set_num_threads(2)
    torch.manual_seed(0)
    junk = torch.randn(24 * 2**20)
    backends = ["kernel", "sdpa"] if args.sdpa else ["kernel"]
    for ctx in args.contexts:
        blocks = (ctx + BLOCK - 1) // BLOCK + 1
        shape = (blocks, BLOCK, KV_HEADS, DIM)
        cache = KVCache(torch.randn(shape), torch.randn(shape))
        for rows in args.rows:
            q = torch.randn(rows, HEADS, DIM)
            for backend in backends:
                os.environ[kernels.ENV_VAR] = "1" if backend == "sdpa" else "0"  # read with each plan
                positions = torch.arange(ctx - rows, ctx)
                meta = ForwardMetadata.build([0, rows], [ctx], [list(range(blocks))], positions, BLOCK)
                hot, cold = timings(q, cache, meta, args.calls, junk)
                mid = len(hot) // 2
                print(
                    f"ctx {ctx} rows {rows:2d} {backend:>6}: hot min {hot[0] * 1e6:7.1f} med "
                    f"{hot[mid] * 1e6:7.1f} us | cold min {cold[0] * 1e6:7.1f} med {cold[mid] * 1e6:7.1f} us",
                    flush=True,
                )


if __name__ == "__main__":
    main()
