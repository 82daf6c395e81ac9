"""What one forward tells its layers: where each piece's rows lie in the flat batch, which paged-cache blocks
and recurrent-state slots hold its sequence, and which pieces' states must be kept for a rollback.

It knows no layer type. Each kind of layer derives the plan it needs from it (attention its per-row key
plan, Gated DeltaNet its piece layout) once per forward, through `derived`, and reads only its own part.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import torch

from specserve.layers.transfer import to_device

Plan = TypeVar("Plan")


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
class PieceIndex:
    """The forward's pieces as a GPU kernel reads them (int32, on the model's device)."""

    query_start: torch.Tensor  # [P + 1] offsets of the pieces in the flat batch
    context_lens: torch.Tensor  # [P] keys of each piece's sequence, new ones included
    tables: torch.Tensor  # [P, max blocks] block tables, zero-padded
    positions: torch.Tensor  # [N] absolute position of each query row

    @classmethod
    def of(
        cls,
        query_start: torch.Tensor,
        context_lens: torch.Tensor,
        tables: torch.Tensor,
        positions: torch.Tensor,
    ) -> PieceIndex:
        """From tensors already on the device, converted there (inside a CUDA graph too)."""
        return cls(*(t.to(torch.int32) for t in (query_start, context_lens, tables, positions)))


class StateCheckpoints:
    """Asked for by the caller, filled by the layers during one forward: the pieces (indices into the
    forward's pieces) whose recurrent state may be rolled back, and per layer index what that layer kept
    to do it."""

    def __init__(self, pieces: list[int]):
        self.pieces = sorted(set(pieces))
        self.layers: dict[int, Any] = {}


@dataclass
class ForwardMetadata:
    """Where a step's tokens go in the caches and what each piece may attend to."""

    slot_mapping: torch.Tensor  # [N] flat paged-cache slot written by each new token
    query_start: list[int]  # [P + 1] offsets of the pieces in the flat batch
    context_lens: list[int]  # [P] tokens of the piece's sequence in the cache after this step
    block_tables: list[list[int]]  # [P] the sequence's cache blocks, in position order
    tables: torch.Tensor  # [P, max blocks] the block tables, zero-padded
    positions: torch.Tensor  # [N] absolute position of each new token
    block_size: int
    causal: bool = True  # False: every query sees all of its sequence's keys (DSpark's draft blocks)
    state_slots: torch.Tensor | None = None  # [P] long: each piece's recurrent-state slot (hybrid models)
    checkpoints: StateCheckpoints | None = None  # pieces whose recurrent state may be rolled back
    # Pieces of prompt tokens only: speculation never changes how they are computed, so they need no row
    # invariance and attention takes each in one call, however short
    prompt_pieces: frozenset[int] = frozenset()
    # Prebuilt from static device buffers (worker/cuda_graphs.py); None: a kernel derives it per forward
    piece_index: PieceIndex | None = None
    _derived: dict[Callable, Any] = field(default_factory=dict, repr=False)

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
        prompt_pieces: frozenset[int] = frozenset(),
    ) -> ForwardMetadata:
        num_pieces = len(context_lens)
        q_lens = [query_start[p + 1] - query_start[p] for p in range(num_pieces)]
        tables = padded_block_tables(block_tables)
        piece_of_token = torch.repeat_interleave(torch.arange(num_pieces), torch.tensor(q_lens))
        return cls(
            slot_mapping=slot_mapping(tables, piece_of_token, positions, block_size),
            query_start=query_start,
            context_lens=context_lens,
            block_tables=block_tables,
            tables=tables,
            positions=positions,
            block_size=block_size,
            causal=causal,
            state_slots=state_slots,
            checkpoints=checkpoints,
            prompt_pieces=prompt_pieces,
        )

    @property
    def device(self) -> torch.device:
        return self.positions.device

    def to(self, device: torch.device, *extra: torch.Tensor) -> tuple[ForwardMetadata, list[torch.Tensor]]:
        """This metadata with its tensors on `device`, with `extra` host int64 tensors, in one copy."""
        tensors = [self.slot_mapping, self.tables, self.positions, *extra]
        if self.state_slots is not None:
            tensors.append(self.state_slots)
        moved = to_device(device, *tensors)
        meta = replace(
            self,
            slot_mapping=moved[0],
            tables=moved[1],
            positions=moved[2],
            state_slots=moved[-1] if self.state_slots is not None else None,
            _derived={},
        )
        return meta, moved[3 : 3 + len(extra)]

    @property
    def num_pieces(self) -> int:
        return len(self.context_lens)

    @property
    def num_tokens(self) -> int:
        return self.query_start[-1]

    def query_lens(self) -> list[int]:
        return [self.query_start[p + 1] - self.query_start[p] for p in range(self.num_pieces)]

    def derived(self, build: Callable[[ForwardMetadata], Plan]) -> Plan:
        """`build(self)`, computed at the first call of this forward and shared by every later layer."""
        if build not in self._derived:
            self._derived[build] = build(self)
        return self._derived[build]
