"""Verify planners: the DSpark paper's Appendix A as a statistical test, Algorithm 1 against brute force,
the asynchronous variant's capacity rule, and budgets that shrink under load."""

from __future__ import annotations

import itertools

import pytest
import torch
from scipy import stats

from specserve import LLM, SamplingParams
from specserve.core.proposal import DraftProposal
from specserve.spec_decode.calibration.online import Recalibration
from specserve.spec_decode.cost_profile import CostProfile
from specserve.spec_decode.planner import (
    AsyncDSparkPlanner,
    DSparkPlanner,
    greedy_admission,
    ranked_candidates,
)
from specserve.spec_decode.rejection import build_verify_batch, rejection_sample
from tests.test_profiler import serve_until_profiled

pytestmark = pytest.mark.kernel_agnostic

# Appendix A: SPS(1) = 1, SPS(2) = 0.5, SPS(3) = 0.45; target (0.7, 0.3) over tokens {A=0, B=1}; the
# drafter samples uniformly; c1 = 1 and c2 = 1 if x1 = A else 0 (c2 depends on the sampled x1).
APPENDIX_A = CostProfile(batch_tokens=[1, 2, 3], step_s=[1.0, 2.0, 1 / 0.45])
TARGET = torch.tensor([0.7, 0.3])
N = 20_000


def appendix_a_first_tokens(choose_length) -> torch.Tensor:
    """First emitted token of N independent steps whose verified length is `choose_length(proposal)`."""
    g = torch.Generator().manual_seed(0)
    drafts = torch.randint(0, 2, (N, 2), generator=g).tolist()
    q = torch.full((2, 2), 0.5)
    proposals = [
        DraftProposal(d, q, torch.tensor([1.0, 1.0 if d[0] == 0 else 0.0], dtype=torch.double))
        for d in drafts
    ]
    verified = [p.truncate(choose_length(p)) for p in proposals]
    params = [SamplingParams(temperature=1.0, seed=i) for i in range(N)]
    batch = build_verify_batch(
        params,
        [[0]] * N,
        [[]] * N,
        [v.token_ids for v in verified],
        2,
        generator=torch.Generator().manual_seed(1),
    )
    rows = sum(len(v.token_ids) + 1 for v in verified)
    out = rejection_sample(
        TARGET.log().expand(rows, 2), batch, [v.token_ids for v in verified], [v.probs for v in verified]
    )
    return torch.tensor([t[0] for t in out.token_ids])


def retrospective_length(p: DraftProposal) -> int:
    """The best prefix chosen after seeing every confidence (no early stop): the biased scheduler."""
    survival = torch.cumprod(p.confidences, 0).tolist()
    value = [(1 + sum(survival[:n])) * APPENDIX_A.sps(1 + n) for n in range(len(survival) + 1)]
    return max(range(len(value)), key=lambda n: (value[n], -n))


def frequencies_pvalue(tokens: torch.Tensor, probs: list[float]) -> float:
    counts = torch.bincount(tokens, minlength=2).tolist()
    return stats.chisquare(counts, [p * N for p in probs]).pvalue


def test_appendix_a_early_stopping_is_lossless_and_retrospection_is_not():
    ours = appendix_a_first_tokens(lambda p: DSparkPlanner(APPENDIX_A, 2).plan([p], 1).lengths[0])
    assert frequencies_pvalue(ours, [0.7, 0.3]) > 0.001
    biased = appendix_a_first_tokens(retrospective_length)
    assert frequencies_pvalue(biased, [0.85, 0.15]) > 0.001
    assert frequencies_pvalue(biased, [0.7, 0.3]) < 1e-9


def convex_profile(g: torch.Generator, max_tokens: int) -> CostProfile:
    """T(B) = t0 + t1 B + t2 B^2: convex step time, so tokens/s B * SPS(B) is unimodal."""
    t0, t1, t2 = (torch.rand(3, generator=g) * torch.tensor([1.0, 0.2, 0.02])).tolist()
    grid = list(range(1, max_tokens + 1))
    return CostProfile(grid, [t0 + 0.05 + t1 * b + t2 * b * b for b in grid])


def brute_force_best(survivals: list[torch.Tensor], base: int, profile: CostProfile) -> float:
    best = 0.0
    for lengths in itertools.product(*[range(len(s) + 1) for s in survivals]):
        expected = base + sum(float(s[:n].sum()) for s, n in zip(survivals, lengths))
        best = max(best, expected / profile.step_time(base + sum(lengths)))
    return best


@pytest.mark.parametrize("seed", range(30))
def test_algorithm_1_matches_brute_force(seed):
    g = torch.Generator().manual_seed(seed)
    num_requests = int(torch.randint(1, 4, (1,), generator=g))
    survivals = [
        torch.cumprod(torch.rand(int(torch.randint(1, 5, (1,), generator=g)), generator=g).double(), 0)
        for _ in range(num_requests)
    ]
    base = num_requests + int(torch.randint(0, 3, (1,), generator=g))
    profile = convex_profile(g, base + sum(len(s) for s in survivals))
    lengths = greedy_admission(survivals, base, profile).lengths
    value = (base + sum(float(s[:n].sum()) for s, n in zip(survivals, lengths))) / profile.step_time(
        base + sum(lengths)
    )
    assert value == pytest.approx(brute_force_best(survivals, base, profile), rel=1e-12)


def proposal_with(confidences: list[float]) -> DraftProposal:
    return DraftProposal(list(range(len(confidences))), None, torch.tensor(confidences, dtype=torch.double))


def test_async_capacity_comes_from_two_steps_earlier():
    profile = CostProfile([1, 8, 64], [1.0, 1.2, 6.0])
    planner = AsyncDSparkPlanner(profile, 5)
    g = torch.Generator().manual_seed(5)
    steps = [[proposal_with(torch.rand(5, generator=g).tolist()) for _ in range(3)] for _ in range(6)]
    for t, proposals in enumerate(steps):
        plan = planner.plan(proposals, 3)
        if t >= 2:
            old = [torch.cumprod(p.confidences, 0) for p in steps[t - 2]]
            capacity = sum(greedy_admission(old, 3, profile).lengths)
            assert sum(plan.lengths) == min(capacity, 15)
            # the chosen drafts are the top `capacity` by survival: prefixes of each request
            now = [torch.cumprod(p.confidences, 0) for p in proposals]
            chosen = {(r, j) for _, j, r in ranked_candidates(now)[:capacity]}
            assert chosen == {(r, j) for r, n in enumerate(plan.lengths) for j in range(n)}


def test_async_drafts_nothing_while_its_capacity_is_zero():
    """Each verified token costs half a step: drafts that survive 10% of the time are never worth it, so the
    capacity sized two steps later is 0 and the step does not draft (but for a probe every PROBE_EVERY
    steps); once confident rounds give it room again, it drafts at once."""
    profile = CostProfile([1, 65], [1.0, 33.0], draft_requests=[1, 64], draft_s=[0.01, 0.01])
    planner = AsyncDSparkPlanner(profile, 4)
    nothing_yet = [proposal_with([]), proposal_with([])]
    assert planner.keep_drafting(nothing_yet, 2) == [True, True]  # no capacity known yet
    for _ in range(2):
        planner.plan([proposal_with([0.1] * 4)] * 2, 2)
    assert planner.capacity() == 0
    decisions = [planner.keep_drafting(nothing_yet, 2) for _ in range(planner.PROBE_EVERY + 1)]
    assert decisions == [[False, False]] * planner.PROBE_EVERY + [[True, True]]
    assert not planner.draft_round(2, 2)
    for _ in range(2):
        planner.plan([proposal_with([0.95] * 4)] * 2, 2)
    assert planner.capacity() > 0 and planner.keep_drafting(nothing_yet, 2) == [True, True]


def test_async_drafts_only_what_its_capacity_can_verify():
    """Drafts beyond the capacity would never be verified: a confident request stops drafting at the
    capacity sized by the poor rounds two steps earlier. The capacity is sized on drafts extended to the
    full length: rounds that stopped after two confident drafts still give room for five (sized on the
    drafts alone, the capacity of a serial drafter could only shrink), and steps without drafts keep it."""
    profile = CostProfile([1, 64], [1.0, 7.3], draft_requests=[1, 64], draft_s=[0.01, 0.01])  # +0.1 a token
    planner = AsyncDSparkPlanner(profile, 5)
    for _ in range(2):
        planner.plan([proposal_with([0.3] * 5)], 1)
    assert planner.capacity() == 1
    assert DSparkPlanner(profile, 5).keep_drafting([proposal_with([0.99])], 1) == [True]
    assert planner.keep_drafting([proposal_with([0.99])], 1) == [False]
    for _ in range(2):
        planner.plan([proposal_with([0.99] * 2)], 1)
    assert planner.capacity() == 5
    assert planner.keep_drafting([proposal_with([0.99] * 4)], 1) == [True]
    for _ in range(2):  # steps that draft nothing (a request at its token limit) tell nothing new
        planner.plan([proposal_with([])], 1)
    assert planner.capacity() == 5


def test_budget_per_request_falls_with_load():
    """Verification is free up to 16 tokens, then each token costs: more requests, fewer drafts each."""
    profile = CostProfile([1, 16, 1024], [1.0, 1.0, 1.0 + 0.02 * (1024 - 16)])
    mean_budget = []
    for num_requests in (1, 4, 16, 64):
        proposals = [proposal_with([0.8] * 7) for _ in range(num_requests)]
        plan = DSparkPlanner(profile, 7).plan(proposals, num_requests)
        mean_budget.append(sum(plan.lengths) / num_requests)
    assert all(a >= b for a, b in zip(mean_budget, mean_budget[1:]))
    assert mean_budget[0] == 7 and mean_budget[-1] <= 1 and mean_budget[1] > mean_budget[-1]


@pytest.mark.parametrize(
    "confidence, round_s, expected",
    [(0.9, 0.4, True), (0.2, 0.4, False), (0.9, 4.0, False)],  # (a round drafts 4 tokens)
)
def test_a_serial_drafter_drafts_on_only_where_it_pays(confidence, round_s, expected):
    """Verification is free here: one more draft step pays when its expected survival (a_j c_j) adds more
    tokens per second than its drafting time takes away."""
    profile = CostProfile([1, 64], [1.0, 1.0], draft_requests=[1, 64], draft_s=[round_s, round_s])
    planner = DSparkPlanner(profile, 4)
    assert planner.keep_drafting([proposal_with([confidence])], 1) == [expected]


def test_a_serial_drafter_drafts_at_all_only_where_it_can_pay():
    """Before the first draft: a drafter with no record is tried while a certain draft would pay; one
    whose past first drafts were rarely accepted is not, nor any where drafting costs too much."""
    cheap = CostProfile([1, 64], [1.0, 1.0], draft_requests=[1, 64], draft_s=[0.4, 0.4])
    costly = CostProfile([1, 64], [1.0, 1.0], draft_requests=[1, 64], draft_s=[6.0, 6.0])
    nothing_yet = [proposal_with([]), proposal_with([])]
    assert DSparkPlanner(cheap, 4).keep_drafting(nothing_yet, 2) == [True, True]
    assert DSparkPlanner(costly, 4).keep_drafting(nothing_yet, 2) == [False, False]
    rarely = Recalibration()
    for i in range(200):
        rarely.record(torch.full((4,), 0.9), int(i % 20 == 0))
    assert DSparkPlanner(cheap, 4, rarely).keep_drafting(nothing_yet, 2) == [False, False]


def test_a_backlog_is_caught_up_only_where_the_tokens_left_repay_it():
    """Verification is free, a step takes 1 s and a round of 4 drafts 0.4 s: certain drafts cut a token's
    engine time from 1 s to 1.4 / 5 = 0.28 s. Feeding a backlog 195 tokens beyond a round's usual 5 takes
    19.5 s (0.1 s a token): it pays with 100 tokens left (72 s saved), not with 20 (14.4 s), nor after
    rounds whose drafts hardly survived. A usual feed always pays, and a request the catch-up rules out
    does not draft."""
    profile = CostProfile([1, 64], [1.0, 1.0], draft_requests=[1, 64], draft_s=[0.4, 0.4], catch_up_s=0.1)
    planner = DSparkPlanner(profile, 4)
    assert planner.catch_up([200], [100], 1) == [True]
    assert planner.catch_up([200], [20], 1) == [False]
    assert planner.catch_up([5], [1], 1) == [True]
    nothing_yet = [proposal_with([]), proposal_with([])]
    assert planner.keep_drafting(nothing_yet, 2, may_draft=[False, True]) == [False, True]
    planner.plan([proposal_with([0.1] * 4)], 1)
    assert planner.catch_up([200, 5], [100, 100], 1) == [False, True]


def test_requests_queued_behind_a_lone_one_make_its_drafting_too_dear():
    """A plain step takes 0.3 s alone and 2.7 s with 64 requests, a draft step 0.13 s. Alone, a certain
    draft pays; with 63 requests queued behind it (priced as decoding in the step), each second of its
    drafting delays them all: engine time is worth 64 / 2.7 tokens/s, not 1 / 0.3, and neither a draft,
    nor the catch-up of a prompt, nor a whole round pays any more."""
    profile = CostProfile(
        [1, 64, 128], [0.3, 2.7, 5.1], draft_requests=[1, 64], draft_s=[0.9, 0.9], catch_up_s=0.003
    )
    planner = DSparkPlanner(profile, 7)
    alone, queued = 1, 64
    assert planner.keep_drafting([proposal_with([])], alone) == [True]
    assert planner.keep_drafting([proposal_with([])], queued) == [False]
    assert planner.catch_up([200], [100], alone) == [True]
    assert planner.catch_up([200], [100], queued) == [False]
    planner.plan([proposal_with([0.9] * 7)], alone)  # a round drafter's recent survival
    assert planner.draft_round(1, alone) and not planner.draft_round(1, queued)


def test_drafting_is_priced_at_the_round_length_a_serial_drafter_stops_at():
    """Survival 0.9, 0.3, 0.1, 0.05 with a draft step at 0.1 s and free verification: two drafts a round
    give 2.2 tokens in 1.2 s, better than all four (2.35 in 1.4 s) which a serial drafter would not draft."""
    profile = CostProfile([1, 64], [1.0, 1.0], draft_requests=[1, 64], draft_s=[0.4, 0.4])
    survival = torch.tensor([0.9, 0.3, 0.1, 0.05], dtype=torch.float64)
    assert DSparkPlanner(profile, 4).drafted_throughput(survival, 1, 1) == pytest.approx(2.2 / 1.2)
    assert greedy_admission([survival], 1, profile).throughput == pytest.approx(2.35 / 1.4)


def test_a_round_drafter_drafts_only_while_recent_rounds_pay():
    """A round costs 0.4 target steps and verification is free: rounds whose drafts survive 90% of the
    time pay, 10% do not. Without a round yet the planner drafts; after poor rounds it skips, yet drafts
    again every PROBE_EVERY plain steps; good rounds bring drafting back."""
    profile = CostProfile([1, 64], [1.0, 1.0], draft_requests=[1, 64], draft_s=[0.4, 0.4])
    planner = DSparkPlanner(profile, 4)
    assert planner.draft_round(2, 2)
    planner.plan([proposal_with([0.1] * 4)] * 2, 2)
    decisions = [planner.draft_round(2, 2) for _ in range(2 * planner.PROBE_EVERY + 2)]
    probe = planner.PROBE_EVERY
    assert decisions == ([False] * probe + [True]) * 2
    for _ in range(3):
        planner.plan([proposal_with([0.9] * 4)] * 2, 2)
    assert planner.draft_round(2, 2)
    planner.plan([proposal_with([0.9, 0.9])], 2)  # a capped proposal says nothing about full rounds
    assert planner.recent_survival.shape == (4,)


def test_recalibration_cuts_an_overconfident_drafters_verification_and_drafting():
    """A drafter that claims 0.9 per draft while past rounds accepted its first draft 80% of the time and
    never its second: read raw, the plan verifies most of 7 drafts; recalibrated, one, and the drafter
    stops after it."""
    profile = CostProfile([1, 64], [1.0, 1.0 + 0.3 * 63], draft_requests=[1, 64], draft_s=[0.4, 0.4])
    recal = Recalibration()
    for i in range(200):
        recal.record(torch.full((7,), 0.9), int(i % 5 != 0))
    raw, recalibrated = DSparkPlanner(profile, 4), DSparkPlanner(profile, 4, recal)
    assert raw.plan([proposal_with([0.9] * 7)], 1).lengths[0] >= 4
    assert recalibrated.plan([proposal_with([0.9] * 7)], 1).lengths == [1]
    assert raw.keep_drafting([proposal_with([0.9])], 1) == [True]
    assert recalibrated.keep_drafting([proposal_with([0.9])], 1) == [False]


def test_profile_command_measures_and_saves_a_usable_table(tiny_model_dir, tmp_path, capsys):
    import json

    from specserve.cli import main

    spec = json.dumps({"method": "ngram"})
    out = tmp_path / "profile.json"
    assert (
        main(
            [
                "profile",
                "--model",
                str(tiny_model_dir("qwen3")),
                "--speculative-config",
                spec,
                "--output",
                str(out),
            ]
        )
        == 0
    )
    profile = CostProfile.load(out)
    assert profile.batch_tokens[0] == 1 and profile.batch_tokens[-1] == 64 * (3 + 1)  # what a step holds
    assert all(t > 0 for t in profile.step_s) and len(profile.draft_s) == len(profile.draft_requests)
    assert out.with_suffix(".png").is_file() and "saved" in capsys.readouterr().out


def test_the_target_table_times_warm_forwards_and_never_falls_as_b_grows(monkeypatch):
    """Fake forwards on a fake clock, run by a fake GPU: a forward only queues its work (as a launch
    returns at once), which the device's synchronize does; the timings wait for it. The first two at B = 1
    are slow (weights paged in); the first is not timed and the median of three drops the second. B = 2
    measured slower than B = 4 (disturbance) and takes B = 4's time: a larger batch never takes less."""
    from types import SimpleNamespace

    from specserve.spec_decode import profiler

    clock, queued = [0.0], []
    seconds = {1: [9.0, 9.0, 0.25, 0.25], 2: [0.4] * 3, 3: [0.35] * 3, 4: [0.3] * 3}

    def forward(pieces, rows):
        queued.append(seconds[sum(len(p.token_ids) for p in pieces)].pop(0))

    def synchronize():
        clock[0] += sum(queued)
        queued.clear()

    monkeypatch.setattr(profiler.time, "perf_counter", lambda: clock[0])
    target = SimpleNamespace(
        platform=SimpleNamespace(synchronize=synchronize),
        max_model_len=1024,
        max_num_seqs=2,
        max_num_batched_tokens=2048,
        vocab_size=256,
        model=SimpleNamespace(has_recurrent_state=False),
    )
    blocks = SimpleNamespace(can_grow=lambda seq, n: True, grow=lambda seq, n: None, free=lambda seq: None)
    caches = SimpleNamespace(kv=SimpleNamespace(blocks=blocks), states=None, state_slot=lambda request: None)
    measure = profiler.CostProfiler(target, SimpleNamespace(forward=forward), caches, None, 1)
    measure.draft_s, measure.catch_up_s = {1: 0.01, 2: 0.01}, 0.0  # the drafter's points: not under test
    profile = measure.measure()
    # B up to 2 requests x (1 draft + anchor); 2 was off the line from 1 to 4, so 3 was probed too
    assert profile.batch_tokens == [1, 2, 3, 4]
    assert profile.step_s == pytest.approx([0.25, 0.3, 0.3, 0.3])
    assert all(not left for left in seconds.values())


def test_engine_start_measures_the_cost_profile_once_and_caches_it(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path))
    target = str(tiny_model_dir("qwen3"))
    spec = {"method": "ngram", "num_speculative_tokens": 3, "verify_policy": "dspark"}
    llm = LLM(target, max_model_len=128, speculative_config=spec)
    serve_until_profiled(
        llm, [[7, 8, 9] * 5], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    )
    measured = llm.engine.speculator.planner.profile  # measured between the steps, then the policy's
    (table,) = tmp_path.glob("profiles/*.json")
    assert table.with_suffix(".png").is_file()
    written = table.stat().st_mtime_ns
    cached = LLM(target, max_model_len=128, speculative_config=spec).engine.speculator.planner.profile
    assert table.stat().st_mtime_ns == written and cached.step_s == measured.step_s
