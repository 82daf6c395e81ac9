"""Runs a model over our paged KV cache without the engine, for parity tests against transformers."""

from __future__ import annotations

import torch

from specserve.layers.attention import KVCache
from specserve.layers.gated_deltanet import RecurrentState, RecurrentStateSpec
from specserve.layers.metadata import ForwardMetadata, StateCheckpoints


class PagedHarness:
    """Feeds pieces of several sequences through one model forward per step, like the engine does.

    Hybrid models also get a pool of `num_state_slots` recurrent-state slots per linear-attention layer, one
    slot per sequence; `step(..., checkpoint=ids)` checkpoints those sequences' pieces so that `rollback`
    can roll their recurrent state back too.
    """

    def __init__(
        self,
        model,
        num_blocks: int = 128,
        block_size: int = 4,
        dtype=torch.float32,
        num_state_slots: int = 16,
    ):
        self.model = model
        self.block_size = block_size
        caches: list[KVCache | RecurrentState] = []
        for spec in model.cache_specs():
            if isinstance(spec, RecurrentStateSpec):
                caches.append(spec.allocate(num_state_slots, dtype))
                continue
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
        self.state_slots: dict[int, int] = {}  # sequence id -> its recurrent-state slot
        self.checkpoints: StateCheckpoints | None = None  # of the last step
        self.checkpointed: dict[int, tuple[int, int]] = {}  # sequence id -> (piece index, piece start)

    def step(
        self, pieces: list[tuple[int, list[int]]], capture_layers=(), checkpoint=()
    ) -> tuple[list[torch.Tensor], dict]:
        """pieces: (sequence id, new token ids). Returns logits per piece and the captured layer outputs.
        `checkpoint`: sequence ids whose piece's recurrent state `rollback` may roll back (hybrid models)."""
        starts = [self.lengths.get(seq_id, 0) for seq_id, _ in pieces]
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
        slots, self.checkpoints, self.checkpointed = None, None, {}
        if getattr(self.model, "has_recurrent_state", False):
            slots = torch.tensor([self.state_slots.setdefault(s, len(self.state_slots)) for s, _ in pieces])
            marked = [i for i, (seq_id, _) in enumerate(pieces) if seq_id in checkpoint]
            self.checkpoints = StateCheckpoints(marked) if marked else None
            self.checkpointed = {pieces[i][0]: (i, starts[i]) for i in marked}
        meta = ForwardMetadata.build(
            query_start,
            context_lens,
            tables,
            pos,
            self.block_size,
            state_slots=slots,
            checkpoints=self.checkpoints,
        )
        with torch.no_grad():
            hidden, captured = self.model(torch.tensor(tokens), pos, meta, self.kv_caches, capture_layers)
            logits = self.model.compute_logits(hidden)
        return [logits[query_start[i] : query_start[i + 1]] for i in range(len(pieces))], captured

    def rollback(self, seq_id: int, length: int) -> None:
        """Forget tokens past `length` (speculative rejection): only the length changes; a hybrid model's
        recurrent state is rolled back too, which needs the sequence's last piece to be checkpointed."""
        if getattr(self.model, "has_recurrent_state", False) and length < self.lengths[seq_id]:
            if seq_id not in self.checkpointed:
                raise ValueError(f"sequence {seq_id}: its last piece was not checkpointed, cannot roll back")
            piece, start = self.checkpointed[seq_id]
            self.model.rollback_states(self.checkpoints, self.kv_caches, {piece: length - start})
        self.lengths[seq_id] = length
