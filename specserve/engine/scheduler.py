"""Continuous batching: which sequences run this step and how many of their tokens each.

Every sequence is just "tokens not yet in the KV cache": a new prompt, a prompt chunk, the last sampled
token, or a whole sequence again after preemption. So prefill, chunked prefill and decode share one path
(as in vLLM v1). Running sequences go first (FCFS); waiting ones are admitted while the token budget,
`max_num_seqs` and free KV blocks allow. When blocks run out, the most recently admitted running
sequence is preempted: its caches are freed and it is recomputed later from its tokens, so nothing is lost.
With prefix caching, a sequence is admitted with the longest prefix every cache holds (at most all but its
last token: a step must compute something) and starts computing after it.
After the step, `update_from_output` commits what was computed: verified drafts extend the cache, rejected
ones are rolled back, the full blocks of committed tokens join the prefix cache, and finished sequences
leave the batch with their caches freed. All cache questions go to the cache coordinator
(core/cache_coordinator.py); the recurrent-state operations they need travel in the batch and the commit.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping

from specserve.core.batch import PieceResult, ScheduledPiece, StepBatch, StepCommit
from specserve.core.cache_coordinator import CacheCoordinator
from specserve.core.proposal import DraftProposal
from specserve.core.sequence import Sequence, SequenceStatus


class Scheduler:
    def __init__(self, caches: CacheCoordinator, max_num_seqs: int, max_num_batched_tokens: int):
        self.caches = caches
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
        caches = self.caches
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            draft = drafts.get(seq.request_id)
            if draft is not None:
                n = min(seq.num_uncomputed_tokens + len(draft.token_ids), budget)
            else:
                n = caches.chunk(seq.num_computed_tokens, min(seq.num_uncomputed_tokens, budget))
            end = seq.num_computed_tokens + n
            while not caches.can_grow(seq.request_id, end) and self.running[-1] is not seq:
                out.preempted.append(self._preempt(self.running.pop()))
            if not caches.can_grow(seq.request_id, end):
                out.preempted.append(self._preempt(self.running.pop()))
                break
            caches.grow(seq.request_id, end)
            own = min(n, seq.num_uncomputed_tokens)
            verified = draft.truncate(n - own) if n > own else None
            out.pieces.append(self._piece(seq, own, verified))
            budget -= n
            i += 1
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not out.preempted:
            seq = self.waiting[0]
            cached = self._cached_prefix(seq)
            num_cached = len(cached) * caches.block_size
            n = caches.chunk(num_cached, min(seq.num_tokens - num_cached, budget))
            if not caches.can_admit(cached, num_cached + n):
                break
            self.waiting.popleft()
            out.restores += caches.admit(seq.request_id, seq.all_token_ids, cached)
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = time.monotonic()
                seq.num_cached_tokens = num_cached
            seq.num_computed_tokens = num_cached
            caches.grow(seq.request_id, num_cached + n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.pieces.append(self._piece(seq, n))
            budget -= n
        return out

    def _piece(self, seq: Sequence, num_tokens: int, draft: DraftProposal | None = None) -> ScheduledPiece:
        caches = self.caches
        return ScheduledPiece(
            seq,
            seq.num_computed_tokens,
            num_tokens,
            draft,
            caches.block_table(seq.request_id),
            caches.state_slot(seq.request_id),
        )

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """The cached blocks `seq` may start from (it is waiting, with nothing computed). Cached tokens get
        no logits, so a request that asks for prompt logprobs takes none past the prompt it has scored
        (none at first; after a preemption, what it scored before)."""
        limit = seq.num_tokens - 1
        if seq.params.prompt_logprobs is not None:
            limit = min(limit, len(seq.prompt_logprobs))
        return self.caches.prefix_hit(seq.all_token_ids, limit)

    def _preempt(self, seq: Sequence) -> Sequence:
        self.caches.free(seq.request_id)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.metrics.num_preemptions += 1
        self.waiting.appendleft(seq)
        return seq

    def update_from_output(self, batch: StepBatch, results: list[PieceResult | None]) -> StepCommit:
        """Commit a step: the cache now holds each piece's tokens and its accepted drafts; what it holds past
        them (rejected drafts) is rolled back; finished sequences leave. Returns the recurrent-state
        operations that go with it, for the runner."""
        commit = StepCommit()
        for i, (piece, result) in enumerate(zip(batch.pieces, results)):
            seq = piece.seq
            accepted = result.num_accepted if result is not None else 0
            seq.num_computed_tokens += piece.num_tokens + accepted
            commit.saves += self.caches.commit(
                seq.request_id, seq.num_computed_tokens, lambda seq=seq: seq.all_token_ids
            )
            if piece.draft is not None and piece.state_slot is not None:
                commit.keep[i] = piece.num_tokens + accepted
            if seq.is_finished:
                self.finish(seq)
            elif piece.draft is not None:
                self.caches.roll_back(seq.request_id, seq.num_tokens)
        return commit

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence wherever it is and free its caches at once."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.caches.free(seq.request_id)
