"""Decode and verification attention of one layer on specserve's kernel (`paged_attention_rows`), one
piece of 1, 8 or 16 rows at the end of a cache of `ctx` tokens: Qwen2.5-1.5B's heads (12 query, 2 KV, 128
dims), fp32, 2 threads. Hot: the cache in L2 (repeated calls); cold: after streaming a 96 MB buffer, as
after a layer's weights. Run from the repository root: `.venv/bin/python
benchmarks/results/attention-grouped/attention_rows.py 256 1000 2000` (the cache sizes to time)."""

import sys
import time

import torch

from specserve.layers.attention import AttentionMetadata, KVCache, sdpa_paged_attention

torch.set_num_threads(2)
BLOCK, HEADS, KV_HEADS, DIM = 16, 12, 2, 128
torch.manual_seed(0)
junk = torch.randn(24 * 2**20)
ctxs = [int(c) for c in sys.argv[1:]] or [256]
for ctx in ctxs:
    blocks = (ctx + BLOCK - 1) // BLOCK + 1
    cache = KVCache(torch.randn(blocks, BLOCK, KV_HEADS, DIM), torch.randn(blocks, BLOCK, KV_HEADS, DIM))
    for rows in (1, 8, 16):
        meta = AttentionMetadata.build(
            [0, rows], [ctx], [list(range(blocks))], torch.arange(ctx - rows, ctx), BLOCK, causal=True
        )
        q = torch.randn(rows, HEADS, DIM)
        hot, cold = [], []
        for _ in range(60):
            s = time.perf_counter()
            sdpa_paged_attention(q, cache, meta, DIM**-0.5)
            hot.append(time.perf_counter() - s)
        for _ in range(30):
            junk.add_(1.0)
            s = time.perf_counter()
            sdpa_paged_attention(q, cache, meta, DIM**-0.5)
            cold.append(time.perf_counter() - s)
        hot.sort()
        cold.sort()
        hot_us = f"hot min {hot[0] * 1e6:6.1f} med {hot[len(hot) // 2] * 1e6:6.1f} us"
        cold_us = f"cold min {cold[0] * 1e6:6.1f} med {cold[len(cold) // 2] * 1e6:6.1f} us"
        print(f"ctx {ctx} rows {rows:2d}: {hot_us} | {cold_us}", flush=True)
