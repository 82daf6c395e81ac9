"""Turns scheduled pieces into one flat batch, runs the target model once, returns the logits needed."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from specserve.config import EngineConfig, SpecserveError
from specserve.layers.attention import AttentionMetadata, KVCache
from specserve.models.base import CausalLM


@dataclass
class PieceInput:
    """Tokens of one sequence at consecutive positions from `start`, with its cache block table."""

    token_ids: list[int]
    start: int
    block_table: list[int]


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [rows requested, V] fp32
    hidden: torch.Tensor  # [N, H] final-normed hidden states of every row
    captured: dict[int, torch.Tensor]  # residual-stream outputs of the requested layers, [N, H] each


def kv_bytes_per_block(model: CausalLM, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return sum(
        2 * block_size * s.num_kv_heads * s.head_dim * elem
        for s in model.cache_specs()
        if s.shared_with is None
    )


def kv_cache_blocks(model: CausalLM, config: EngineConfig, max_model_len: int) -> int:
    """Blocks of `config.block_size` tokens that `config.kv_cache_memory` holds, never more than the
    running batch can fill: every sequence at max_model_len (plus a block of verification slack). The cache
    is allocated (and zeroed) up front, so the cap saves real memory."""
    num_blocks = config.kv_cache_bytes // kv_bytes_per_block(model, config.block_size, config.torch_dtype)
    per_sequence = -(-max_model_len // config.block_size) + 1
    num_blocks = min(num_blocks, config.max_num_seqs * per_sequence)
    if num_blocks * config.block_size < max_model_len:
        raise SpecserveError(
            f"kv_cache_memory={config.kv_cache_memory!r} holds {num_blocks * config.block_size} tokens, "
            f"fewer than max_model_len={max_model_len}; raise kv_cache_memory or lower max_model_len"
        )
    return num_blocks


class ModelRunner:
    def __init__(self, model: CausalLM, num_blocks: int, block_size: int, dtype: torch.dtype):
        self.model = model
        self.block_size = block_size
        self.kv_caches: list[KVCache] = []
        for spec in model.cache_specs():
            if spec.shared_with is not None:
                self.kv_caches.append(self.kv_caches[spec.shared_with])
                continue
            shape = (num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
            self.kv_caches.append(KVCache(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)))

    @torch.inference_mode()
    def forward(
        self, pieces: Seq[PieceInput], logit_rows: Seq[int], capture_layers: Seq[int] = ()
    ) -> ForwardOutput:
        """One target forward over all pieces; logits only for `logit_rows` (indices into the flat batch)."""
        tokens: list[int] = []
        positions: list[int] = []
        query_start = [0]
        for p in pieces:
            tokens += p.token_ids
            positions += range(p.start, p.start + len(p.token_ids))
            query_start.append(len(tokens))
        pos = torch.tensor(positions, dtype=torch.long)
        meta = AttentionMetadata.build(
            query_start=query_start,
            context_lens=[p.start + len(p.token_ids) for p in pieces],
            block_tables=[p.block_table for p in pieces],
            positions=pos,
            block_size=self.block_size,
        )
        hidden, captured = self.model(
            torch.tensor(tokens, dtype=torch.long), pos, meta, self.kv_caches, tuple(capture_layers)
        )
        logits = self.model.compute_logits(hidden[torch.tensor(list(logit_rows), dtype=torch.long)])
        return ForwardOutput(logits=logits, hidden=hidden, captured=captured)
