"""Decode attention of one layer: specserve's kernel (`paged_attention_rows`) against gather + SDPA.

Qwen2.5-1.5B's heads (12 query, 2 KV, 128 dims), fp32, rows at the end of a cache of `ctx` tokens; min of
100 calls each (the machines are shared). Run from the repository root: `.venv/bin/python
benchmarks/results/attention-avx2/attention_rows.py`.
"""

import os
import time

import torch

from specserve.layers import kernels
from specserve.layers.attention import AttentionMetadata, KVCache, sdpa_paged_attention

BLOCK, HEADS, KV_HEADS, DIM = 16, 12, 2, 128
torch.manual_seed(0)
for ctx in (150, 500, 2000):
    blocks = (ctx + BLOCK - 1) // BLOCK + 1
    cache = KVCache(torch.randn(blocks, BLOCK, KV_HEADS, DIM), torch.randn(blocks, BLOCK, KV_HEADS, DIM))
    for rows in (1, 9):
        times = []
        for backend in ("kernel", "sdpa"):
            os.environ[kernels.ENV_VAR] = "1" if backend == "sdpa" else "0"  # read when metadata is built
            meta = AttentionMetadata.build(
                [0, rows], [ctx], [list(range(blocks))], torch.arange(ctx - rows, ctx), BLOCK, causal=True
            )
            q = torch.randn(rows, HEADS, DIM)
            best = float("inf")
            for _ in range(100):
                start = time.perf_counter()
                sdpa_paged_attention(q, cache, meta, DIM**-0.5)
                best = min(best, time.perf_counter() - start)
            times.append(best)
        print(f"ctx {ctx} rows {rows}: kernel {times[0] * 1e6:.0f} us, sdpa {times[1] * 1e6:.0f} us", flush=True)
