"""Attention over a paged KV cache for a flat batch of variable-length pieces.

A *piece* is a run of consecutive new tokens of one sequence (a prompt chunk, a decode token, or an
[anchor, d1..dk] verification block). Each piece attends causally to everything its sequence has cached
before it plus itself. Pieces of different sequences never see each other.

The metadata is built once per engine step and shared by every layer; layers only write their new K/V
into the cache and call the backend.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from specserve.layers.gated_deltanet import StateCheckpoints

# Pieces with at most this many query rows are attended together in one padded SDPA call; longer ones
# (prompt chunks) get a call of their own so that short pieces are not padded to their length.
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
        """Keys/values at flat slots kv_index [G, L] -> [G, num_kv_heads, L, head_dim]."""
        flat_k = self.k.view(-1, *self.k.shape[2:])
        flat_v = self.v.view(-1, *self.v.shape[2:])
        return flat_k[kv_index].transpose(1, 2), flat_v[kv_index].transpose(1, 2)


@dataclass
class PieceGroup:
    """Pieces attended in one padded SDPA call, with every index tensor that call needs."""

    row_index: torch.Tensor  # [G, Q] flat query row of each padded query slot (0 where padding)
    row_valid: torch.Tensor  # [G, Q] bool
    query_pos: torch.Tensor  # [G, Q] absolute position of each query slot
    kv_index: torch.Tensor  # [G, L] flat cache slot of key j of each piece (0 where padding)
    kv_len: torch.Tensor  # [G] keys available to each piece (cached + new)
    causal: bool = True  # False: every query sees all of its sequence's keys (DSpark's draft blocks)
    _masks: dict[int | None, torch.Tensor] = field(default_factory=dict)

    def mask(self, sliding_window: int | None) -> torch.Tensor:
        """[G, 1, Q, L] bool: causal, within the piece's sequence, and inside the window if any."""
        if sliding_window not in self._masks:
            key_pos = torch.arange(self.kv_index.shape[1])
            q = self.query_pos[:, :, None]
            k = key_pos[None, None, :]
            allowed = (k < self.kv_len[:, None, None]) & ((k <= q) | (not self.causal))
            if sliding_window is not None:
                allowed &= k > q - sliding_window
            # Padded query slots attend key 0 so that softmax stays finite; their output is dropped.
            allowed |= (~self.row_valid[:, :, None]) & (k == 0)
            self._masks[sliding_window] = allowed[:, None]
        return self._masks[sliding_window]


def padded_block_tables(block_tables: list[list[int]]) -> torch.Tensor:
    """[P, max blocks] long, zero-padded."""
    width = max(len(t) for t in block_tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.long)


def slot_mapping(
    tables: torch.Tensor, table_of_row: torch.Tensor, positions: torch.Tensor, block_size: int
) -> torch.Tensor:
    """Flat cache slot of each row: row r is at positions[r] of the sequence with table table_of_row[r]."""
    return tables[table_of_row, positions // block_size] * block_size + positions % block_size


@dataclass
class AttentionMetadata:
    """Where a step's tokens go in the cache and what each piece may attend to."""

    slot_mapping: torch.Tensor  # [N] flat cache slot written by each new token
    query_start: list[int]  # [P + 1] offsets of the pieces in the flat batch
    context_lens: list[int]  # [P] tokens of the piece's sequence in the cache after this step
    block_tables: list[list[int]]  # [P] the sequence's cache blocks, in position order
    positions: torch.Tensor  # [N] absolute position of each new token
    block_size: int
    causal: bool = True
    groups: list[PieceGroup] = field(default_factory=list)
    state_slots: torch.Tensor | None = None  # [P] long: each piece's recurrent-state slot (hybrid models)
    checkpoints: StateCheckpoints | None = None  # pieces whose recurrent state may be rolled back

    @classmethod
    def build(
        cls,
        query_start: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        positions: torch.Tensor,
        block_size: int,
        causal: bool = True,
        state_slots: torch.Tensor | None = None,
        checkpoints: StateCheckpoints | None = None,
    ) -> AttentionMetadata:
        num_pieces = len(context_lens)
        q_lens = [query_start[p + 1] - query_start[p] for p in range(num_pieces)]
        tables = padded_block_tables(block_tables)
        piece_of_token = torch.repeat_interleave(torch.arange(num_pieces), torch.tensor(q_lens))
        slots = slot_mapping(tables, piece_of_token, positions, block_size)
        meta = cls(
            slot_mapping=slots,
            query_start=query_start,
            context_lens=context_lens,
            block_tables=block_tables,
            positions=positions,
            block_size=block_size,
            causal=causal,
            state_slots=state_slots,
            checkpoints=checkpoints,
        )
        short = [p for p in range(num_pieces) if q_lens[p] <= BATCHED_PIECE_MAX_LEN]
        long = [p for p in range(num_pieces) if q_lens[p] > BATCHED_PIECE_MAX_LEN]
        meta.groups = [meta._group(g, tables) for g in ([short] if short else []) + [[p] for p in long]]
        return meta

    @property
    def num_tokens(self) -> int:
        return self.query_start[-1]

    def _group(self, pieces: list[int], tables: torch.Tensor) -> PieceGroup:
        idx = torch.tensor(pieces)
        starts = torch.tensor(self.query_start)
        q_start, q_lens = starts[idx], starts[idx + 1] - starts[idx]
        kv_len = torch.tensor(self.context_lens)[idx]
        offsets = torch.arange(int(q_lens.max()))
        valid = offsets[None, :] < q_lens[:, None]
        rows = torch.where(valid, q_start[:, None] + offsets, 0)
        bs = self.block_size
        max_kv = int(kv_len.max())
        group_tables = tables[idx, : -(-max_kv // bs)]
        kv_index = (group_tables[:, :, None] * bs + torch.arange(bs)).reshape(len(pieces), -1)[:, :max_kv]
        return PieceGroup(
            row_index=rows,
            row_valid=valid,
            query_pos=self.positions[rows],
            kv_index=kv_index,
            kv_len=kv_len,
            causal=self.causal,
        )


class AttentionBackend(Protocol):
    """What a layer needs from an attention kernel; a GPU backend implements the same call."""

    def __call__(
        self,
        q: torch.Tensor,
        cache: KVCache,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
        logit_softcap: float | None,
    ) -> torch.Tensor: ...


def sdpa_paged_attention(
    q: torch.Tensor,
    cache: KVCache,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> torch.Tensor:
    """q [N, n_heads, d] against the cache (new K/V already written) -> [N, n_heads, d_v]."""
    n_heads = q.shape[1]
    out = q.new_empty(q.shape[0], n_heads, cache.v.shape[-1])
    for group in meta.groups:
        k, v = cache.gather(group.kv_index)
        qg = q[group.row_index].transpose(1, 2)  # [G, n_heads, Q, d]
        mask = group.mask(sliding_window)
        if logit_softcap is None:
            o = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        else:
            rep = n_heads // k.shape[1]
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
            scores = torch.tanh(qg @ k.transpose(-1, -2) * (scale / logit_softcap)) * logit_softcap
            o = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v
        o = o.transpose(1, 2)  # [G, Q, n_heads, d]
        out[group.row_index[group.row_valid]] = o[group.row_valid]
    return out
