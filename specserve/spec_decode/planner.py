"""Verify policies: how many of each request's drafts the target checks this step.

Every policy is non-anticipating (DSpark paper, Appendix A): whether draft j is verified depends only on
what was known before d_j was sampled, so the verified prefix is a stopping time and rejection sampling
stays lossless. The confidence c_j is computed from the backbone state and d_{j-1} (never from d_j), so
decisions on draft j may read c_1..c_j of the same request and anything of other requests (whose drafts
are independent of this one's).

- `fixed`: every draft.
- `threshold` (DeepSpec): up to the first draft whose own per-slot confidence is below the threshold.
- `dspark` (Algorithm 1): candidates (r, j) in decreasing order of the predicted survival
  a_rj = c_r1 ... c_rj; admit one at a time while the expected throughput (accepted tokens per second of
  step time, from the cost profile) improves, and stop at the first candidate that does not improve it.
  The early stop is what keeps it lossless: a scheduler that looks at the whole sequence of candidates
  and keeps the best prefix afterwards lets c_{j+1}, which depends on d_j, decide whether d_j is verified.
- `dspark_async` (paper §5.2): the batch capacity K comes from the confidences of two steps earlier (known
  before anything of this step was drafted); this step verifies the top K candidates by a_rj, no early
  stop. Survival decreases along a request's drafts, so the top K form a prefix of each request. Where K
  is 0 the step drafts nothing (but for a probe now and then); a serial drafter drafts no further than K
  can verify, and K is sized on drafts extended to the full length (its early stops would only shrink it).

The scheduled policies read the confidences through the engine's `Recalibration` (per position, the
realised acceptance of past rounds at the same raw confidence): the table only changes after a
verification, so it is part of what was known before this step drafted anything.

Serial drafters (a draft model) also ask the scheduled policies, before each draft step, which requests are
worth another draft (`keep_drafting`): drafting is then paid only where it can pay. That decision reads
only the drafts already sampled, so the drafted prefix is a stopping time as well. Drafters that draft a
whole round at once (DSpark's block pass, EAGLE-3, n-gram) ask once, before it, whether the step drafts at
all (`draft_round`), from the survival recent rounds predicted: past information only. A draft model
that is behind (a new prompt, steps that drafted nothing) drafts for a request only where catching up
pays over the tokens the request has left (`catch_up`), decided before anything is drafted.

Every decision weighs a step's time against the tokens it emits at the engine's load: the engine counts
each request still in prefill or waiting as one more plain token of the step (`base_tokens`), so that
while requests queue, engine time is worth what the whole load would make of it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from specserve.config import SpeculativeConfig
from specserve.core.proposal import DraftProposal
from specserve.spec_decode.calibration.online import Recalibration
from specserve.spec_decode.cost_profile import CostProfile


@dataclass
class Plan:
    lengths: list[int]  # drafts verified per request
    expected_accepted: float  # sum of the predicted survival of the verified drafts


def survival(proposal: DraftProposal) -> torch.Tensor:
    """Predicted P(d_1..d_j all accepted) for each j: the running product of per-slot confidences."""
    return torch.cumprod(proposal.slot_confidences().double(), dim=0)


def ranked_candidates(survivals: list[torch.Tensor]) -> list[tuple[float, int, int]]:
    """(a_rj, j, r) by decreasing a, ties by position: a request's drafts come in order."""
    flat = [(float(a), j, r) for r, s in enumerate(survivals) for j, a in enumerate(s.tolist())]
    return sorted(flat, key=lambda c: (-c[0], c[1]))


class VerifyPlanner:
    def plan(self, proposals: list[DraftProposal], base_tokens: int) -> Plan:
        """`base_tokens`: the step's plain tokens, each emitting one: the decoding requests' anchors, and
        one for each queued request the engine prices as if it decoded in this step."""
        raise NotImplementedError

    def keep_drafting(
        self, proposals: list[DraftProposal], base_tokens: int, may_draft: list[bool] | None = None
    ) -> list[bool]:
        """Before a serial drafter's step: which requests draft one more token (all but those `may_draft`
        rules out, unless scheduled)."""
        return list(may_draft) if may_draft is not None else [True] * len(proposals)

    def draft_round(self, num_requests: int, base_tokens: int) -> bool:
        """Before a drafter that drafts a whole round at once: whether this step drafts (yes, unless
        scheduled)."""
        return True

    def catch_up(self, backlogs: list[int], remaining: list[int], base_tokens: int) -> list[bool]:
        """Before a serial drafter's round: per request, whether feeding the drafter its backlog (the
        tokens its next draft step would feed) is worth it with `remaining` tokens left to emit (yes,
        unless scheduled)."""
        return [True] * len(backlogs)


class FixedPlanner(VerifyPlanner):
    def plan(self, proposals, base_tokens):
        lengths = [len(p.token_ids) for p in proposals]
        return Plan(lengths, _expected(proposals, lengths))


class ThresholdPlanner(VerifyPlanner):
    def __init__(self, threshold: float):
        self.threshold = threshold

    def plan(self, proposals, base_tokens):
        lengths = []
        for p in proposals:
            below = (p.slot_confidences() < self.threshold).nonzero()
            lengths.append(int(below[0, 0]) if len(below) else len(p.token_ids))
        return Plan(lengths, _expected(proposals, lengths))


@dataclass
class Admission:
    lengths: list[int]  # verified drafts per request
    expected: float  # tokens the step is expected to emit (one per request plus the verified survival)
    throughput: float  # expected tokens per second of step time, drafting included


def greedy_admission(
    survivals: list[torch.Tensor], base_tokens: int, profile: CostProfile, draft_s: float | None = None
) -> Admission:
    """Algorithm 1 with causal early stopping. `base_tokens` (at least one per request) emit one token each;
    `draft_s`: the step's drafting time (already spent, part of the step time); by default the profiled
    round of the full draft length."""
    if draft_s is None:
        draft_s = profile.draft_time(len(survivals))
    tokens, expected = base_tokens, float(base_tokens)
    best = expected / (profile.step_time(tokens) + draft_s)
    lengths = [0] * len(survivals)
    for a, j, r in ranked_candidates(survivals):
        throughput = (expected + a) / (profile.step_time(tokens + 1) + draft_s)
        if throughput <= best:
            break  # never look further: later candidates may depend on drafts this one would verify
        best, expected, tokens = throughput, expected + a, tokens + 1
        lengths[r] = j + 1
    return Admission(lengths, expected, best)


class ScheduledPlanner(VerifyPlanner):
    """The policies that read the cost profile (`num_tokens`: the draft length of its drafting rounds).
    With a `recalibration`, the confidences they read are corrected by the engine's past outcomes."""

    PROBE_EVERY = 16  # steps without drafting before one drafts anyway, to see whether drafting pays again
    RECENT_WEIGHT = 0.5  # of the newest round in the running mean of predicted survival

    def __init__(self, profile: CostProfile, num_tokens: int, recalibration: Recalibration | None = None):
        self.profile = profile
        self.num_tokens = num_tokens
        self.recalibration = recalibration
        self.recent_survival: torch.Tensor | None = None  # [num_tokens], mean over recent rounds' requests
        self.skipped_steps = 0  # steps without drafting since the last one that drafted

    def remember(self, survivals: list[torch.Tensor]) -> None:
        """A round's predicted survivals (full-length proposals only) enter the running mean."""
        full = [s for s in survivals if len(s) == self.num_tokens]
        if not full:
            return
        mean = torch.stack(full).mean(0)
        if self.recent_survival is not None:
            mean = self.RECENT_WEIGHT * mean + (1 - self.RECENT_WEIGHT) * self.recent_survival
        self.recent_survival = mean

    def skip_or_probe(self, skip: bool) -> bool:
        """Whether this step drafts nothing: when `skip` says so, except one such step in PROBE_EVERY (what
        decides that drafting does not pay could never change otherwise)."""
        if skip and self.skipped_steps < self.PROBE_EVERY:
            self.skipped_steps += 1
            return True
        self.skipped_steps = 0
        return False

    def round_pays(self, num_requests: int, base_tokens: int) -> bool:
        """Every request expected to survive as recent rounds predicted (confidences known before this
        step drafts anything), planned by Algorithm 1 with the round's drafting time paid, beats a plain
        step; without a recent round, yes."""
        if self.recent_survival is None:
            return True
        expected = [self.recent_survival] * num_requests
        drafted = greedy_admission(expected, base_tokens, self.profile).throughput
        return drafted > self.plain_throughput(base_tokens)

    def draft_round(self, num_requests, base_tokens):
        return not self.skip_or_probe(not self.round_pays(num_requests, base_tokens))

    def catch_up(self, backlogs, remaining, base_tokens):
        """A draft model's backlog beyond a round's usual feed (a new prompt, or the tokens of steps that
        drafted nothing) is paid once, before the request's first draft, and holds up the whole batch
        for backlog * catch_up_s; it pays when the engine time drafting then saves over the request's
        remaining tokens is larger. Each token costs the engine 1 / throughput: of plain steps, or of
        rounds whose drafts survive as recent rounds predicted (as past first drafts did, before any
        round). Nothing drafted enters the decision, so the drafted prefix stays a stopping time.

        The per-step choice (`keep_drafting`) cannot weigh this: it sees one draft step, while the
        catch-up serves every later round. Measured without it (c = 16, humaneval): the first decode
        step fed 13 prompts to the draft model (8 s, a seventh of the run) for 37 accepted drafts."""
        extra = [b - (self.num_tokens + 1) for b in backlogs]  # a round's usual feed is in its profile
        if all(e <= 0 for e in extra):
            return [True] * len(backlogs)
        if self.recent_survival is not None:
            expected = self.recent_survival
        else:
            first = self.recalibration.first_draft_rate() if self.recalibration is not None else 1.0
            expected = torch.full((self.num_tokens,), first, dtype=torch.float64).cumprod(0)
        drafted = self.drafted_throughput(expected, len(backlogs), base_tokens)
        saving = max(1 / self.plain_throughput(base_tokens) - 1 / drafted, 0.0)  # engine s per token
        return [e <= 0 or left * saving > e * self.profile.catch_up_s for e, left in zip(extra, remaining)]

    def plain_throughput(self, base_tokens: int) -> float:
        """Tokens per second of a step that drafts nothing."""
        return base_tokens / self.profile.step_time(base_tokens)

    def drafted_throughput(self, survival: torch.Tensor, num_requests: int, base_tokens: int) -> float:
        """Expected tokens per second of rounds whose drafts survive as `survival` says, at the round
        length L a serial drafter would stop at (it drafts on only while that pays): each draft step a
        num_tokens-th of the profiled round. (Priced at the full round, drafting looked no better than
        plain steps at c = 4 where a fixed k = 5 gained 17%.)"""
        return max(
            greedy_admission(
                [survival[:length]] * num_requests,
                base_tokens,
                self.profile,
                self.profile.draft_time(num_requests) * length / self.num_tokens,
            ).throughput
            for length in range(1, self.num_tokens + 1)
        )

    def predicted_survival(self, confidences: torch.Tensor) -> torch.Tensor:
        if self.recalibration is not None:
            confidences = self.recalibration.correct(confidences)
        return torch.cumprod(confidences.double(), dim=0)

    def survivals(self, proposals: list[DraftProposal]) -> list[torch.Tensor]:
        return [self.predicted_survival(p.slot_confidences()) for p in proposals]

    def keep_drafting(self, proposals, base_tokens, may_draft=None):
        """Which requests draft one more token: of those `may_draft` allows (all by default), the ones
        whose every draft the plan verifies so far, best first, as many as raise the expected throughput
        once the next draft step is paid (perhaps none, even before the first draft, when drafting costs
        more than it can save). A next draft is expected to be as confident as the last one (the same
        raw confidence, at its own position); a first one to survive as past first drafts did
        (certainly, without recalibration)."""
        first = self.recalibration.first_draft_rate() if self.recalibration is not None else 1.0
        # Each request's survivals with one more slot at the last raw confidence: [a_1..a_j, a_(j+1)].
        extended = [
            self.predicted_survival(full_length(c, len(c) + 1))
            for c in map(DraftProposal.slot_confidences, proposals)
        ]
        survivals = [e[:-1] for e in extended]
        steps = max(len(s) for s in survivals)
        spent = steps * self.profile.draft_time(len(proposals)) / self.num_tokens
        now = greedy_admission(survivals, base_tokens, self.profile, spent)
        gains = sorted(
            (
                (float(e[-1]) if len(e) else first, r)
                for r, (e, s) in enumerate(zip(extended, survivals))
                if len(s) == steps and now.lengths[r] == steps and (may_draft is None or may_draft[r])
            ),
            reverse=True,
        )
        best, chosen, expected, tokens = now.throughput, 0, now.expected, base_tokens + sum(now.lengths)
        for m, (gain, _) in enumerate(gains, 1):
            expected += gain
            next_step_s = self.profile.draft_time(m) / self.num_tokens
            throughput = expected / (self.profile.step_time(tokens + m) + spent + next_step_s)
            if throughput > best:
                best, chosen = throughput, m
        keep = [False] * len(proposals)
        for _, r in gains[:chosen]:
            keep[r] = True
        return keep


class DSparkPlanner(ScheduledPlanner):
    def plan(self, proposals, base_tokens):
        survivals = self.survivals(proposals)
        self.remember(survivals)
        lengths = greedy_admission(survivals, base_tokens, self.profile).lengths
        return Plan(lengths, _expected(proposals, lengths, survivals))


class AsyncDSparkPlanner(ScheduledPlanner):
    LAG = 2  # steps between the confidences that size the batch and the ones it is filled with

    def __init__(self, profile: CostProfile, num_tokens: int, recalibration: Recalibration | None = None):
        super().__init__(profile, num_tokens, recalibration)
        self.implied: deque[int] = deque(maxlen=self.LAG)  # the capacity each recent step's confidences imply
        self._capacity: int | None = None

    def capacity(self) -> int | None:
        """Drafts the next plan verifies (sized by the confidences of LAG steps before it); None until
        there is such a step (the causal planner then runs)."""
        return self._capacity

    def keep_drafting(self, proposals, base_tokens, may_draft=None):
        # Before the first draft: with capacity 0 drafting would be paid for nothing.
        if all(not p.token_ids for p in proposals) and self.skip_or_probe(self._capacity == 0):
            return [False] * len(proposals)
        keep = super().keep_drafting(proposals, base_tokens, may_draft)
        if self._capacity is None:
            return keep
        # The plan verifies the `capacity` drafts that rank first by survival, and a request's next draft
        # survives no better than its last: once `capacity` drafts rank at or above that one, the next
        # could not be verified and drafting it would be paid for nothing.
        survivals = self.survivals(proposals)
        ranked = torch.cat(survivals) if survivals else torch.empty(0)
        return [
            k and (len(s) == 0 or int((ranked >= s[-1]).sum()) < self._capacity)
            for k, s in zip(keep, survivals)
        ]

    def draft_round(self, num_requests, base_tokens):
        skip = self._capacity == 0 or not self.round_pays(num_requests, base_tokens)
        return not self.skip_or_probe(skip)

    def plan(self, proposals, base_tokens):
        survivals = self.survivals(proposals)
        self.remember(survivals)
        capacity = self.capacity()
        if capacity is not None:
            lengths = [0] * len(proposals)
            for _, j, r in ranked_candidates(survivals)[:capacity]:
                lengths[r] = max(lengths[r], j + 1)
        else:  # no capacity yet: the causal planner on this step's confidences
            lengths = greedy_admission(survivals, base_tokens, self.profile).lengths
        # A serial drafter stops early where it expects little, so a step's drafts may be fewer than the
        # capacity it could use: sized on those alone, the capacity could only shrink. It is sized on every
        # request's drafts extended to the full draft length at the last confidence (as `keep_drafting`
        # expects the next draft to be). A step without drafts (skipped, or every request at its token
        # limit) tells nothing new: it passes on the capacity the step before it implied.
        extended = [
            self.predicted_survival(full_length(p.slot_confidences(), self.num_tokens)) for p in proposals
        ]
        if any(len(e) for e in extended):
            self.implied.append(sum(greedy_admission(extended, base_tokens, self.profile).lengths))
        elif self.implied:
            self.implied.append(self.implied[-1])
        if len(self.implied) == self.LAG:  # computed once per plan, read before the next one drafts
            self._capacity = self.implied[0]
        return Plan(lengths, _expected(proposals, lengths, survivals))


def full_length(confidences: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """`confidences` repeated at their last value up to `num_tokens` (none stay none)."""
    if len(confidences) == 0:
        return confidences
    return torch.cat([confidences, confidences[-1:].expand(num_tokens - len(confidences))])


def _expected(proposals: list[DraftProposal], lengths: list[int], survivals=None) -> float:
    """Predicted accepted drafts of a plan (the sum of the verified drafts' survival)."""
    survivals = survivals or [survival(p) if n else None for p, n in zip(proposals, lengths)]
    return sum(float(s[:n].sum()) for s, n in zip(survivals, lengths) if n)


def build_planner(
    config: SpeculativeConfig,
    profile: CostProfile | None,
    num_tokens: int,
    recalibration: Recalibration | None = None,
    confidence_head: bool = True,
) -> VerifyPlanner:
    """`num_tokens`: the draft length of each round (what the profile's drafting rounds drafted);
    `recalibration`: the engine's outcome table, which the scheduled policies read when the config
    enables `live_recalibration`; `confidence_head`: whether the drafter has one."""
    if config.verify_policy == "threshold":
        if config.threshold_semantics == "deepspec" and not confidence_head:
            return FixedPlanner()  # DeepSpec thresholds a confidence head only: the whole block
        return ThresholdPlanner(config.confidence_threshold)
    if config.verify_policy in ("dspark", "dspark_async"):
        assert profile is not None, "the scheduled policies need a cost profile"
        planner = DSparkPlanner if config.verify_policy == "dspark" else AsyncDSparkPlanner
        return planner(profile, num_tokens, recalibration if config.live_recalibration else None)
    return FixedPlanner()
