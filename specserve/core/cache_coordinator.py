"""Every kind of per-request cache state behind one interface: the scheduler asks the coordinator, never a
cache group.

The groups (`cache_groups.py`): the target's paged KV cache; a hybrid target's recurrent-state slots with
their interval checkpoints; and each drafter's own caches (a context cache of projected target features, a
draft model's KV and state slots). For a request the coordinator answers how much of its prompt a prefix
hit covers (the length every group agrees on), grows its cache, commits computed tokens (prefix blocks
registered, recurrent states kept at intervals), rolls it back (each group by its own rule) and frees it.
Recurrent states are changed by the runner: the coordinator hands out the copies to make (`StateCopy`),
which the step carries to the runner as data.

Memory: `plan_cache_memory` splits one budget (`kv_cache_memory`) over every group, drafters' included, so
the blocks the scheduler preempts against are all the memory the caches take. A drafter's paged group has
the target's blocks plus its drafted rows' per running request, so it never runs out first.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from specserve.config import SpecserveError
from specserve.core.block_manager import BlockManager
from specserve.core.cache_groups import (
    PagedGroup,
    PagedSpec,
    PrefixStates,
    RecordGroup,
    StateCopy,
    StateGroup,
)


@dataclass(frozen=True)
class DrafterCacheSpec:
    """What a drafter's own caches need: its paged caches, and recurrent-state bytes per slot (a hybrid
    draft model's; 0 for none) and slots per running request (a group of `max_num_seqs` slots each)."""

    paged: tuple[PagedSpec, ...] = ()
    state_bytes_per_slot: int = 0
    state_slots_per_request: int = 1
    record_type: type | None = None  # a record per request that holds no cache memory


@dataclass(frozen=True)
class CacheLayout:
    """Bytes per unit of each group of an engine: the target's KV per block and recurrent state per slot
    (0 for attention-only models), and the drafter's."""

    kv_bytes_per_block: int
    state_bytes_per_slot: int = 0
    drafter: DrafterCacheSpec = DrafterCacheSpec()


@dataclass(frozen=True)
class CachePlan:
    """How the budget was split: blocks of the target's KV cache, recurrent-state slots (one per running
    request, then the prefix cache's checkpoints), and blocks of each drafter paged group; and whether
    prefix caching is on (a hybrid target's only where there is room for state checkpoints)."""

    enable_prefix_caching: bool
    num_blocks: int
    num_state_slots: int
    num_checkpoints: int
    num_state_slots_drafter: int  # in each of the drafter's state groups
    drafter_blocks: tuple[int, ...]
    bytes_used: int


def plan_cache_memory(
    layout: CacheLayout,
    budget: int,
    *,
    block_size: int,
    max_num_seqs: int,
    max_model_len: int,
    enable_prefix_caching: bool,
    budget_text: str | None = None,
) -> CachePlan:
    """Split `budget` bytes: first every running request's recurrent states (target and draft model), then,
    for a hybrid target with prefix caching, state checkpoints (one per running request, or as many as a
    quarter of what is left holds), and the rest as blocks of the target and drafter caches together, never
    more than the running batch can fill: every request at max_model_len (plus a block of verification
    slack). The caches are allocated (and zeroed) up front, so the cap saves real memory. `budget_text`:
    how errors name the budget (the user's `kv_cache_memory=...`)."""
    given = budget_text or f"kv_cache_memory={budget}"
    drafter_states = layout.drafter.state_bytes_per_slot * layout.drafter.state_slots_per_request
    states = max_num_seqs * (layout.state_bytes_per_slot + drafter_states)
    if states >= budget:
        raise SpecserveError(
            f"{given} does not even hold the recurrent states of max_num_seqs={max_num_seqs} sequences "
            f"({states / 2**20:.0f} MiB); raise kv_cache_memory or lower max_num_seqs"
        )
    checkpoints = 0
    if layout.state_bytes_per_slot and enable_prefix_caching:
        spare = budget - max_num_seqs * layout.state_bytes_per_slot
        checkpoints = max(0, min(max_num_seqs, spare // 4 // layout.state_bytes_per_slot))
    states += checkpoints * layout.state_bytes_per_slot
    extra = [max_num_seqs * _extra_blocks(spec, block_size) for spec in layout.drafter.paged]
    fixed = states + sum(n * spec.bytes_per_block for n, spec in zip(extra, layout.drafter.paged))
    per_block = layout.kv_bytes_per_block + sum(spec.bytes_per_block for spec in layout.drafter.paged)
    num_blocks = max(0, budget - fixed) // per_block
    num_blocks = min(num_blocks, max_num_seqs * (-(-max_model_len // block_size) + 1))
    if num_blocks * block_size < max_model_len:
        raise SpecserveError(
            f"{given} holds {num_blocks * block_size} tokens, fewer than max_model_len={max_model_len}; "
            "raise kv_cache_memory or lower max_model_len"
        )
    return CachePlan(
        enable_prefix_caching=enable_prefix_caching and (not layout.state_bytes_per_slot or checkpoints > 0),
        num_blocks=num_blocks,
        num_state_slots=max_num_seqs if layout.state_bytes_per_slot else 0,
        num_checkpoints=checkpoints,
        num_state_slots_drafter=max_num_seqs if drafter_states else 0,
        drafter_blocks=tuple(num_blocks + n for n in extra),
        bytes_used=fixed + num_blocks * per_block,
    )


@dataclass
class DrafterCaches:
    """A drafter's own groups: paged ones in the order of its `DrafterCacheSpec.paged`, groups of state slots
    (`state_slots_per_request` of them, slots numbered on from one group to the next), and its per-request
    records."""

    paged: list[PagedGroup]
    states: list[StateGroup] = field(default_factory=list)
    records: RecordGroup | None = None

    @classmethod
    def build(
        cls,
        spec: DrafterCacheSpec,
        num_blocks: Sequence[int],
        num_state_slots: int,
        block_size: int,
        enable_prefix_caching: bool,
    ) -> DrafterCaches:
        paged = [
            group.group_type(
                BlockManager(n, block_size, enable_prefix_caching and group.prefix_caching),
                group.entry_type,
                group.limits_prefix_hits,
            )
            for n, group in zip(num_blocks, spec.paged, strict=True)
        ]
        n = num_state_slots
        states = [
            StateGroup(range(g * n, (g + 1) * n)) for g in range(spec.state_slots_per_request if n else 0)
        ]
        return cls(paged, states, RecordGroup(spec.record_type) if spec.record_type else None)

    @classmethod
    def standalone(
        cls, spec: DrafterCacheSpec, num_blocks: int, block_size: int, max_num_seqs: int
    ) -> DrafterCaches:
        """A drafter's caches outside an engine (benchmarks, tests), as an engine whose target cache has
        `num_blocks` blocks would size them; no prefix caching."""
        extra = [max_num_seqs * _extra_blocks(paged, block_size) for paged in spec.paged]
        slots = max_num_seqs if spec.state_bytes_per_slot else 0
        return cls.build(spec, [num_blocks + n for n in extra], slots, block_size, False)

    def free(self, request_id: str) -> None:
        for group in [*self.paged, *self.states]:
            group.free(request_id)
        if self.records is not None:
            self.records.free(request_id)

    def has_room(self, num_requests: int, num_tokens: int) -> bool:
        """Whether `num_requests` more requests of `num_tokens` rows each fit in every group now (each
        paged group's blocks with one to spare a request, and a state slot each)."""
        paged = all(
            num_requests * (-(-num_tokens // g.block_size) + 1) <= g.blocks.num_free_blocks
            for g in self.paged
        )
        return paged and all(len(g.free_slots) >= num_requests for g in self.states)


def _extra_blocks(spec: PagedSpec, block_size: int) -> int:
    """Blocks a running request's drafted rows may take beyond its target blocks (a partial block too)."""
    return -(-spec.extra_tokens_per_request // block_size) + 1


class CacheCoordinator:
    def __init__(
        self,
        kv: PagedGroup,
        states: StateGroup | None = None,
        drafter: DrafterCaches | None = None,
        state_checkpoint_interval: int | None = None,
    ):
        self.kv = kv
        self.states = states
        self.drafter = drafter or DrafterCaches([])
        # A prompt chunk of a hybrid target with prefix caching ends at the next interval, where its state
        # is kept; None: chunks end where the token budget says.
        self.chunk_interval = (
            state_checkpoint_interval if states is not None and states.checkpoints is not None else None
        )
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of them, found

    @classmethod
    def build(
        cls, plan: CachePlan, layout: CacheLayout, *, block_size: int, state_checkpoint_interval: int
    ) -> CacheCoordinator:
        """The target's groups as `plan` sized them, and the drafter's (`drafter`, to hand to the
        drafter)."""
        caching = plan.enable_prefix_caching
        states = None
        if plan.num_state_slots:
            kept = None
            if caching:
                slots = range(plan.num_state_slots, plan.num_state_slots + plan.num_checkpoints)
                kept = PrefixStates(slots, state_checkpoint_interval, block_size)
            states = StateGroup(range(plan.num_state_slots), kept)
        drafter = DrafterCaches.build(
            layout.drafter, plan.drafter_blocks, plan.num_state_slots_drafter, block_size, caching
        )
        kv = PagedGroup(BlockManager(plan.num_blocks, block_size, caching))
        return cls(kv, states, drafter, state_checkpoint_interval)

    # ---- what a step's pieces read ------------------------------------------------------------------
    @property
    def block_size(self) -> int:
        return self.kv.block_size

    @property
    def enable_prefix_caching(self) -> bool:
        return self.kv.blocks.enable_prefix_caching

    def block_table(self, request_id: str) -> list[int]:
        return self.kv.entries[request_id].block_table

    def state_slot(self, request_id: str) -> int | None:
        return self.states.slot_of[request_id] if self.states is not None else None

    def chunk(self, start: int, num_tokens: int) -> int:
        """A prompt chunk from `start` of at most `num_tokens`: it ends at the next interval it reaches,
        where the state is kept (hybrid targets with prefix caching)."""
        if self.chunk_interval is None:
            return num_tokens
        return min(num_tokens, (start // self.chunk_interval + 1) * self.chunk_interval - start)

    # ---- admission: a prefix hit every group agrees on ----------------------------------------------
    def prefix_hit(self, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        """The target's cached blocks a new request with these tokens may start from, within `max_tokens`:
        the longest chain the KV cache holds, cut to what each drafter cache that limits hits holds too,
        then to the longest prefix whose recurrent state is kept (hybrid targets)."""
        blocks = self.kv.hit(token_ids, max_tokens)
        for group in self.drafter.paged:
            if blocks and group.limits_prefix_hits:
                blocks = blocks[: len(group.hit(token_ids, len(blocks) * self.block_size))]
        if blocks and self.states is not None:
            blocks = blocks[: self.states.usable(self.kv.blocks.content_ids(blocks))]
        return blocks

    def can_admit(self, blocks: list[int], num_tokens: int) -> bool:
        """Whether a new request can start from these cached blocks with slots for `num_tokens` tokens, and
        (a hybrid target) a free state slot: one per request that may run, unless the cost profiler's timed
        steps borrow one meanwhile."""
        free_slot = self.states is None or bool(self.states.free_slots)
        return free_slot and self.kv.blocks.can_admit(blocks, num_tokens)

    def admit(self, request_id: str, token_ids: Sequence[int], blocks: list[int]) -> list[StateCopy]:
        """Start a request from cached blocks (from `prefix_hit`; none at all without prefix caching):
        every group attaches its part; returns the state copy its recurrent state starts from, if any."""
        entry = self.kv.open(request_id)
        if self.enable_prefix_caching:
            self.kv.blocks.attach(entry, blocks)
            self.prefix_queries += len(token_ids)
            self.prefix_hits += len(blocks) * self.block_size
            for group in self.drafter.paged:
                if group.limits_prefix_hits:
                    group.attach(request_id, token_ids, len(blocks) * self.block_size)
        if self.states is None:
            return []
        self.states.take(request_id)
        return [self.states.restore(request_id, entry.prefix_ids[-1])] if blocks else []

    # ---- running requests ---------------------------------------------------------------------------
    def can_grow(self, request_id: str, num_tokens: int) -> bool:
        return self.kv.blocks.can_grow(self.kv.entries[request_id], num_tokens)

    def grow(self, request_id: str, num_tokens: int) -> None:
        """Slots for the request's first `num_tokens` tokens (the caller checked `can_grow`)."""
        self.kv.blocks.grow(self.kv.entries[request_id], num_tokens)

    def commit(
        self, request_id: str, num_committed: int, token_ids: Callable[[], Sequence[int]]
    ) -> list[StateCopy]:
        """The request's first `num_committed` tokens are final (`token_ids()` gives at least those): their
        full blocks join the prefix cache, and its recurrent state is kept if they end a block at an
        interval (the copy to make)."""
        entry = self.kv.entries[request_id]
        entry.num_cached = num_committed
        self.kv.blocks.commit(entry, num_committed, token_ids)
        if self.states is None:
            return []
        num_blocks, partial = divmod(num_committed, self.block_size)
        if partial or not 0 < num_blocks <= len(entry.prefix_ids):
            return []
        return self.states.save(request_id, entry.prefix_ids[num_blocks - 1], num_blocks)

    def roll_back(self, request_id: str, num_tokens: int) -> None:
        """Back to slots for the first `num_tokens` tokens: KV by length. (A recurrent state is rolled back
        by the runner, from the forward's checkpoint; a drafter rolls its own caches back when it drafts.)"""
        self.kv.blocks.shrink(self.kv.entries[request_id], num_tokens)

    def free(self, request_id: str) -> None:
        """The request finished, was aborted or preempted: every group lets go of it."""
        self.kv.free(request_id)
        if self.states is not None:
            self.states.free(request_id)
        self.drafter.free(request_id)
