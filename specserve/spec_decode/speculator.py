"""The drafting stage of an engine step, and what it learns from each verification.

Before the target's forward, `propose` takes the requests whose next step is a decode step and the engine's
load, has the drafter draft where the verify planner says drafting can pay, and returns the verify plan:
per request the drafts the target checks this step. After the forward, `update` records what verification
made of them (counters, live calibration, recalibration, the step log) and hands the drafter the target's
features of exactly the rows now in the target's cache.
"""

from __future__ import annotations

import functools
import time
from collections import deque
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from specserve.config import SCHEDULED_POLICIES, SpecserveError, SpeculativeConfig
from specserve.core.batch import PieceResult, StepBatch, StepLayout
from specserve.core.cache_coordinator import CacheCoordinator, DrafterCacheSpec
from specserve.core.proposal import DraftProposal
from specserve.core.sequence import Sequence
from specserve.core.spec_stats import SpecStats, StepRecord
from specserve.layers.gated_deltanet import RECURRENT_MAX_LEN
from specserve.spec_decode.calibration.offline import VerificationRecords
from specserve.spec_decode.calibration.online import LiveCalibration, Recalibration
from specserve.spec_decode.context import TargetContext
from specserve.spec_decode.cost_profile import CostProfile, cached_profile, profile_key, save_cached_profile
from specserve.spec_decode.drafters import build_drafter
from specserve.spec_decode.planner import FixedPlanner, VerifyPlanner, build_planner, survival
from specserve.spec_decode.profiler import CostProfiler
from specserve.worker.device_memory import SAMPLER_LOGIT_COPIES
from specserve.worker.model_runner import ModelRunner


@dataclass
class VerifyPlan:
    """One step's verification: the drafts per request id (requests without drafts are absent), and
    what the planner expected of the decoding requests."""

    drafts: dict[str, DraftProposal] = field(default_factory=dict)
    budgets: list[int] = field(default_factory=list)  # drafts planned per decoding request
    expected_accepted: float = 0.0  # the planner's predicted accepted drafts (sum of survival)


class Speculator:
    """Built from the configuration (its drafter loaded: `cache_spec` says what the drafter's caches need
    from the engine's budget), then bound to the engine's caches (`bind`), which also gives the scheduled
    verify policies their cost profile."""

    def __init__(self, config: SpeculativeConfig, target: TargetContext):
        self.config = config
        self.target = target
        self.drafter = build_drafter(config, target)
        self.num_draft_tokens = config.num_speculative_tokens or self.drafter.default_num_tokens
        if target.model.has_recurrent_state and self.num_draft_tokens + 1 > RECURRENT_MAX_LEN:
            raise SpecserveError(
                f"num_speculative_tokens={self.num_draft_tokens}: a hybrid target verifies at most "
                f"{RECURRENT_MAX_LEN - 1} drafts a round exactly (longer blocks take the chunked delta rule)"
            )
        self.stats = SpecStats()
        self.calibration = LiveCalibration()  # predicted vs realised draft survival, per position
        self.recalibration = Recalibration()  # realised acceptance by position and raw confidence
        self.step_log: deque[StepRecord] = deque(maxlen=1024)  # the latest speculative steps
        self.verification_records: VerificationRecords | None = None  # set to collect STS data

    def cache_spec(self, block_size: int) -> DrafterCacheSpec:
        return self.drafter.cache_spec(block_size)

    def activation_bytes(self) -> int:
        """What drafting takes of a GPU's budget beside the caches: the drafter's forwards, and a round's
        draft distributions (q rows of every request's drafts, fp32 over the target's vocabulary), which
        live through the target's verification, with the sampler's copies while they are drawn (counted
        as the target's sampled rows are: worker/device_memory.py)."""
        total = self.drafter.activation_bytes(self.target)
        if self.drafter.samples_drafts:
            rows = self.target.max_num_seqs * self.num_draft_tokens
            total += (1 + SAMPLER_LOGIT_COPIES) * rows * self.target.vocab_size * 4
        return total

    def bind(self, runner: ModelRunner, caches: CacheCoordinator) -> None:
        """The drafter's caches (`caches.drafter`), and the verify planner. The scheduled policies' cost
        profile: the configured file, else the one cached for this model / dtype / threads / drafter, else
        measured on the target's `runner` and `caches`, one point between steps while every request verifies
        all its drafts (the `fixed` policy, which pays at low load)."""
        self.drafter.bind_caches(caches.drafter)
        self.drafter.bind_target(caches.kv, runner.kv_caches)
        config = self.config
        self.profiler: CostProfiler | None = None
        profile = None
        if config.verify_policy in SCHEDULED_POLICIES:
            profile = CostProfile.load(config.cost_profile) if config.cost_profile else None
            profile = profile or cached_profile(self.profile_key())
            if profile is None:
                self.profiler = CostProfiler(self.target, runner, caches, self.drafter, self.num_draft_tokens)
                self.profiler.announce(while_serving=True)
        self.planner = self._planner(profile) if self.profiler is None else FixedPlanner()

    @property
    def capture_layers(self) -> tuple[int, ...]:
        return self.drafter.capture_layers

    def profile_key(self) -> dict:
        return profile_key(self.target, self.config.model, self.num_draft_tokens)

    def measure_profile(self, runner: ModelRunner, caches: CacheCoordinator) -> CostProfile:
        """The whole cost profile now (the one being measured, finished), before anything is served."""
        profiler = self.profiler
        if profiler is None:
            profiler = CostProfiler(self.target, runner, caches, self.drafter, self.num_draft_tokens)
            profiler.announce(while_serving=False)
        return profiler.measure()

    def _planner(self, profile: CostProfile | None) -> VerifyPlanner:
        return build_planner(
            self.config, profile, self.num_draft_tokens, self.recalibration, self.drafter.has_confidence_head
        )

    def _advance_profile(self) -> None:
        """One more point of the cost profile being measured; once it is whole, it is cached and the
        configured policy takes over from `fixed`."""
        if not self.profiler.advance() or not self.profiler.done:
            return
        profile = self.profiler.profile()
        path = save_cached_profile(self.profile_key(), profile)
        tqdm.write(
            f"[specserve] cost profile measured ({len(profile.batch_tokens)} batch sizes, cached in {path}): "
            f"verify_policy {self.config.verify_policy!r} from the next step"
        )
        self.planner = self._planner(profile)
        self.profiler = None

    # ---- before the forward -----------------------------------------------------------------------------
    def propose(self, decoding: list[Sequence], load: int) -> VerifyPlan | None:
        """Drafts for the sequences whose next step is a decode step (one token not yet cached). `load`:
        the requests running or waiting.

        The planner weighs drafts against the step's decode tokens, and prices each request still in
        prefill or waiting as one more: while requests queue, a second of drafting delays them all, so
        engine time is worth the throughput of the load they make, not that of the few decoding (measured
        at c = 64: the first request of a wave, alone, drafted 7 tokens a step for 0.9 s while 63 prompts
        waited). The prompt chunks themselves are work done anyway: counted as tokens that emit nothing,
        they made any step with a prefill look slow, and drafting look cheap."""
        if self.profiler is not None:
            self._advance_profile()
        if not decoding:
            return None
        start = time.perf_counter()
        base_tokens = min(load, self.target.max_num_seqs)
        remaining = [
            min(seq.max_tokens - len(seq.output_token_ids), self.target.max_model_len - seq.num_tokens)
            for seq in decoding
        ]
        may_draft = self.planner.catch_up([self.drafter.backlog(s) for s in decoding], remaining, base_tokens)
        if not any(may_draft) or (
            not self.drafter.drafts_serially and not self.planner.draft_round(len(decoding), base_tokens)
        ):
            # A plain step. A drafter conditioned on the target's features keeps collecting them
            # (`update`) and takes them all into its context at its next round.
            plan = self.planner.plan([DraftProposal([]) for _ in decoding], base_tokens)
            return VerifyPlan({}, plan.lengths, plan.expected_accepted)
        keep_drafting = functools.partial(
            self.planner.keep_drafting, base_tokens=base_tokens, may_draft=may_draft
        )
        proposals = self.drafter.propose(decoding, self.num_draft_tokens, keep_drafting)
        self.stats.drafting_s += time.perf_counter() - start
        # Never draft past max_tokens or max_model_len: a round emits at most drafts + 1 tokens; nor past
        # what an output constraint allows.
        capped = [
            proposal.truncate(min(max(0, left - 1), _grammatical(seq, proposal.token_ids)))
            for seq, proposal, left in zip(decoding, proposals, remaining)
        ]
        plan = self.planner.plan(capped, base_tokens)
        drafts = {
            seq.request_id: proposal.truncate(length)
            for seq, proposal, length in zip(decoding, capped, plan.lengths)
            if length
        }
        return VerifyPlan(drafts, plan.lengths, plan.expected_accepted)

    # ---- after the forward ------------------------------------------------------------------------------
    def update(
        self,
        plan: VerifyPlan | None,
        batch: StepBatch,
        layout: StepLayout,
        results: list[PieceResult | None],
        emitted: list[int],
        captured: dict[int, torch.Tensor],
        verify_s: float,
    ) -> None:
        """What the step's verifications made of the drafts (`results[i]` of piece i; None where a prompt
        chunk sampled nothing; `emitted[i]` of its tokens the request kept, fewer when a stop ended it),
        and the target features of the kept rows (`captured`: the forward's layer outputs, [N, H] each)
        for the drafter's next context."""
        features = (
            torch.cat([captured[i] for i in self.capture_layers], dim=-1) if self.capture_layers else None
        )
        verified = [i for i, piece in enumerate(batch.pieces) if piece.draft is not None]
        if verified:
            self.stats.verification_s += verify_s
        self._record_verifications(
            [batch.pieces[i].draft for i in verified], [results[i].num_accepted for i in verified]
        )
        for i in verified:
            piece, result = batch.pieces[i], results[i]
            # A stop inside the accepted drafts truncates the round there (DeepSpec's accounting).
            accepted = min(result.num_accepted, emitted[i])
            piece.seq.spec_stats.record(piece.num_drafts, accepted, emitted[i])
            self.stats.record(piece.num_drafts, accepted, emitted[i])
        for i, piece in enumerate(batch.pieces):
            if features is not None and not piece.seq.is_finished:
                # The drafter's next context: the rows now in the target's cache, never rejected drafts.
                accepted = results[i].num_accepted if results[i] is not None else 0
                self.drafter.observe(piece.seq, piece.start, features[layout.kept_rows(i, accepted)])
        if plan is not None:
            self.step_log.append(
                StepRecord(
                    budgets=plan.budgets,
                    batch_tokens=batch.num_tokens,
                    expected_accepted=plan.expected_accepted,
                    accepted=sum(results[i].num_accepted for i in verified),
                )
            )

    def _record_verifications(self, drafts: list[DraftProposal], num_accepted: list[int]) -> None:
        """Live calibration (and STS records when collecting) from the step's verified proposals."""
        self.recalibration.record_rounds([d.slot_confidences() for d in drafts], num_accepted)
        headed = [(d, a) for d, a in zip(drafts, num_accepted) if d.confidences is not None]
        self.calibration.record_rounds([survival(d) for d, _ in headed], [a for _, a in headed])
        if self.verification_records is not None:
            for draft, accepted in headed:
                self.verification_records.add(torch.logit(draft.confidences.double(), eps=1e-12), accepted)


def _grammatical(seq: Sequence, drafts: list[int]) -> int:
    """Drafts worth verifying under the request's output constraint: through the first one its grammar
    refuses. The target rejects that one for sure, and keeping it keeps the round lossless: cut instead,
    the next token would come from the target's distribution rather than the rejection's residual."""
    if seq.grammar is None:
        return len(drafts)
    return min(len(drafts), seq.grammar.grammatical_prefix(drafts) + 1)
