"""Speculative decoding counters, named as in vLLM: drafts, draft tokens, accepted tokens, per position."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass
class SpecStats:
    num_drafts: int = 0  # verification rounds that checked at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0  # tokens committed by verification rounds: accepted + bonus (if any)
    accepted_per_position: list[int] = field(default_factory=list)  # position i: rounds accepting draft i+1
    drafted_per_position: list[int] = field(default_factory=list)  # position i: rounds verifying draft i+1
    drafting_s: float = 0.0
    verification_s: float = 0.0

    def record(self, num_drafted: int, num_accepted: int, num_emitted: int | None = None) -> None:
        """One verification round. `num_emitted` is accepted + 1 unless the round ended the request on an
        accepted stop token (then there is no bonus token: DeepSpec counts a, not a + 1)."""
        if num_drafted == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        self.num_emitted_tokens += num_accepted + 1 if num_emitted is None else num_emitted
        if len(self.accepted_per_position) < num_drafted:
            self.accepted_per_position += [0] * (num_drafted - len(self.accepted_per_position))
            self.drafted_per_position += [0] * (num_drafted - len(self.drafted_per_position))
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1
        for i in range(num_drafted):
            self.drafted_per_position[i] += 1

    @classmethod
    def total(cls, parts: Iterable[SpecStats]) -> SpecStats:
        """The counters of several requests together (the choices of one HTTP request); of one, a copy
        that its later rounds leave alone."""
        out = cls()
        for part in parts:
            for f in dataclasses.fields(cls):
                mine, theirs = getattr(out, f.name), getattr(part, f.name)
                if isinstance(mine, list):  # per position: the longer list's length
                    setattr(out, f.name, [a + b for a, b in itertools.zip_longest(mine, theirs, fillvalue=0)])
                else:
                    setattr(out, f.name, mine + theirs)
        return out

    @property
    def mean_acceptance_length(self) -> float:
        """tau: tokens committed per verification round, the bonus token included (DeepSpec's acceptance
        length; vLLM's 1 + accepted / drafts except on rounds that end at a stop token)."""
        return self.num_emitted_tokens / self.num_drafts if self.num_drafts else 1.0

    def prefix_survival(self) -> list[float]:
        """accept_rate@k (DeepSpec): P(drafts 1..k+1 all accepted | draft k+1 was verified)."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)]

    def conditional_acceptance(self) -> list[float]:
        """P(draft k+1 accepted | drafts 1..k accepted), the paper's position-wise acceptance (approximate
        when rounds verify different numbers of drafts)."""
        survival = self.prefix_survival()
        return [s / prev if prev else 0.0 for s, prev in zip(survival, [1.0, *survival])]

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


@dataclass
class StepRecord:
    """One speculative step, for observability: what the planner asked for and what came of it."""

    budgets: list[int]  # drafts verified per decoding request
    batch_tokens: int  # tokens in the flat batch (decode pieces + prefill chunks)
    expected_accepted: float  # the planner's predicted accepted drafts (sum of survival)
    accepted: int  # drafts actually accepted
