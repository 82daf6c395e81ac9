"""The kinds of per-request cache state, each a group with its own rules for prefix hits, growth, commit
and rollback; `cache_coordinator.py` puts them behind one interface.

- `PagedGroup`: a paged cache (the target's KV; a drafter's context cache or a draft model's KV), blocks of
  `block_size` tokens from one `BlockManager`, a table per request. Rolled back by length; full blocks of
  committed tokens join its prefix cache.
- `StateGroup`: recurrent-state slots (a hybrid target's, or a hybrid draft model's), one per running
  request, and for prefix hits a few checkpoint slots holding the state after prefixes that end at an
  interval. Its states are changed by the runner; the group hands out the copies to make (`StateCopy`).
  A recurrent state is rolled back by replay from the forward's checkpoint (the target's verification),
  or never needs it: a draft model drafts on a copy of its committed state (`DraftModelDrafter`).

Only integers live here; the tensors belong to the runners that read and write them.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from specserve.core.block_manager import BlockManager


@dataclass(frozen=True)
class StateCopy:
    """Copy slot `src`'s recurrent state into slot `dst` (every linear-attention layer)."""

    src: int
    dst: int


@dataclass
class PagedEntry:
    """A request's part of a paged cache: its blocks in position order, the content ids of its leading
    blocks that the prefix cache knows, and how many leading tokens' rows hold final content."""

    block_table: list[int] = field(default_factory=list)
    prefix_ids: list[int] = field(default_factory=list)
    num_cached: int = 0


Record = TypeVar("Record")
Entry = TypeVar("Entry", bound=PagedEntry)


class RecordGroup(Generic[Record]):
    """A record per request of `record_type` (what an owner keeps per request), freed with the request like
    every group. On its own it holds no cache memory (a drafter's newest target feature)."""

    def __init__(self, record_type: type[Record]):
        self.record_type = record_type
        self.entries: dict[str, Record] = {}

    def entry(self, request_id: str) -> Record | None:
        return self.entries.get(request_id)

    def open(self, request_id: str) -> Record:
        """The request's record, a new empty one if it has none."""
        entry = self.entries.get(request_id)
        if entry is None:
            entry = self.entries[request_id] = self.record_type()
        return entry

    def free(self, request_id: str) -> None:
        self.entries.pop(request_id, None)


class PagedGroup(RecordGroup[Entry]):
    """One paged cache's blocks and each request's entry (of `entry_type`, which an owner may extend with
    what else it keeps per request: freeing the entry drops that too)."""

    def __init__(self, blocks: BlockManager, entry_type: type[Entry] = PagedEntry, limits_prefix_hits=False):
        super().__init__(entry_type)
        self.blocks = blocks
        self.limits_prefix_hits = limits_prefix_hits

    @property
    def block_size(self) -> int:
        return self.blocks.block_size

    def free(self, request_id: str) -> None:
        entry = self.entries.pop(request_id, None)
        if entry is not None:
            self.blocks.free(entry)

    def hit(self, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        """Its cached blocks holding the longest chain of `token_ids`' full blocks within `max_tokens`."""
        return self.blocks.match(token_ids, max_tokens)

    def attach(self, request_id: str, token_ids: Sequence[int], num_tokens: int) -> None:
        """Start the request afresh from its cached first `num_tokens` tokens (a hit of this group; with
        none, it has no entry until its owner opens one)."""
        self.free(request_id)
        if num_tokens:
            entry = self.open(request_id)
            self.blocks.attach(entry, self.hit(token_ids, num_tokens))
            entry.num_cached = num_tokens

    def roll_back(self, entry: Entry, num_tokens: int, token_ids: Callable[[], Sequence[int]]) -> None:
        """Keep the rows of the first `num_tokens` tokens, which are final (a length change: the blocks past
        them go back); the full blocks among them join the prefix cache (`token_ids()` gives at least those
        tokens)."""
        entry.num_cached = num_tokens
        self.blocks.shrink(entry, num_tokens)
        self.blocks.commit(entry, num_tokens, token_ids)


@dataclass(frozen=True)
class PagedSpec:
    """What a drafter's paged cache needs from the budget.

    `bytes_per_block`: its tensors for one block of the target's block size. `extra_tokens_per_request`:
    rows a running request may hold beyond the target's (drafted rows): its group gets the target's blocks
    plus enough for those, so it never runs out while the target's cache has room. `limits_prefix_hits`:
    its content comes from the target's forward, so a prefix hit may go only as far as this cache holds it
    too (a drafter that catches up from tokens does not limit hits). `prefix_caching`: whether its blocks
    may join a prefix cache at all. `group_type` and `entry_type`: the group's rules and what its owner
    keeps per request, where they are its owner's own."""

    bytes_per_block: int
    extra_tokens_per_request: int = 0
    limits_prefix_hits: bool = False
    prefix_caching: bool = True
    group_type: type[PagedGroup] = PagedGroup
    entry_type: type[PagedEntry] = PagedEntry


class PrefixStates:
    """Hybrid targets: a prefix-cache hit needs the recurrent state at its end as well. A few checkpoint
    slots (beside the running requests' state slots) hold the state after prefixes that end at a multiple
    of `interval` tokens, keyed by the content id of the prefix's last block; the least recently used one
    is overwritten when a new prefix needs a slot."""

    def __init__(self, slots: range, interval: int, block_size: int):
        self.free_slots = deque(slots)
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # content id -> checkpoint slot, LRU first
        self.blocks_per_interval = interval // block_size

    @property
    def capacity(self) -> int:
        return len(self.free_slots) + len(self.slot_of)

    def usable(self, prefix_ids: list[int]) -> int:
        """Of a hit on blocks with these content ids, how many blocks lead to a kept state."""
        every = self.blocks_per_interval
        for n in range(len(prefix_ids) // every * every, 0, -every):
            if prefix_ids[n - 1] in self.slot_of:
                return n
        return 0

    def take(self, content_id: int) -> int:
        """The slot holding the state after the prefix `content_id` ends (a hit from `usable`)."""
        self.slot_of.move_to_end(content_id)
        return self.slot_of[content_id]

    def slot_for(self, content_id: int, num_blocks: int) -> int | None:
        """Where to keep the state after a prefix of `num_blocks` blocks ending in `content_id`; None when
        it is not at an interval or already kept."""
        if num_blocks % self.blocks_per_interval or content_id in self.slot_of or not self.capacity:
            return None
        slot = self.free_slots.popleft() if self.free_slots else self.slot_of.popitem(last=False)[1]
        self.slot_of[content_id] = slot
        return slot


class StateGroup:
    """Recurrent-state slots: one taken when a request starts running, given back when it finishes or is
    preempted (it then restarts from position 0, from a zero state); as many as requests may run at once,
    so taking one never fails. With `checkpoints`, the prefix cache's kept states too."""

    def __init__(self, slots: Sequence[int], checkpoints: PrefixStates | None = None):
        self.free_slots: deque[int] = deque(slots)
        self.checkpoints = checkpoints
        self.slot_of: dict[str, int] = {}  # request id -> its slot

    @property
    def num_slots(self) -> int:
        return len(self.free_slots) + len(self.slot_of)

    def take(self, request_id: str) -> int:
        slot = self.slot_of[request_id] = self.free_slots.popleft()
        return slot

    def free(self, request_id: str) -> None:
        slot = self.slot_of.pop(request_id, None)
        if slot is not None:
            self.free_slots.append(slot)

    def usable(self, content_ids: list[int]) -> int:
        """Of a prefix hit on blocks with these content ids, how many blocks end where a state is kept."""
        return self.checkpoints.usable(content_ids) if self.checkpoints is not None else 0

    def restore(self, request_id: str, content_id: int) -> StateCopy:
        """The copy that starts the request from the state kept after the prefix ending in `content_id`."""
        return StateCopy(self.checkpoints.take(content_id), self.slot_of[request_id])

    def save(self, request_id: str, content_id: int, num_blocks: int) -> list[StateCopy]:
        """The copy that keeps the request's state after a committed prefix of `num_blocks` blocks ending in
        `content_id`, if that prefix ends at an interval and is not kept yet."""
        if self.checkpoints is None:
            return []
        slot = self.checkpoints.slot_for(content_id, num_blocks)
        return [StateCopy(self.slot_of[request_id], slot)] if slot is not None else []
