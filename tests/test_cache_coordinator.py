"""The cache coordinator on its own (no model): each group's rules for rollback, a prefix hit every group
agrees on, one budget for the target's and the drafter's caches, and preemption freeing every group."""

from __future__ import annotations

import pytest

from specserve.config import SamplingParams, SpecserveError
from specserve.core.block_manager import BlockManager
from specserve.core.cache_coordinator import (
    CacheCoordinator,
    CacheLayout,
    DrafterCaches,
    DrafterCacheSpec,
    plan_cache_memory,
)
from specserve.core.cache_groups import PagedEntry, PagedGroup, PagedSpec, PrefixStates, StateCopy, StateGroup
from specserve.core.sequence import Sequence
from specserve.engine.scheduler import Scheduler

pytestmark = pytest.mark.kernel_agnostic

BLOCK = 4
TOKENS = list(range(10, 40))  # 30 tokens: 7 full blocks


def coordinator(
    num_blocks: int = 16,
    drafter_blocks: int | None = None,
    state_slots: int = 0,
    checkpoints: int = 0,
    interval_blocks: int = 2,
) -> CacheCoordinator:
    """The target's KV (prefix caching on), a drafter context group that limits hits (if
    `drafter_blocks`), and recurrent-state slots with `checkpoints` kept states (if `state_slots`)."""
    kv = PagedGroup(BlockManager(num_blocks, BLOCK, enable_prefix_caching=True))
    drafter = DrafterCaches([])
    if drafter_blocks is not None:
        blocks = BlockManager(drafter_blocks, BLOCK, enable_prefix_caching=True)
        drafter.paged.append(PagedGroup(blocks, limits_prefix_hits=True))
    states = None
    if state_slots:
        kept = PrefixStates(range(state_slots, state_slots + checkpoints), interval_blocks * BLOCK, BLOCK)
        states = StateGroup(range(state_slots), kept if checkpoints else None)
    return CacheCoordinator(kv, states, drafter, interval_blocks * BLOCK)


def computed(caches: CacheCoordinator, request_id: str, tokens: list[int]) -> list[StateCopy]:
    """A request that ran through `tokens` and committed them all; the state copies its commit asked for."""
    caches.admit(request_id, tokens, [])
    caches.grow(request_id, len(tokens))
    return caches.commit(request_id, len(tokens), lambda: tokens)


def drafter_context(caches: CacheCoordinator, request_id: str, tokens: list[int], num_rows: int) -> None:
    """The drafter wrote (and kept) context rows for the first `num_rows` tokens of a request."""
    group = caches.drafter.paged[0]
    entry = group.open(request_id)
    group.blocks.grow(entry, num_rows)
    group.roll_back(entry, num_rows, lambda: tokens)


# ---- each group's rules -----------------------------------------------------------------------------
def test_kv_rolls_back_by_length_and_registers_only_committed_blocks():
    caches = coordinator(num_blocks=8)
    caches.admit("a", TOKENS, [])
    caches.grow("a", 14)  # a verification block reaching into a fourth block
    assert len(caches.block_table("a")) == 4 and caches.kv.blocks.num_free_blocks == 4
    caches.commit("a", 9, lambda: TOKENS)  # 9 tokens kept: two full blocks join the prefix cache
    caches.roll_back("a", 10)  # the sampled token's slot stays; the rejected drafts' block goes back
    assert len(caches.block_table("a")) == 3 and caches.kv.blocks.num_free_blocks == 5
    assert caches.kv.blocks.num_cached_blocks == 2
    assert caches.prefix_hit(TOKENS, len(TOKENS) - 1) == caches.block_table("a")[:2]


def test_a_drafter_group_rolls_back_to_its_final_rows_and_caches_their_full_blocks():
    caches = coordinator(drafter_blocks=16)
    group = caches.drafter.paged[0]
    entry = group.open("a")
    group.blocks.grow(entry, 16)  # context rows and drafted rows
    group.roll_back(entry, 9, lambda: TOKENS[:9])  # rows < 9 are final
    assert entry.num_cached == 9 and len(entry.block_table) == 3 and group.blocks.num_free_blocks == 13
    assert len(group.hit(TOKENS, 12)) == 2  # row 8's block is not full: nothing more to cache
    group.blocks.grow(entry, 14)
    group.roll_back(entry, 12, lambda: TOKENS)
    assert len(group.hit(TOKENS, 12)) == 3


def test_states_are_kept_at_intervals_and_restored_on_a_hit():
    caches = coordinator(state_slots=2, checkpoints=2, interval_blocks=2)
    assert computed(caches, "a", TOKENS[:6]) == []  # one full block: not at an interval
    slot = caches.state_slot("a")
    caches.grow("a", 8)
    saves = caches.commit("a", 8, lambda: TOKENS)  # two blocks: an interval
    assert saves == [StateCopy(slot, 2)]
    assert caches.commit("a", 8, lambda: TOKENS) == []  # kept once
    hit = caches.prefix_hit(TOKENS, len(TOKENS) - 1)
    assert len(hit) == 2  # the KV cache holds two blocks, the state is kept after both
    restores = caches.admit("b", TOKENS, hit)
    assert restores == [StateCopy(2, caches.state_slot("b"))] and caches.state_slot("b") != slot


def test_a_hybrid_targets_hit_stops_where_a_state_is_kept():
    caches = coordinator(state_slots=2, checkpoints=1, interval_blocks=2)
    computed(caches, "a", TOKENS[:8])  # the state kept after two blocks
    caches.grow("a", 13)
    assert caches.commit("a", 13, lambda: TOKENS) == []  # three full blocks, not at an interval
    assert len(caches.kv.hit(TOKENS, len(TOKENS) - 1)) == 3
    assert len(caches.prefix_hit(TOKENS, len(TOKENS) - 1)) == 2


# ---- a hit every group agrees on ----------------------------------------------------------------------
def test_a_prefix_hit_is_what_every_group_holds():
    caches = coordinator(drafter_blocks=32, state_slots=2, checkpoints=6, interval_blocks=1)
    caches.admit("a", TOKENS, [])
    for n in range(BLOCK, 25, BLOCK):  # the target computed 24 tokens, keeping a state at every block
        caches.grow("a", n)
        caches.commit("a", n, lambda: TOKENS)
    drafter_context(caches, "a", TOKENS, 13)  # the drafter holds context rows of 3 blocks only
    caches.free("a")
    hit = caches.prefix_hit(TOKENS, len(TOKENS) - 1)
    assert len(caches.kv.hit(TOKENS, len(TOKENS) - 1)) == 6 and len(hit) == 3
    caches.admit("b", TOKENS, hit)
    entry = caches.drafter.paged[0].entry("b")
    assert entry.num_cached == 12 and len(entry.block_table) == 3  # the drafter starts from its 3 blocks
    assert caches.prefix_hits == 12 and caches.prefix_queries == 2 * len(TOKENS)  # a and b looked up


def test_without_prefix_caching_nothing_is_hit_or_attached():
    kv = PagedGroup(BlockManager(8, BLOCK, enable_prefix_caching=False))
    caches = CacheCoordinator(kv)
    computed(caches, "a", TOKENS[:12])
    caches.free("a")
    assert caches.prefix_hit(TOKENS, len(TOKENS) - 1) == []
    assert caches.admit("b", TOKENS, []) == [] and caches.prefix_queries == 0


# ---- one budget -----------------------------------------------------------------------------------------
def test_the_budget_pays_for_the_drafters_caches_too():
    target = CacheLayout(kv_bytes_per_block=1000)
    drafter = DrafterCacheSpec(paged=(PagedSpec(bytes_per_block=250, extra_tokens_per_request=7),))
    args = dict(block_size=BLOCK, max_num_seqs=4, max_model_len=64, enable_prefix_caching=True)
    alone = plan_cache_memory(target, 100_000, **args)
    both = plan_cache_memory(CacheLayout(1000, 0, drafter), 100_000, **args)
    assert alone.num_blocks == both.num_blocks == 68  # capped: 4 requests of 64 tokens, a block of slack
    # drafted rows: 7 tokens -> 2 blocks + 1 per request, 4 requests: 12 blocks of 250 bytes
    assert both.drafter_blocks == (68 + 12,)
    tight = plan_cache_memory(CacheLayout(1000, 0, drafter), 60_000, **args)
    assert tight.num_blocks == (60_000 - 12 * 250) // 1250
    assert tight.drafter_blocks == (tight.num_blocks + 12,)
    assert tight.bytes_used <= 60_000
    assert plan_cache_memory(target, 60_000, **args).num_blocks == 60  # more without the drafter
    with pytest.raises(SpecserveError, match="fewer than max_model_len=64"):
        plan_cache_memory(CacheLayout(1000, 0, drafter), 19_000, **args)


def test_the_budget_pays_for_recurrent_states_then_checkpoints():
    layout = CacheLayout(kv_bytes_per_block=100, state_bytes_per_slot=1000)
    args = dict(block_size=BLOCK, max_num_seqs=2, max_model_len=16, enable_prefix_caching=True)
    plan = plan_cache_memory(layout, 20_000, **args)
    # states of 2 requests (2000), checkpoints: a quarter of the rest holds 4, at most one per request
    assert plan.num_state_slots == 2 and plan.num_checkpoints == 2
    assert plan.num_blocks == min((20_000 - 4000) // 100, 2 * 5)
    off = plan_cache_memory(layout, 20_000, **{**args, "enable_prefix_caching": False})
    assert off.num_checkpoints == 0
    with pytest.raises(SpecserveError, match="does not even hold the recurrent states"):
        plan_cache_memory(layout, 2000, **args)


# ---- preemption -----------------------------------------------------------------------------------------
def test_preemption_frees_every_group_of_the_request():
    kv = PagedGroup(BlockManager(4, BLOCK))
    drafter = DrafterCaches([PagedGroup(BlockManager(8, BLOCK), PagedEntry)], [StateGroup(range(2))])
    caches = CacheCoordinator(kv, StateGroup(range(2)), drafter)
    sched = Scheduler(caches, max_num_seqs=2, max_num_batched_tokens=100)
    a, b = (Sequence(name, list(range(8)), SamplingParams(), max_tokens=8) for name in "ab")
    sched.add(a)
    sched.add(b)
    for piece in sched.schedule().pieces:  # both prefill two blocks: the KV cache is full
        piece.seq.num_computed_tokens += piece.num_tokens
        piece.seq.output_token_ids.append(7)
        # the drafter keeps something for each running request
        drafter.paged[0].blocks.grow(drafter.paged[0].open(piece.seq.request_id), 4)
        drafter.states[0].take(piece.seq.request_id)
    batch = sched.schedule()  # a needs a third block: b is preempted
    assert batch.preempted == [b] and [p.seq for p in batch.pieces] == [a]
    assert "b" not in kv.entries and "b" not in caches.states.slot_of
    assert drafter.paged[0].entry("b") is None and "b" not in drafter.states[0].slot_of
    assert drafter.paged[0].blocks.num_free_blocks == 7 and len(drafter.states[0].free_slots) == 1
    sched.finish(a)
    assert kv.blocks.num_free_blocks == 4 and drafter.paged[0].blocks.num_free_blocks == 8
    assert len(caches.states.free_slots) == 2 and len(drafter.states[0].free_slots) == 2


def test_a_hybrid_draft_models_two_slots_a_request_come_out_of_the_budget():
    drafter = DrafterCacheSpec(
        (PagedSpec(bytes_per_block=100),), state_bytes_per_slot=500, state_slots_per_request=2
    )
    args = dict(block_size=BLOCK, max_num_seqs=2, max_model_len=16, enable_prefix_caching=False)
    plan = plan_cache_memory(CacheLayout(100, 0, drafter), 10_000, **args)
    # 2 requests x 2 slots x 500 bytes; the rest in blocks of target and drafter KV (200 bytes a block)
    assert plan.num_state_slots_drafter == 2 and plan.num_blocks == min((10_000 - 2000 - 2 * 100) // 200, 10)
    caches = DrafterCaches.build(drafter, plan.drafter_blocks, plan.num_state_slots_drafter, BLOCK, False)
    committed, drafting = caches.states
    assert list(committed.free_slots) == [0, 1] and list(drafting.free_slots) == [2, 3]
    committed.take("a"), drafting.take("a")
    caches.free("a")
    assert len(committed.free_slots) == len(drafting.free_slots) == 2
    with pytest.raises(SpecserveError, match="does not even hold the recurrent states"):
        plan_cache_memory(CacheLayout(100, 0, drafter), 2000, **args)
