"""Paged cache bookkeeping: fixed-size blocks, a free list, the owners' block tables, ref counts, the
prefix cache. Only integers live here; the tensors themselves belong to the runners.

Prefix caching: a full block whose tokens are committed is registered under its key, (the content id of
the block before it, its tokens): a chain, so a key names the whole prefix, and exact (dict lookup compares
the tokens; no hash collision can alias two prefixes). A new sequence takes the longest registered chain
of its tokens by reference. A block whose last owner leaves keeps its content and waits, least recently
freed first, until a new block is needed; only then is it evicted (its key dropped, its content ids never
reused). Registered blocks are never written again: every write goes past an owner's committed tokens.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from typing import Protocol

EMPTY_PREFIX = 0  # the content id before a sequence's first block


class HasBlockTable(Protocol):
    """Whatever owns cache blocks: a target sequence, or a drafter's per-request state. `prefix_ids`
    holds the content id of each leading full block that is known to the prefix cache."""

    block_table: list[int]
    prefix_ids: list[int]


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False):
        if num_blocks < 1:
            raise ValueError("the KV cache has no room for a single block; raise kv_cache_memory")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.free_blocks: deque[int] = deque(range(num_blocks))  # blocks holding nothing reusable
        self.evictable: OrderedDict[int, None] = OrderedDict()  # unowned cached blocks, first freed first
        self.ref_counts = [0] * num_blocks
        self._cached: dict[tuple[int, tuple[int, ...]], int] = {}  # key -> block
        self._key_of: dict[int, tuple[int, tuple[int, ...]]] = {}  # block -> key
        self._content_id: dict[int, int] = {}  # block -> its content id
        self._content_ids = itertools.count(EMPTY_PREFIX + 1)

    @property
    def num_free_blocks(self) -> int:
        """Blocks a new allocation may take: empty ones and cached ones nobody holds."""
        return len(self.free_blocks) + len(self.evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._key_of)

    def blocks_needed(self, seq: HasBlockTable, num_tokens: int) -> int:
        """Extra blocks `seq` needs so that its first `num_tokens` tokens have cache slots."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def can_grow(self, seq: HasBlockTable, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= self.num_free_blocks

    def grow(self, seq: HasBlockTable, num_tokens: int) -> None:
        """Give `seq` slots for its first `num_tokens` tokens (caller checked `can_grow`)."""
        for _ in range(self.blocks_needed(seq, num_tokens)):
            block = self._allocate()
            self.ref_counts[block] = 1
            seq.block_table.append(block)

    def shrink(self, seq: HasBlockTable, num_tokens: int) -> None:
        """Release the blocks past the first `num_tokens` tokens (rolling back rejected drafts). The last
        ones go first, so that a chain's tail is evicted before its head."""
        keep = -(-num_tokens // self.block_size)
        for block in reversed(seq.block_table[keep:]):
            self._release(block)
        del seq.block_table[keep:]
        del seq.prefix_ids[num_tokens // self.block_size :]

    def free(self, seq: HasBlockTable) -> None:
        self.shrink(seq, 0)

    # ---- prefix cache -------------------------------------------------------------------------------
    def match(self, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        """The cached blocks holding the longest chain of `token_ids`' full blocks within its first
        `max_tokens` tokens (nothing when prefix caching is off)."""
        if not self.enable_prefix_caching:
            return []
        bs, blocks, parent = self.block_size, [], EMPTY_PREFIX
        for i in range(min(max_tokens, len(token_ids)) // bs):
            block = self._cached.get((parent, tuple(token_ids[i * bs : (i + 1) * bs])))
            if block is None:
                break
            blocks.append(block)
            parent = self._content_id[block]
        return blocks

    def content_ids(self, cached: list[int]) -> list[int]:
        return [self._content_id[block] for block in cached]

    def can_admit(self, cached: list[int], num_tokens: int) -> bool:
        """Whether a new sequence can start from these cached blocks with slots for `num_tokens` tokens
        (a cached block nobody holds counts against the free blocks it is taken from)."""
        unowned = sum(1 for b in cached if self.ref_counts[b] == 0)
        new = max(0, -(-num_tokens // self.block_size) - len(cached))
        return unowned + new <= self.num_free_blocks

    def attach(self, seq: HasBlockTable, cached: list[int]) -> None:
        """Start an empty `seq` from cached blocks (from `match`), by reference."""
        for block in cached:
            if self.ref_counts[block] == 0:
                del self.evictable[block]
            self.ref_counts[block] += 1
            seq.block_table.append(block)
            seq.prefix_ids.append(self._content_id[block])

    def commit(self, seq: HasBlockTable, num_committed: int, token_ids: Callable[[], list[int]]) -> None:
        """Register `seq`'s full blocks among its first `num_committed` tokens (which are final: never
        rolled back); `token_ids()` gives at least those tokens."""
        if not self.enable_prefix_caching:
            return
        bs, done = self.block_size, len(seq.prefix_ids)
        if num_committed // bs <= done:  # the common case: no block filled this step
            return
        tokens = token_ids()
        full = min(num_committed, len(tokens)) // bs
        for i in range(done, full):
            parent = seq.prefix_ids[-1] if seq.prefix_ids else EMPTY_PREFIX
            key = (parent, tuple(tokens[i * bs : (i + 1) * bs]))
            twin = self._cached.get(key)
            if twin is not None:  # computed meanwhile by another sequence: the chain goes on through it
                seq.prefix_ids.append(self._content_id[twin])
                continue
            block = seq.block_table[i]
            self._cached[key], self._key_of[block] = block, key
            self._content_id[block] = next(self._content_ids)
            seq.prefix_ids.append(self._content_id[block])

    def _allocate(self) -> int:
        if self.free_blocks:
            return self.free_blocks.popleft()
        block, _ = self.evictable.popitem(last=False)
        del self._cached[self._key_of.pop(block)]
        del self._content_id[block]
        return block

    def _release(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            if block in self._key_of:
                self.evictable[block] = None
            else:
                self.free_blocks.append(block)
