"""Attention over a paged KV cache for a flat batch of variable-length pieces.

A *piece* is a run of consecutive new tokens of one sequence (a prompt chunk, a decode token, or an
[anchor, d1..dk] verification block). Each piece attends causally to everything its sequence has cached
before it plus itself. Pieces of different sequences never see each other.

Batch invariance: each query row of a short piece (a decode token, a verification block) is attended in
an SDPA call of its own against exactly the keys it sees (its causal prefix, cut to the sliding window),
unmasked and unpadded, so its bits cannot depend on the rest of the batch and a token verified among drafts
gets what it gets decoded alone. Rows do not share a call even at equal key counts: the CPU kernel's MKL
GEMMs round by the address of their per-thread output buffer, and which thread runs a row depends on its
place in the call. Long pieces (prompt chunks) keep one causally masked call each, and so do short prompt
pieces where rows are attended by SDPA: speculation computes prompts alike, so they need no row invariance.
Where specserve's compiled kernels are built (CPU, fp32 or bf16), the short rows are attended by
`paged_attention_rows` instead (kernels/attention.cpp): the same per-row arithmetic, reading K/V in place
through the block table, ~5x cheaper than the gather and the per-row SDPA calls at decode sizes.

The forward's metadata (`metadata.py`) is built once per step and shared by every layer; the attention
plan derived from it (which rows are short, which pieces long) too. Layers only write their new K/V into the
cache and call the backend.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Protocol

import torch
import torch.nn.functional as F

from specserve.layers import kernels
from specserve.layers.metadata import ForwardMetadata, slot_mapping

# Pieces with at most this many query rows (decode tokens, verification blocks) are attended row by row;
# longer ones and prompt pieces in one masked call each, which is fast but makes a row depend on the piece.
BATCHED_PIECE_MAX_LEN = 32


@dataclass
class KVCache:
    """One layer's paged cache: [num_blocks, block_size, num_kv_heads, head_dim] for keys and values."""

    k: torch.Tensor
    v: torch.Tensor

    @property
    def block_size(self) -> int:
        return self.k.shape[1]

    def write(self, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k.view(-1, *self.k.shape[2:]).index_copy_(0, slot_mapping, k.to(self.k.dtype))
        self.v.view(-1, *self.v.shape[2:]).index_copy_(0, slot_mapping, v.to(self.v.dtype))

    def gather(self, kv_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values at flat slots kv_index [L] -> [num_kv_heads, L, head_dim]."""
        # index_select: 5x faster than indexing with the tensor (1000 slots of 2 x 64 floats: 47 vs 231 us)
        k, v = (c.view(-1, *c.shape[2:]).index_select(0, kv_index) for c in (self.k, self.v))
        return k.transpose(0, 1), v.transpose(0, 1)


def first_key(position: int, sliding_window: int | None) -> int:
    """The first key a query at `position` sees: 0, or the start of its sliding window."""
    return 0 if sliding_window is None else max(0, position + 1 - sliding_window)


@dataclass
class RowKeys:
    """Where the short rows' keys are for one sliding window: row i attends keys[spans[i][0]:spans[i][1]]."""

    kv_index: torch.Tensor  # [T] flat cache slots of the keys gathered, piece after piece
    spans: list[tuple[int, int]]  # per row, its keys' range in kv_index


@dataclass
class ShortRows:
    """Every query row of the short pieces, each attended alone against exactly its own keys."""

    rows: torch.Tensor  # [R] flat query row
    positions: list[int]  # [R] absolute position of each row
    key_ends: list[int]  # [R] the row sees its sequence's keys before this position
    pieces: list[int]  # [R] the row's piece, among the short ones
    first_positions: list[int]  # [S] position of each short piece's first row
    kv_lens: list[int]  # [S] keys of each short piece's sequence (cached + new)
    tables: torch.Tensor  # [S, max blocks] block table of each short piece
    block_size: int
    kernel: object | None  # torch.ops.specserve, or None: SDPA
    _keys: dict[int | None, RowKeys] = field(default_factory=dict)

    @cached_property
    def row_tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """pieces, positions, key_ends as int64 tensors, for the kernel."""
        return tuple(torch.tensor(x, dtype=torch.long) for x in (self.pieces, self.positions, self.key_ends))

    def keys(self, sliding_window: int | None) -> RowKeys:
        if sliding_window not in self._keys:
            self._keys[sliding_window] = self._gather_plan(sliding_window)
        return self._keys[sliding_window]

    def _gather_plan(self, sliding_window: int | None) -> RowKeys:
        """A piece's keys are gathered once, from its first row's first key to its sequence's end."""
        firsts = [first_key(p, sliding_window) for p in self.first_positions]
        lengths = [kv_len - first for first, kv_len in zip(firsts, self.kv_lens, strict=True)]
        offsets = torch.tensor([0, *lengths[:-1]]).cumsum(0)
        key0 = (offsets - torch.tensor(firsts)).tolist()  # where key 0 of each piece's sequence would be
        counts = torch.tensor(lengths)
        piece_of_key = torch.repeat_interleave(torch.arange(len(lengths)), counts)
        key_pos = torch.arange(sum(lengths)) - torch.repeat_interleave(torch.tensor(key0), counts)
        spans = [
            (key0[piece] + first_key(pos, sliding_window), key0[piece] + end)
            for piece, pos, end in zip(self.pieces, self.positions, self.key_ends, strict=True)
        ]
        kv_index = slot_mapping(self.tables, piece_of_key, key_pos, self.block_size)
        return RowKeys(kv_index=kv_index, spans=spans)


@dataclass
class LongPiece:
    """A prompt chunk's rows [start, end), attended in one call against its sequence's keys, masked."""

    start: int
    end: int
    kv_index: torch.Tensor  # [L] flat cache slot of key j (every key of the sequence so far)
    query_pos: torch.Tensor  # [Q] absolute position of each row
    causal: bool = True  # False: every query sees all of its sequence's keys (DSpark's draft blocks)
    _masks: dict[int | None, torch.Tensor] = field(default_factory=dict)

    def mask(self, sliding_window: int | None) -> torch.Tensor:
        """[1, 1, Q, L] bool: causal, and inside the window if any."""
        if sliding_window not in self._masks:
            q = self.query_pos[:, None]
            k = torch.arange(len(self.kv_index))[None, :]
            allowed = (k <= q) | (not self.causal)
            if sliding_window is not None:
                allowed &= k > q - sliding_window
            self._masks[sliding_window] = allowed[None, None]
        return self._masks[sliding_window]


@dataclass
class AttentionPlan:
    """How one forward's rows are attended (built once per forward from its metadata, `plan_of`)."""

    short: ShortRows | None  # rows of the pieces attended row by row
    long_pieces: list[LongPiece]  # pieces attended in one call each


def plan_of(meta: ForwardMetadata, rows_on_kernel: bool) -> AttentionPlan:
    """The plan for short rows attended on the compiled kernel (`rows_on_kernel`) or by SDPA."""
    return meta.derived(_kernel_plan if rows_on_kernel else _sdpa_plan)


def _row_kernel(meta: ForwardMetadata) -> object | None:
    """specserve's compiled kernels, or None: asked once a forward (`meta.derived`), not once a layer."""
    return kernels.ops()


def _kernel_plan(meta: ForwardMetadata) -> AttentionPlan:
    """Short prompt pieces row by row too: the kernel attends their rows for less than one masked SDPA call
    (16 x 30-token prompts on Qwen2.5-0.5B: 15 vs 45 ms over all layers)."""
    return _build_plan(meta, meta.derived(_row_kernel), whole=lambda p, q_len: q_len > BATCHED_PIECE_MAX_LEN)


def _sdpa_plan(meta: ForwardMetadata) -> AttentionPlan:
    """Without the kernel a row costs an SDPA call of its own; prompt pieces need no row invariance, so they
    take one masked call each, however short."""
    return _build_plan(
        meta, None, whole=lambda p, q_len: q_len > BATCHED_PIECE_MAX_LEN or p in meta.prompt_pieces
    )


def _build_plan(
    meta: ForwardMetadata, kernel: object | None, whole: Callable[[int, int], bool]
) -> AttentionPlan:
    q_lens = meta.query_lens()
    short, long = [], []
    for p in range(meta.num_pieces):
        if q_lens[p]:  # empty pieces have no rows
            (long if whole(p, q_lens[p]) else short).append(p)
    return AttentionPlan(
        short=_short_rows(meta, short, kernel) if short else None,
        long_pieces=[_long_piece(meta, p) for p in long],
    )


def _short_rows(meta: ForwardMetadata, pieces: list[int], kernel: object | None) -> ShortRows:
    positions = meta.positions.tolist()
    rows, row_piece, key_ends = [], [], []
    for i, p in enumerate(pieces):
        start, end = meta.query_start[p], meta.query_start[p + 1]
        rows += range(start, end)
        row_piece += [i] * (end - start)
        if meta.causal:
            key_ends += [pos + 1 for pos in positions[start:end]]
        else:
            key_ends += [meta.context_lens[p]] * (end - start)
    return ShortRows(
        rows=torch.tensor(rows),
        positions=[positions[r] for r in rows],
        key_ends=key_ends,
        pieces=row_piece,
        first_positions=[positions[meta.query_start[p]] for p in pieces],
        kv_lens=[meta.context_lens[p] for p in pieces],
        tables=meta.tables[torch.tensor(pieces)],
        block_size=meta.block_size,
        kernel=kernel,
    )


def _long_piece(meta: ForwardMetadata, p: int) -> LongPiece:
    start, end = meta.query_start[p], meta.query_start[p + 1]
    kv_len = meta.context_lens[p]
    kv_index = slot_mapping(meta.tables, torch.full((kv_len,), p), torch.arange(kv_len), meta.block_size)
    return LongPiece(start, end, kv_index, meta.positions[start:end], meta.causal)


class AttentionBackend(Protocol):
    """What a layer needs from an attention kernel; a GPU backend implements the same call."""

    def __call__(
        self,
        q: torch.Tensor,
        cache: KVCache,
        meta: ForwardMetadata,
        scale: float,
        sliding_window: int | None,
        logit_softcap: float | None,
    ) -> torch.Tensor: ...


def sdpa_paged_attention(
    q: torch.Tensor,
    cache: KVCache,
    meta: ForwardMetadata,
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> torch.Tensor:
    """q [N, n_heads, d] against the cache (new K/V already written) -> [N, n_heads, d_v]."""
    kernel = meta.derived(_row_kernel)
    plan = plan_of(meta, rows_on_kernel=logit_softcap is None and _kernel_fits(q, cache, kernel))
    if plan.short is not None and not plan.long_pieces:  # every row is a short piece's, in order
        return _attend_rows(q, cache, plan.short, scale, sliding_window, logit_softcap)
    out = q.new_empty(q.shape[0], q.shape[1], cache.v.shape[-1])
    if plan.short is not None:
        out[plan.short.rows] = _attend_rows(q, cache, plan.short, scale, sliding_window, logit_softcap)
    for piece in plan.long_pieces:
        out[piece.start : piece.end] = _attend_piece(q, cache, piece, scale, sliding_window, logit_softcap)
    return out


def _attend_rows(
    q: torch.Tensor,
    cache: KVCache,
    short: ShortRows,
    scale: float,
    sliding_window: int | None,
    logit_softcap: float | None,
) -> torch.Tensor:
    """Each row alone against its own keys: [R, n_heads, d_v]. The query heads that share a KV head are
    the query rows of that head's call, so that K/V are read once per KV head rather than once per head."""
    if short.kernel is not None:
        window = sliding_window or 0
        args = (short.rows, short.tables, *short.row_tensors, window, scale)
        return short.kernel.paged_attention_rows(q, cache.k, cache.v, *args)
    plan = short.keys(sliding_window)
    k, v = cache.gather(plan.kv_index)
    queries = q[short.rows].view(len(plan.spans), k.shape[0], -1, q.shape[-1])
    outs = [
        _attend(queries[i : i + 1], k[None, :, a:b], v[None, :, a:b], scale, logit_softcap)
        for i, (a, b) in enumerate(plan.spans)
    ]
    return torch.cat(outs).flatten(1, 2)


def _kernel_fits(q: torch.Tensor, cache: KVCache, kernel) -> bool:
    """What paged_attention_rows takes: CPU, one dtype (fp32 or bf16), head dims multiples of 16 to 256."""
    dims = (q.shape[-1], cache.v.shape[-1])
    return (
        kernel is not None
        and q.device.type == "cpu"
        and q.dtype in (torch.float32, torch.bfloat16)
        and q.dtype == cache.k.dtype == cache.v.dtype
        and q.stride(-1) == 1
        and all(d % 16 == 0 and d <= 256 for d in dims)
    )


def _attend_piece(
    q: torch.Tensor,
    cache: KVCache,
    piece: LongPiece,
    scale: float,
    sliding_window: int | None,
    logit_softcap: float | None,
) -> torch.Tensor:
    """A long piece's rows in one masked call: [Q, n_heads, d_v]."""
    k, v = cache.gather(piece.kv_index)
    queries = q[piece.start : piece.end].transpose(0, 1)[None]
    o = _attend(queries, k[None], v[None], scale, logit_softcap, piece.mask(sliding_window))
    return o[0].transpose(0, 1)


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    logit_softcap: float | None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [1, H, M, d] against k, v [1, KV, L, d] (H a multiple of KV) -> [1, H, M, d_v]."""
    if logit_softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = torch.tanh(q @ k.transpose(-1, -2) * (scale / logit_softcap)) * logit_softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-1) @ v
