"""Continuous batching: which sequences run this step and how many of their tokens each.

Every sequence is just "tokens not yet in the KV cache": a new prompt, a prompt chunk, the last sampled
token, or a whole sequence again after preemption. So prefill, chunked prefill and decode share one path
(as in vLLM v1). Running sequences go first (FCFS); waiting ones are admitted while the token budget,
`max_num_seqs` and free KV blocks allow. When blocks run out, the most recently admitted running
sequence is preempted: its blocks are freed and it is recomputed later from its tokens, so nothing is lost.
With prefix caching, a sequence is admitted with the longest cached chain of its full blocks (at most all
but its last token: a step must compute something) and starts computing after it; a drafter that keeps its
own context may shorten the hit to what it holds too (`DrafterPrefix`).
After the step, `update_from_output` commits what was computed: verified drafts extend the cache, rejected
ones are rolled back by length, the full blocks of committed tokens join the prefix cache, and finished
sequences leave the batch with their blocks freed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from typing import Protocol

from specserve.core.batch import PieceResult, ScheduledPiece, StepBatch
from specserve.core.block_manager import BlockManager, PrefixStates, SlotPool
from specserve.core.proposal import DraftProposal
from specserve.core.sequence import Sequence, SequenceStatus


class DrafterPrefix(Protocol):
    """A drafter with a context of its own, which a cached target prefix must not skip."""

    def cached_prefix_len(self, seq: Sequence, num_tokens: int) -> int:
        """How much of a target prefix hit of `num_tokens` tokens the drafter holds too (block-aligned)."""
        ...

    def attach_cached_prefix(self, seq: Sequence, num_tokens: int) -> None:
        """`seq` starts with its first `num_tokens` tokens cached: take the drafter's part of them."""
        ...


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        state_slots: SlotPool | None = None,
        drafter_prefix: DrafterPrefix | None = None,
        prefix_states: PrefixStates | None = None,
    ):
        self.block_manager = block_manager
        self.state_slots = state_slots  # hybrid models: a recurrent-state slot per running sequence
        self.drafter_prefix = drafter_prefix
        self.prefix_states = prefix_states  # hybrid targets' state checkpoints for prefix-cache hits
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of them, found
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def load(self) -> int:
        """Requests running or waiting."""
        return len(self.running) + len(self.waiting)

    def decoding(self) -> list[Sequence]:
        """The running sequences whose next step is a decode step (one token not yet cached)."""
        return [s for s in self.running if s.num_uncomputed_tokens == 1]

    def schedule(self, drafts: Mapping[str, DraftProposal] | None = None) -> StepBatch:
        """This step's pieces; `drafts` (by request id, decode steps only) ride along as far as the token
        budget allows."""
        drafts = drafts or {}
        out = StepBatch()
        budget = self.max_num_batched_tokens
        bm = self.block_manager
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            draft = drafts.get(seq.request_id)
            if draft is not None:
                n = min(seq.num_uncomputed_tokens + len(draft.token_ids), budget)
            else:
                n = self._chunk(seq, seq.num_computed_tokens, min(seq.num_uncomputed_tokens, budget))
            while not bm.can_grow(seq, seq.num_computed_tokens + n) and self.running[-1] is not seq:
                out.preempted.append(self._preempt(self.running.pop()))
            if not bm.can_grow(seq, seq.num_computed_tokens + n):
                out.preempted.append(self._preempt(self.running.pop()))
                break
            bm.grow(seq, seq.num_computed_tokens + n)
            own = min(n, seq.num_uncomputed_tokens)
            verified = draft.truncate(n - own) if n > own else None
            out.pieces.append(ScheduledPiece(seq, seq.num_computed_tokens, own, verified))
            budget -= n
            i += 1
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not out.preempted:
            seq = self.waiting[0]
            cached = self._cached_prefix(seq)
            num_cached = len(cached) * bm.block_size
            n = self._chunk(seq, num_cached, min(seq.num_tokens - num_cached, budget))
            if not bm.can_admit(cached, num_cached + n):
                break
            self.waiting.popleft()
            self._admit(seq, cached)
            bm.grow(seq, seq.num_computed_tokens + n)
            seq.status = SequenceStatus.RUNNING
            if self.state_slots is not None:
                self.state_slots.take(seq)
            self.running.append(seq)
            out.pieces.append(ScheduledPiece(seq, seq.num_computed_tokens, n))
            budget -= n
        return out

    def _chunk(self, seq: Sequence, start: int, n: int) -> int:
        """A prompt chunk from `start`: with state checkpoints it ends at the next interval it reaches,
        where the state is kept."""
        if self.prefix_states is None:
            return n
        interval = self.prefix_states.blocks_per_interval * self.block_manager.block_size
        return min(n, (start // interval + 1) * interval - start)

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """The cached blocks `seq` may start from (it is waiting, with nothing computed). Cached tokens get
        no logits, so a request that asks for prompt logprobs takes none past the prompt it has scored
        (none at first; after a preemption, what it scored before)."""
        bm = self.block_manager
        limit = seq.num_tokens - 1
        if seq.params.prompt_logprobs is not None:
            limit = min(limit, len(seq.prompt_logprobs))
        cached = bm.match(seq.all_token_ids, limit) if bm.enable_prefix_caching else []
        if cached and self.drafter_prefix is not None:
            usable = self.drafter_prefix.cached_prefix_len(seq, len(cached) * bm.block_size)
            cached = cached[: usable // bm.block_size]
        if cached and self.prefix_states is not None:
            cached = cached[: self.prefix_states.usable(bm.content_ids(cached))]
        return cached

    def _admit(self, seq: Sequence, cached: list[int]) -> None:
        bm = self.block_manager
        num_cached = len(cached) * bm.block_size
        if bm.enable_prefix_caching:
            bm.attach(seq, cached)
            if self.drafter_prefix is not None:
                self.drafter_prefix.attach_cached_prefix(seq, num_cached)
            if self.prefix_states is not None and cached:
                seq.restore_state_from = self.prefix_states.take(seq.prefix_ids[-1])
            self.prefix_queries += seq.num_tokens
            self.prefix_hits += num_cached
            if seq.metrics.first_scheduled_time is None:
                seq.num_cached_tokens = num_cached
        seq.num_computed_tokens = num_cached

    def _preempt(self, seq: Sequence) -> Sequence:
        self._release(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.metrics.num_preemptions += 1
        self.waiting.appendleft(seq)
        return seq

    def update_from_output(
        self, batch: StepBatch, results: list[PieceResult | None]
    ) -> list[tuple[int, int]]:
        """Commit a step: the cache now holds each piece's tokens and its accepted drafts; the blocks past
        them (rejected drafts) go back to the free list, a length change; finished sequences leave.
        Returns the recurrent states to keep for the prefix cache, (state slot, checkpoint slot) pairs to
        copy before the next step."""
        saves = []
        for piece, result in zip(batch.pieces, results):
            seq = piece.seq
            seq.num_computed_tokens += piece.num_tokens + (result.num_accepted if result is not None else 0)
            self.block_manager.commit(seq, seq.num_computed_tokens, lambda seq=seq: seq.all_token_ids)
            if self.prefix_states is not None:
                saves += self._state_to_keep(seq)
            if seq.is_finished:
                self.finish(seq)
            elif piece.draft is not None:
                self.block_manager.shrink(seq, seq.num_tokens)
        return saves

    def _state_to_keep(self, seq: Sequence) -> list[tuple[int, int]]:
        """The copy that keeps `seq`'s state if its committed tokens end a cached block at an interval."""
        num_blocks, partial = divmod(seq.num_computed_tokens, self.block_manager.block_size)
        if partial or not 0 < num_blocks <= len(seq.prefix_ids):
            return []
        slot = self.prefix_states.slot_for(seq.prefix_ids[num_blocks - 1], num_blocks)
        return [(seq.state_slot, slot)] if slot is not None else []

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence wherever it is and free its blocks at once."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)

    def _release(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        if self.state_slots is not None:
            self.state_slots.give_back(seq)
