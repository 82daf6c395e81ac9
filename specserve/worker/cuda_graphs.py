"""Decode and verification steps through static buffers, replayed as CUDA graphs.

A step whose every piece is short (decode rows, verification blocks) runs padded to a bucket of batch
token counts (1, 2, 4, ... 512, capped by what a step can hold), with a fixed number of pieces per bucket:
the real pieces, then one padding piece that holds the padding rows, then pieces of no rows. The padding
rows sit at position 0 of a scratch block no sequence owns: they write their K/V there and attend only that
key, so the real rows neither see them nor lose a slot to them. The step's inputs are built on the host and
copied into the bucket's static buffers in one copy; on CUDA the bucket's graph (captured at its first step)
replays and the outputs are read from its static tensors. With `capture=False` the same buffers feed an
eager forward, which is how the CPU suite checks this path against the plain one, bitwise.

Attention-only models, dense or with experts in grouped matmuls (the GPU's path, layers/moe.py): a
recurrent (hybrid) model's layers and the CPU's loop over experts read the host in the middle of the
forward, which a graph cannot replay.

The same padding, buffers and captures serve the drafters' forwards (spec_decode/drafters/graphs.py): a
step may also write K/V rows that no query reads from (`kv_only`: a DSpark round's context rows), laid out
before the query rows so that each kind of row's positions and slots are one contiguous buffer.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch
from torch import nn

from specserve.core.batch import row_offsets
from specserve.layers.attention import BATCHED_PIECE_MAX_LEN, KVCache
from specserve.layers.metadata import ForwardMetadata, PieceIndex, slot_mapping
from specserve.layers.transfer import copy_into
from specserve.models.base import CausalLM
from specserve.platform import Platform

MAX_BUCKET = 512
Out = TypeVar("Out")


def graph_refusal(model: nn.Module) -> str | None:
    """Why `model`'s steps (a target's, or a drafter's network) cannot run through graphs, or None when
    they can."""
    if getattr(model, "has_recurrent_state", False):
        return "its linear-attention layers pick their kernels from the host's piece layout"
    if any(getattr(m, "reads_host", False) for m in model.modules()):
        return "its experts are looped over on the host by the tokens routed to them"
    return None


def buckets(max_tokens: int) -> list[int]:
    """The batch token counts graphs are kept for: powers of two up to MAX_BUCKET, the last one cut to
    `max_tokens` (the most rows a step can hold)."""
    cap = min(max_tokens, MAX_BUCKET)
    sizes = [1 << i for i in range(MAX_BUCKET.bit_length()) if 1 << i < cap]
    return [*sizes, cap]


@dataclass(frozen=True)
class GraphConfig:
    """What the buckets are cut for, from the engine's limits."""

    max_tokens: int  # rows a step holds at most: max_num_batched_tokens, or max_num_seqs x rows per piece
    max_pieces: int  # max_num_seqs
    max_blocks: int  # blocks of one sequence's table at most
    capture: bool  # True: capture and replay CUDA graphs; False: the static buffers run eagerly

    @property
    def largest_bucket(self) -> int:
        return buckets(self.max_tokens)[-1]


def graph_config(
    platform: Platform,
    enforce_eager: bool,
    model: nn.Module,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    rows_per_piece: int,
    max_blocks: int,
) -> GraphConfig | None:
    """How the engine's short-piece steps run through graphs, or None: every step eager (graphs off, the
    platform cannot capture them, or the model cannot be replayed, `graph_refusal`)."""
    if enforce_eager or not platform.captures_graphs or graph_refusal(model) is not None:
        return None
    max_tokens = min(max_num_batched_tokens, max_num_seqs * rows_per_piece)
    return GraphConfig(max_tokens, max_num_seqs, max_blocks, capture=True)


@dataclass
class PaddedStep:
    """One step padded to a bucket: `flat` holds every static input, in the order StaticInputs views it;
    the host lists are what an eager forward's metadata needs."""

    flat: torch.Tensor  # int64, on the host
    query_start: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]
    num_tokens: int  # real rows
    num_logits: int  # real logit rows


class StaticInputs:
    """One bucket's input buffers on the device: views into one flat int64 tensor, filled in one copy.
    `kv_positions` / `kv_slots` are the K/V-only rows' then the query rows' (`positions` / `slots`)."""

    def __init__(self, tokens: int, pieces: int, max_blocks: int, device: torch.device, kv_only: int = 0):
        kv = kv_only + tokens
        self.sizes = (tokens, kv, kv, tokens, pieces + 1, pieces, pieces * max_blocks)
        self.flat = torch.zeros(sum(self.sizes), dtype=torch.long, device=device)
        parts = self.flat.split(self.sizes)
        self.tokens, self.kv_positions, self.kv_slots, self.logit_rows = parts[:4]
        self.positions, self.slots = self.kv_positions[kv_only:], self.kv_slots[kv_only:]
        self.query_start, self.context_lens = parts[4:6]
        self.tables = parts[6].view(pieces, max_blocks)


def pad_step(
    token_ids: Seq[Seq[int]],
    starts: Seq[int],
    block_tables: Seq[Seq[int]],
    logit_rows: Seq[int],
    bucket: int,
    num_pieces: int,
    max_blocks: int,
    block_size: int,
    scratch_block: int,
    kv_only: tuple[Seq[int], Seq[int]] = ((), ()),
    kv_bucket: int = 0,
) -> PaddedStep:
    """The step's pieces (token ids, first positions, block tables) padded to `bucket` rows and
    `num_pieces` pieces: the padding rows in one piece at position 0 of `scratch_block`, then empty pieces;
    logit rows padded with row 0. `kv_only`: rows that only write K/V (the piece each belongs to, its
    position), padded to `kv_bucket` rows at position 0 of `scratch_block` too."""
    real = sum(len(t) for t in token_ids)
    padding = bucket - real
    lens = [len(t) for t in token_ids] + [padding] + [0] * (num_pieces - len(token_ids) - 1)
    context_lens = [s + len(t) for s, t in zip(starts, token_ids)] + [1 if padding else 0]
    context_lens += [0] * (num_pieces - len(context_lens))
    tables = [list(t) + [0] * (max_blocks - len(t)) for t in block_tables]
    tables += [[scratch_block] + [0] * (max_blocks - 1)] + [[0] * max_blocks] * (num_pieces - len(tables) - 1)
    positions = [i for t, s in zip(token_ids, starts) for i in range(s, s + len(t))] + [0] * padding
    owners, kv_positions = kv_only
    kv_padding = kv_bucket - len(owners)
    # the padding piece's table (the scratch block's) holds the padding K/V-only rows
    table_of_row = torch.tensor([*owners, *[len(token_ids)] * kv_padding], dtype=torch.long)
    table_of_row = torch.cat(
        [table_of_row, torch.repeat_interleave(torch.arange(num_pieces), torch.tensor(lens))]
    )
    pos = torch.tensor([*kv_positions, *[0] * kv_padding, *positions], dtype=torch.long)
    slots = slot_mapping(torch.tensor(tables, dtype=torch.long), table_of_row, pos, block_size)
    query_start = row_offsets(lens)
    flat = torch.cat(
        [
            torch.tensor([t for ids in token_ids for t in ids] + [0] * padding, dtype=torch.long),
            pos,
            slots,
            torch.tensor(list(logit_rows) + [0] * (bucket - len(logit_rows)), dtype=torch.long),
            torch.tensor(query_start + context_lens + [b for t in tables for b in t], dtype=torch.long),
        ]
    )
    return PaddedStep(flat, query_start, context_lens, tables, real, len(logit_rows))


class CapturedGraphs(Generic[Out]):
    """Forwards over static buffers by key: with `capture`, each key's captured at its first call (after a
    warm-up forward that compiles the Triton kernels, which a capture cannot; it writes the same K/V the
    replay then writes again) and replayed, its outputs the graph's static tensors; every graph of one
    runner in one memory pool, made at the first capture. Without `capture`, the forward runs eagerly."""

    def __init__(self, capture: bool):
        self.capture = capture
        self.graphs: dict[object, tuple[torch.cuda.CUDAGraph, Out]] = {}
        self._pool = None

    def run(self, key: object, forward: Callable[[], Out]) -> Out:
        if not self.capture:
            return forward()
        if key not in self.graphs:
            forward()
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                out = forward()
            self.graphs[key] = (graph, out)
        graph, out = self.graphs[key]
        graph.replay()
        return out


class StaticSteps:
    """Steps of short pieces padded to buckets and copied into each bucket's static buffers (the module's
    doc); a subclass runs its forward over them, through `captures`."""

    def __init__(self, block_size: int, scratch_block: int, config: GraphConfig, device: torch.device):
        self.block_size, self.scratch_block, self.config = block_size, scratch_block, config
        self.buckets = buckets(config.max_tokens)
        self.device = device
        self._inputs: dict[tuple[int, int], StaticInputs] = {}  # by (bucket, K/V-only rows' bucket)
        self.captures: CapturedGraphs = CapturedGraphs(config.capture)

    def bucket_for(self, token_ids: Seq[Seq[int]], block_tables: Seq[Seq[int]]) -> int | None:
        """The bucket a step of these pieces runs in, or None: it runs eagerly (a long piece, more rows
        than the largest bucket, a table wider than a sequence's)."""
        rows = sum(len(t) for t in token_ids)
        if any(len(t) > BATCHED_PIECE_MAX_LEN for t in token_ids) or rows > self.buckets[-1]:
            return None
        if any(len(t) > self.config.max_blocks for t in block_tables):
            return None
        bucket = next(b for b in self.buckets if b >= rows)
        return bucket if len(token_ids) < self.pieces_of(bucket) else None

    def kv_bucket_for(self, rows: int) -> int | None:
        """The bucket of `rows` K/V-only rows (0 for none), or None: more than the largest bucket."""
        if rows == 0:
            return 0
        return next((b for b in self.buckets if b >= rows), None)

    def pieces_of(self, bucket: int) -> int:
        """Pieces of a bucket: as many real ones as it can hold, and the padding piece."""
        return min(bucket, self.config.max_pieces) + 1

    def fill(
        self,
        bucket: int,
        token_ids: Seq[Seq[int]],
        starts: Seq[int],
        block_tables: Seq[Seq[int]],
        logit_rows: Seq[int] = (),
        kv_only: tuple[Seq[int], Seq[int]] = ((), ()),
        kv_bucket: int = 0,
    ) -> tuple[StaticInputs, PaddedStep]:
        """The step padded (`pad_step`) and copied into its bucket's buffers, in one copy."""
        pieces = self.pieces_of(bucket)
        step = pad_step(
            token_ids, starts, block_tables, logit_rows, bucket, pieces,
            self.config.max_blocks, self.block_size, self.scratch_block, kv_only, kv_bucket,
        )  # fmt: skip
        key = (bucket, kv_bucket)
        if key not in self._inputs:
            self._inputs[key] = StaticInputs(bucket, pieces, self.config.max_blocks, self.device, kv_bucket)
        static = self._inputs[key]
        copy_into(static.flat, step.flat)
        return static, step

    def metadata(self, static: StaticInputs, step: PaddedStep, causal: bool = True) -> ForwardMetadata:
        """The metadata of a forward over the static buffers: every tensor in it is one of them, or made
        from them. Slices are fresh tensors at every call: rotary keeps a forward's cos/sin by the
        positions tensor, so a graph computes them from the static positions inside the capture."""
        positions = static.positions[:]
        return ForwardMetadata(
            slot_mapping=static.slots,
            query_start=step.query_start,
            context_lens=step.context_lens,
            block_tables=step.block_tables,
            tables=static.tables,
            positions=positions,
            block_size=self.block_size,
            causal=causal,
            piece_index=PieceIndex.of(static.query_start, static.context_lens, static.tables, positions),
        )


@dataclass
class StepOutputs:
    logits: torch.Tensor  # [bucket, V]
    hidden: torch.Tensor  # [bucket, H]
    captured: dict[int, torch.Tensor]  # [bucket, H] each


class GraphRunner(StaticSteps):
    """Runs short-piece steps of `model` padded to buckets, through static buffers (see the module's doc)."""

    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[KVCache],
        block_size: int,
        scratch_block: int,
        config: GraphConfig,
    ):
        super().__init__(block_size, scratch_block, config, next(model.parameters()).device)
        self.model, self.kv_caches = model, kv_caches

    def run(
        self,
        bucket: int,
        token_ids: Seq[Seq[int]],
        starts: Seq[int],
        block_tables: Seq[Seq[int]],
        logit_rows: Seq[int],
        capture_layers: tuple[int, ...],
    ) -> tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
        """(logits of `logit_rows`, hidden states and captured layers of the real rows)."""
        static, step = self.fill(bucket, token_ids, starts, block_tables, logit_rows)
        out = self.captures.run((bucket, capture_layers), lambda: self._forward(static, step, capture_layers))
        n = step.num_tokens
        # the graph's outputs are overwritten by the next replay: what outlives the step is copied out
        captured = {layer: h[:n].clone() for layer, h in out.captured.items()}
        return out.logits[: step.num_logits], out.hidden[:n].clone(), captured

    def _forward(
        self, static: StaticInputs, step: PaddedStep, capture_layers: tuple[int, ...]
    ) -> StepOutputs:
        meta = self.metadata(static, step)
        hidden, captured = self.model(static.tokens, meta.positions, meta, self.kv_caches, capture_layers)
        return StepOutputs(self.model.compute_logits(hidden[static.logit_rows]), hidden, captured)
