"""Paged KV cache bookkeeping: fixed-size blocks, a free list, per-sequence block tables, ref counts; and
the recurrent-state slots of hybrid models, one per running sequence.

Only integers live here; the KV and state tensors themselves belong to the model runner. Ref counts let
several sequences share a block later (prefix caching); today every block has one owner.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol


class HasBlockTable(Protocol):
    """Whatever owns cache blocks: a target sequence, or a drafter's per-request state."""

    block_table: list[int]


class HasStateSlot(Protocol):
    state_slot: int | None


class SlotPool:
    """Recurrent-state slots: one taken when a sequence starts running, given back when it finishes or
    is preempted (it then restarts from position 0, from a zero state). As many slots as sequences may
    run at once, so taking one never fails."""

    def __init__(self, num_slots: int):
        self.free_slots: deque[int] = deque(range(num_slots))

    def take(self, owner: HasStateSlot) -> None:
        owner.state_slot = self.free_slots.popleft()

    def give_back(self, owner: HasStateSlot) -> None:
        if owner.state_slot is not None:
            self.free_slots.append(owner.state_slot)
            owner.state_slot = None


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1:
            raise ValueError("the KV cache has no room for a single block; raise kv_cache_memory")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self.ref_counts = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_blocks)

    def blocks_needed(self, seq: HasBlockTable, num_tokens: int) -> int:
        """Extra blocks `seq` needs so that its first `num_tokens` tokens have cache slots."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def can_grow(self, seq: HasBlockTable, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= self.num_free_blocks

    def grow(self, seq: HasBlockTable, num_tokens: int) -> None:
        """Give `seq` slots for its first `num_tokens` tokens (caller checked `can_grow`)."""
        for _ in range(self.blocks_needed(seq, num_tokens)):
            block = self.free_blocks.popleft()
            self.ref_counts[block] = 1
            seq.block_table.append(block)

    def shrink(self, seq: HasBlockTable, num_tokens: int) -> None:
        """Release the blocks past the first `num_tokens` tokens (rolling back rejected drafts)."""
        keep = -(-num_tokens // self.block_size)
        for block in seq.block_table[keep:]:
            self._release(block)
        del seq.block_table[keep:]

    def free(self, seq: HasBlockTable) -> None:
        self.shrink(seq, 0)

    def _release(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free_blocks.append(block)
