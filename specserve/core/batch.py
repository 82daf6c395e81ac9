"""One engine step as data: the scheduled pieces and the state copies to make before the forward
(`StepBatch`), where their rows lie in the flat batch and in the logits (computed once, `StepLayout`), what
sampling made of each piece (`PieceResult`), and the state operations that commit it (`StepCommit`)."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from specserve.core.cache_groups import StateCopy
from specserve.core.proposal import DraftProposal
from specserve.core.sequence import Sequence


@dataclass
class ScheduledPiece:
    """`num_tokens` tokens of `seq` from position `start`, then the drafts of `draft` to verify; the cache
    blocks and recurrent-state slot its sequence holds."""

    seq: Sequence
    start: int
    num_tokens: int
    draft: DraftProposal | None = None
    block_table: list[int] = field(default_factory=list)
    state_slot: int | None = None

    @property
    def num_drafts(self) -> int:
        return len(self.draft.token_ids) if self.draft is not None else 0

    @property
    def token_ids(self) -> list[int]:
        own = self.seq.all_token_ids[self.start : self.start + self.num_tokens]
        return own + self.draft.token_ids if self.draft is not None else own

    @property
    def num_query_tokens(self) -> int:
        return self.num_tokens + self.num_drafts

    @property
    def prompt_only(self) -> bool:
        """Prompt tokens only, no drafts: computed alike with and without speculation."""
        return self.draft is None and self.start + self.num_tokens <= len(self.seq.prompt_token_ids)

    @property
    def reaches_end(self) -> bool:
        """True when the piece covers the sequence's last token, so the step samples a new one."""
        return self.start + self.num_tokens == self.seq.num_tokens

    @property
    def prompt_positions_to_score(self) -> range:
        """Positions of this piece whose logits score the prompt token after them, for a request that asks
        for prompt logprobs: those its sequence has not scored yet (a recompute after preemption scores
        nothing twice). The last prompt position samples the first output token instead."""
        seq = self.seq
        if seq.params.prompt_logprobs is None:
            return range(0)
        end = min(self.start + self.num_tokens, len(seq.prompt_token_ids) - 1)
        return range(max(self.start, len(seq.prompt_logprobs)), end)


def row_offsets(lengths: Iterable[int]) -> list[int]:
    """Where each run of consecutive rows of a flat batch begins, then the total: [0, l0, l0 + l1, ...].
    Every row offset of a step is computed here."""
    return [0, *itertools.accumulate(lengths)]


def verify_row_starts(num_drafts: Seq[int]) -> list[int]:
    """The first of each request's k + 1 consecutive verify rows (its anchor, then one row per draft)."""
    return row_offsets(k + 1 for k in num_drafts)[:-1]


class StepLayout:
    """Where each piece's rows lie (vLLM's SpecDecodeMetadata). Piece i's tokens are rows
    `query_start[i]:query_start[i + 1]` of the flat batch. A piece that reaches its sequence's end samples:
    its last k + 1 rows (the anchor and its k drafts) get logits, consecutive from `logit_start[i]`.
    A prompt chunk of a request that asks for prompt logprobs scores rows `prompt_rows[i]` as well."""

    def __init__(self, pieces: Seq[ScheduledPiece]):
        self.num_tokens = [p.num_tokens for p in pieces]
        self.num_drafts = [p.num_drafts for p in pieces]
        self.query_start = row_offsets(p.num_query_tokens for p in pieces)
        self.sampled = [i for i, p in enumerate(pieces) if p.reaches_end]
        self.logit_start = dict(
            zip(self.sampled, verify_row_starts([self.num_drafts[i] for i in self.sampled]))
        )
        self.logit_rows = [
            row
            for i in self.sampled
            for row in range(self.query_start[i + 1] - self.num_drafts[i] - 1, self.query_start[i + 1])
        ]
        self.prompt_rows: dict[int, range] = {}
        for i, p in enumerate(pieces):
            if scored := p.prompt_positions_to_score:
                shift = self.query_start[i] - p.start  # a position of piece i + shift = its row
                self.prompt_rows[i] = range(scored.start + shift, scored.stop + shift)
        self.plain = [i for i in self.sampled if not self.num_drafts[i]]
        self.verified = [i for i in self.sampled if self.num_drafts[i]]

    def logit_rows_of(self, pieces: Seq[int]) -> list[int]:
        """Rows of `logits` (not of the flat batch) that belong to `pieces`, k + 1 each, in order."""
        return [
            r
            for i in pieces
            for r in range(self.logit_start[i], self.logit_start[i] + self.num_drafts[i] + 1)
        ]

    def kept_rows(self, i: int, num_accepted: int) -> slice:
        """Piece i's rows now in the target's KV cache: its own tokens and the accepted drafts."""
        start = self.query_start[i]
        return slice(start, start + self.num_tokens[i] + num_accepted)


@dataclass
class StepBatch:
    """The scheduler's answer for one step: what runs, what was preempted to make room, and the state
    copies to make before the forward (requests starting from a prefix hit's kept recurrent state)."""

    pieces: list[ScheduledPiece] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    restores: list[StateCopy] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(p.num_query_tokens for p in self.pieces)


@dataclass(frozen=True)
class PieceResult:
    """What a sampling piece adds to its request: a sampled token, or its accepted drafts and the corrected
    or bonus token."""

    token_ids: list[int]
    num_accepted: int = 0
    logprobs: list[dict[int, float]] | None = None


@dataclass
class StepCommit:
    """The recurrent-state operations that commit a step, after sampling: each verified piece's state back
    to its first `keep[i]` tokens (its own and the accepted drafts), then the copies that keep states for
    the prefix cache."""

    keep: dict[int, int] = field(default_factory=dict)
    saves: list[StateCopy] = field(default_factory=list)


def catch_up_chunks(pending: Seq[int], keep: int, limit: int) -> Iterator[list[tuple[int, int]]]:
    """A drafter's catch-up: of `pending[r]` rows of each request r, the excess over the `limit` rows one
    forward may hold, each request's oldest rows first but its last `keep`, in chunks of at most `limit`
    rows to process first, each a list of (request, rows); none when they all fit."""
    excess = sum(pending) - limit
    if excess <= 0:
        return iter(())
    counts = []
    for n in pending:
        counts.append(min(excess, n - keep))
        excess -= counts[-1]
    return _row_chunks(counts, limit)


def _row_chunks(counts: Seq[int], limit: int) -> Iterator[list[tuple[int, int]]]:
    """`counts[r]` rows of each request r, in order, cut into chunks of at most `limit` rows: each a list
    of (request, rows)."""
    chunk, room = [], limit
    for r, n in enumerate(counts):
        while n:
            take = min(n, room)
            chunk.append((r, take))
            n, room = n - take, room - take
            if not room:
                yield chunk
                chunk, room = [], limit
    if chunk:
        yield chunk
