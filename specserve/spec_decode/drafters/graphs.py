"""The drafters' forwards through static buffers, replayed as CUDA graphs: the target's mechanism
(worker/cuda_graphs.py: buckets, padding rows on a scratch block, one copy of the inputs, lazy captures in
one pool, `capture=False` for the CPU suite) applied to the drafters' networks.

A draft model (a CausalLM with a runner of its own) takes the target's GraphRunner through its runner. A
hidden-state drafter (DSpark, DFlash, EAGLE-3, MTP) runs `DraftGraphs`: its paged forward over pieces of
query rows (a DSpark round's blocks, an EAGLE-3 / MTP step's one row per request, or the pending rows of
its first forward) after rows that only write K/V (a DSpark round's context rows), padded to a bucket of
each, with the float rows it reads beside them (target features, the previous step's hidden states)
copied into static buffers of the bucket. What comes after the forward runs eagerly: sampling reads each
request's parameters, grammar and generator, and the drafter's one read of its confidences stays as it is.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch
from torch import nn

from specserve.layers.attention import BATCHED_PIECE_MAX_LEN, KVCache
from specserve.spec_decode.context import TargetContext
from specserve.spec_decode.deepspec.dspark import PagedDraftBatch
from specserve.worker.cuda_graphs import GraphConfig, PaddedStep, StaticInputs, StaticSteps, graph_config


@dataclass
class DraftInputs:
    """What a hidden-state drafter's forward reads besides its batch."""

    token_ids: torch.Tensor  # [M] the query rows'
    query_rows: torch.Tensor | None = None  # [M, .] float rows beside them (hidden inputs), or None
    kv_rows: torch.Tensor | None = None  # [N, .] float rows beside the K/V-only rows (features), or None


DraftForward = Callable[[DraftInputs, PagedDraftBatch], torch.Tensor]  # -> the query rows' outputs [M, H]


def draft_graph_config(target: TargetContext, model: nn.Module) -> GraphConfig | None:
    """How a drafter's forwards run through graphs, or None: eagerly (graphs off, a platform that does not
    capture them, or a network that cannot be replayed, `graph_refusal`). Its pieces are as long as a
    bucket takes (the first forward after a verification feeds the accepted tokens), its tables a
    drafted block longer than the target's."""
    longest = BATCHED_PIECE_MAX_LEN
    max_blocks = -(-(target.max_model_len + longest) // target.block_size)
    limits = (target.max_num_batched_tokens, target.max_num_seqs, longest, max_blocks)
    return graph_config(target.platform, target.enforce_eager, model, *limits)


class DraftGraphs(StaticSteps):
    """A hidden-state drafter's `forward` over its paged cache `caches` (one block more than its group's,
    `scratch_block`, for the padding rows), through static buffers; `widths`: of the float rows it reads
    beside the query rows and beside the K/V-only rows (0: none)."""

    def __init__(
        self,
        forward: DraftForward,
        caches: list[KVCache],
        block_size: int,
        scratch_block: int,
        config: GraphConfig,
        causal: bool,
        widths: tuple[int, int],
    ):
        super().__init__(block_size, scratch_block, config, caches[0].k.device)
        self.forward, self.caches, self.causal = forward, caches, causal
        self.query_width, self.kv_width = widths
        self.dtype = caches[0].k.dtype
        self._rows: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor | None]] = {}

    def key_for(
        self, token_ids: Seq[Seq[int]], num_kv_only: int, block_tables: Seq[Seq[int]]
    ) -> tuple[int, int] | None:
        """(the query rows' bucket, the K/V-only rows'), or None: the step runs eagerly."""
        bucket, kv_bucket = self.bucket_for(token_ids, block_tables), self.kv_bucket_for(num_kv_only)
        return None if bucket is None or kv_bucket is None else (bucket, kv_bucket)

    def run(
        self,
        key: tuple[int, int],
        token_ids: Seq[Seq[int]],
        starts: Seq[int],
        block_tables: Seq[Seq[int]],
        kv_only: tuple[Seq[int], Seq[int]],
        query_rows: torch.Tensor | None,
        kv_rows: torch.Tensor | None,
    ) -> torch.Tensor:
        """The real query rows' outputs, copied out of the graph's."""
        bucket, kv_bucket = key
        static, step = self.fill(
            bucket, token_ids, starts, block_tables, kv_only=kv_only, kv_bucket=kv_bucket
        )
        if key not in self._rows:
            self._rows[key] = (self._buffer(bucket, self.query_width), self._buffer(kv_bucket, self.kv_width))
        query_buffer, kv_buffer = self._rows[key]
        # Padding rows keep whatever earlier steps left there (finite): they reach only the scratch block.
        for buffer, rows in ((query_buffer, query_rows), (kv_buffer, kv_rows)):
            if buffer is not None:
                buffer[: rows.shape[0]].copy_(rows)
        out = self.captures.run(key, lambda: self._forward(static, step, query_buffer, kv_buffer))
        return out[: step.num_tokens].clone()

    def _buffer(self, rows: int, width: int) -> torch.Tensor | None:
        return torch.zeros(rows, width, dtype=self.dtype, device=self.device) if width else None

    def _forward(
        self,
        static: StaticInputs,
        step: PaddedStep,
        query_rows: torch.Tensor | None,
        kv_rows: torch.Tensor | None,
    ) -> torch.Tensor:
        meta = self.metadata(static, step, self.causal)
        batch = PagedDraftBatch(meta.positions, static.kv_positions[:], static.kv_slots, meta, self.caches)
        return self.forward(DraftInputs(static.tokens, query_rows, kv_rows), batch)
