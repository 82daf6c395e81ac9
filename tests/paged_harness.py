"""Runs a model over our paged KV cache without the engine, for parity tests against transformers."""

from __future__ import annotations

import torch

from specserve.layers.attention import AttentionMetadata, KVCache


class PagedHarness:
    """Feeds pieces of several sequences through one model forward per step, like the engine does."""

    def __init__(self, model, num_blocks: int = 128, block_size: int = 4, dtype=torch.float32):
        self.model = model
        self.block_size = block_size
        caches: list[KVCache] = []
        for spec in model.cache_specs():
            if spec.shared_with is not None:
                caches.append(caches[spec.shared_with])
                continue
            shape = (num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
            caches.append(KVCache(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)))
        self.kv_caches = caches
        # Hand blocks out in a scrambled order so that a bug in block-table indexing cannot hide.
        self.free_blocks = list(
            torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0)).tolist()
        )
        self.tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}

    def step(self, pieces: list[tuple[int, list[int]]], capture_layers=()) -> tuple[list[torch.Tensor], dict]:
        """pieces: (sequence id, new token ids). Returns logits per piece and the captured layer outputs."""
        tokens, positions, query_start, context_lens, tables = [], [], [0], [], []
        for seq_id, new in pieces:
            start = self.lengths.get(seq_id, 0)
            end = start + len(new)
            table = self.tables.setdefault(seq_id, [])
            while len(table) * self.block_size < end:
                table.append(self.free_blocks.pop())
            self.lengths[seq_id] = end
            tokens += new
            positions += list(range(start, end))
            query_start.append(query_start[-1] + len(new))
            context_lens.append(end)
            tables.append(list(table))
        pos = torch.tensor(positions)
        meta = AttentionMetadata.build(query_start, context_lens, tables, pos, self.block_size)
        with torch.no_grad():
            hidden, captured = self.model(torch.tensor(tokens), pos, meta, self.kv_caches, capture_layers)
            logits = self.model.compute_logits(hidden)
        return [logits[query_start[i] : query_start[i + 1]] for i in range(len(pieces))], captured

    def rollback(self, seq_id: int, length: int) -> None:
        """Forget tokens past `length` (speculative rejection): only the length changes."""
        self.lengths[seq_id] = length
