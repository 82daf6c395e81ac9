"""Continuous batching: which sequences run this step and how many of their tokens each.

Every sequence is just "tokens not yet in the KV cache": a new prompt, a prompt chunk, the last sampled
token, or a whole sequence again after preemption. So prefill, chunked prefill and decode share one path
(as in vLLM v1). Running sequences go first (FCFS); waiting ones are admitted while the token budget,
`max_num_seqs` and free KV blocks allow. When blocks run out, the most recently admitted running
sequence is preempted: its blocks are freed and it is recomputed later from its tokens, so nothing is lost.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from specserve.engine.kv_cache import BlockManager
from specserve.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledPiece:
    """`num_tokens` tokens of `seq` from position `start`, then `num_drafts` of its draft tokens to verify."""

    seq: Sequence
    start: int
    num_tokens: int
    num_drafts: int = 0

    @property
    def token_ids(self) -> list[int]:
        own = self.seq.all_token_ids[self.start : self.start + self.num_tokens]
        return own + self.seq.draft.token_ids[: self.num_drafts] if self.num_drafts else own

    @property
    def num_query_tokens(self) -> int:
        return self.num_tokens + self.num_drafts

    @property
    def reaches_end(self) -> bool:
        """True when the piece covers the sequence's last token, so the step samples a new one."""
        return self.start + self.num_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    pieces: list[ScheduledPiece] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(p.num_query_tokens for p in self.pieces)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        bm = self.block_manager
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            # Drafts (set only on decode steps) ride along as far as the budget allows.
            drafts = len(seq.draft.token_ids) if seq.draft is not None else 0
            n = min(seq.num_uncomputed_tokens + drafts, budget)
            while not bm.can_grow(seq, seq.num_computed_tokens + n) and self.running[-1] is not seq:
                out.preempted.append(self._preempt(self.running.pop()))
            if not bm.can_grow(seq, seq.num_computed_tokens + n):
                out.preempted.append(self._preempt(self.running.pop()))
                break
            bm.grow(seq, seq.num_computed_tokens + n)
            own = min(n, seq.num_uncomputed_tokens)
            out.pieces.append(ScheduledPiece(seq, seq.num_computed_tokens, own, n - own))
            budget -= n
            i += 1
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not out.preempted:
            seq = self.waiting[0]
            n = min(seq.num_uncomputed_tokens, budget)
            if not bm.can_grow(seq, seq.num_computed_tokens + n):
                break
            self.waiting.popleft()
            bm.grow(seq, seq.num_computed_tokens + n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.pieces.append(ScheduledPiece(seq, seq.num_computed_tokens, n))
            budget -= n
        return out

    def _preempt(self, seq: Sequence) -> Sequence:
        self.block_manager.free(seq)
        seq.draft = None
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.metrics.num_preemptions += 1
        self.waiting.appendleft(seq)
        return seq

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence wherever it is and free its blocks at once."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
