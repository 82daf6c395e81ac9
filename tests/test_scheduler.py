"""Scheduler and block manager on plain sequences (no model)."""

from __future__ import annotations

import pytest

from specserve.config import SamplingParams
from specserve.core.block_manager import BlockManager
from specserve.core.cache_coordinator import CacheCoordinator
from specserve.core.cache_groups import PagedEntry, PagedGroup
from specserve.core.sequence import Sequence, SequenceStatus
from specserve.engine.detokenizer import Detokenizer
from specserve.engine.scheduler import Scheduler

pytestmark = pytest.mark.kernel_agnostic


def seq(name: str, prompt_len: int, **params) -> Sequence:
    return Sequence(name, list(range(prompt_len)), SamplingParams(**params), max_tokens=16)


def caches(num_blocks: int, block_size: int) -> CacheCoordinator:
    """A target's KV cache alone (an attention-only model, no drafter)."""
    return CacheCoordinator(PagedGroup(BlockManager(num_blocks, block_size)))


def run_step(sched: Scheduler, sample_token: int = 7):
    """Commit a step the way the engine does: advance the cache, append a token where the piece ended."""
    plan = sched.schedule()
    plan.summary = [(p.seq.request_id, p.start, p.num_tokens, p.reaches_end) for p in plan.pieces]
    for piece in plan.pieces:
        piece.seq.num_computed_tokens += piece.num_tokens
        if piece.seq.num_computed_tokens == piece.seq.num_tokens:
            piece.seq.output_token_ids.append(sample_token)
    return plan


def test_block_manager_grow_shrink_free():
    bm = BlockManager(num_blocks=8, block_size=4)
    s = PagedEntry()
    assert bm.blocks_needed(s, 5) == 2
    bm.grow(s, 9)
    assert len(s.block_table) == 3 and bm.num_free_blocks == 5
    bm.shrink(s, 4)  # rollback to 4 tokens keeps one block
    assert len(s.block_table) == 1 and bm.num_free_blocks == 7
    bm.free(s)
    assert bm.num_free_blocks == 8 and all(c == 0 for c in bm.ref_counts)


def test_prefill_is_chunked_by_the_token_budget_and_decode_joins_it():
    sched = Scheduler(caches(64, 4), max_num_seqs=4, max_num_batched_tokens=10)
    a, b = seq("a", 3), seq("b", 25)
    sched.add(a)
    sched.add(b)
    plan = run_step(sched)
    assert [(p.seq.request_id, p.start, p.num_tokens) for p in plan.pieces] == [("a", 0, 3), ("b", 0, 7)]
    plan = run_step(sched)
    # a decodes its sampled token while b's prefill continues in the same step
    assert [(p.seq.request_id, p.start, p.num_tokens) for p in plan.pieces] == [("a", 3, 1), ("b", 7, 9)]
    assert not plan.summary[1][3]
    plan = run_step(sched)
    assert plan.summary == [("a", 4, 1, True), ("b", 16, 9, True)]


def test_max_num_seqs_limits_admission():
    sched = Scheduler(caches(64, 4), max_num_seqs=2, max_num_batched_tokens=100)
    for i in range(3):
        sched.add(seq(str(i), 4))
    plan = run_step(sched)
    assert [p.seq.request_id for p in plan.pieces] == ["0", "1"]
    assert [s.request_id for s in sched.waiting] == ["2"]


def test_out_of_blocks_preempts_the_newest_and_requeues_it_first():
    sched = Scheduler(caches(4, 4), max_num_seqs=4, max_num_batched_tokens=100)
    a, b = seq("a", 8), seq("b", 8)  # two blocks each: the cache is full after prefill
    sched.add(a)
    sched.add(b)
    run_step(sched)
    plan = run_step(sched)  # a needs a third block: b is preempted
    assert [p.seq.request_id for p in plan.pieces] == ["a"]
    assert plan.preempted == [b] and b.status is SequenceStatus.WAITING
    assert (
        b.num_computed_tokens == 0 and "b" not in sched.caches.kv.entries and b.metrics.num_preemptions == 1
    )
    assert sched.waiting[0] is b and b.output_token_ids == [7]  # its sampled token is kept
    sched.finish(a)
    plan = run_step(sched)  # b recomputes prompt + its sampled token in one piece
    assert [(p.seq.request_id, p.start, p.num_tokens) for p in plan.pieces] == [("b", 0, 9)]


class CharTokenizer:
    """Each token id is one character: enough to exercise text handling."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def test_stop_string_cuts_text_and_holds_back_a_possible_prefix():
    detok = Detokenizer(CharTokenizer())
    s = seq("a", 1, stop=["END"])
    for ch in "hello E":
        s.output_token_ids.append(ord(ch))
        assert detok.update(s) is None
    assert Detokenizer.emittable_text(s) == "hello"  # "E" could start "END"
    for ch in "ND!":
        s.output_token_ids.append(ord(ch))
        if (stop := detok.update(s)) is not None:
            break
    assert stop == "END" and s.output.text == "hello "
