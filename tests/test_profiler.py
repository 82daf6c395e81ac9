"""The cost profile: few points, where the planner needs them, measured while the engine serves with a fixed
k; greedy output is unchanged throughout."""

from __future__ import annotations

import pytest

from specserve import LLM, SamplingParams
from specserve.core.cache_groups import PagedEntry
from specserve.spec_decode.cost_profile import CostProfile, cache_path
from specserve.spec_decode.planner import DSparkPlanner, FixedPlanner
from specserve.spec_decode.profiler import MAX_TARGET_POINTS, CostProfiler, coarse_grid
from tests.test_speculative import repetitive_prompts

pytestmark = pytest.mark.kernel_agnostic


def test_the_grid_is_coarse_and_capped():
    assert coarse_grid(320) == [1, 4, 16, 64, 256, 320]
    assert coarse_grid(4) == [1, 4]
    assert coarse_grid(1) == [1]


class Timed(CostProfiler):
    """A profiler whose target steps take `cost(B)` seconds (nothing runs), its drafter measured already."""

    def __init__(self, cost, max_num_seqs: int, k: int, max_batched: int = 2048):
        self.cost, self.max_tokens = cost, max(1, min(max_batched, max_num_seqs * (k + 1)))
        self.steps, self.pending, self.last_probes = {}, coarse_grid(self.max_tokens), None
        self.draft_points, self.draft_s, self.catch_up_s = [1], {1: 0.01}, 0.0
        self.scratch, self.bar, self.timed, self.context = object(), None, [], 512
        self.blocks = type("Blocks", (), {"free": lambda self, seq: None})()

    def _time_target(self, b):
        self.timed.append(b)
        return self.cost(b)


def knee_at(knee: int):
    return lambda b: 0.05 * max(1.0, b / knee)  # flat (memory-bound) up to the knee, then linear


@pytest.mark.parametrize("knee", [3, 12, 40, 100])
def test_points_gather_where_the_curve_bends(knee):
    profiler = Timed(knee_at(knee), max_num_seqs=64, k=4)  # B up to 320
    profile = profiler.measure()
    assert profile.batch_tokens == sorted(set(profiler.timed))
    assert max(profile.batch_tokens) == 320 and len(profile.batch_tokens) <= MAX_TARGET_POINTS
    # linear interpolation of the measured points is within 10% of the curve everywhere but right at the knee
    worst = max(
        abs(profile.step_time(b) - knee_at(knee)(b)) / knee_at(knee)(b)
        for b in range(1, 321)
        if not knee / 2 < b < knee * 2
    )
    assert worst < 0.1
    # and the probes went to the bend: more points around it than across the flat or the linear part
    near = [b for b in profile.batch_tokens if knee / 4 <= b <= knee * 4]
    assert len(near) >= 3


def test_a_straight_cost_needs_no_refining():
    profiler = Timed(lambda b: 0.05 + 0.001 * b, max_num_seqs=64, k=4)
    profile = profiler.measure()
    coarse = coarse_grid(320)
    assert len(profile.batch_tokens) == 2 * len(coarse) - 1  # the grid and one probe a gap, nothing more


def test_the_grid_stops_at_what_a_step_can_hold():
    assert max(Timed(knee_at(8), max_num_seqs=4, k=3).measure().batch_tokens) == 16
    assert max(Timed(knee_at(8), max_num_seqs=64, k=7, max_batched=256).measure().batch_tokens) == 256


def serve_until_profiled(llm: LLM, prompts, params: SamplingParams, expected=None) -> None:
    """Generate until the cost profile, one point a step, is whole (a few rounds at most); each round's
    outputs equal `expected` where given."""
    for _ in range(10):
        outputs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert expected is None or outputs == expected
        if llm.engine.speculator.profiler is None:
            return
    raise AssertionError("the cost profile was not measured in 10 rounds of requests")


def test_serving_starts_with_fixed_k_and_takes_the_policy_once_measured(
    tiny_model_dir, tmp_path, monkeypatch
):
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path))
    target, draft = str(tiny_model_dir("qwen3")), str(tiny_model_dir("qwen2"))
    prompts = repetitive_prompts(3)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in LLM(target, max_model_len=256).generate(prompts, params)]
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 3, "verify_policy": "dspark"}
    llm = LLM(target, max_model_len=256, max_num_seqs=4, speculative_config=spec)
    speculator = llm.engine.speculator
    assert isinstance(speculator.planner, FixedPlanner) and not speculator.profiler.steps  # nothing yet
    assert not speculator.profiler.draft_s and speculator.profiler.catch_up_s is None
    assert not cache_path(speculator.profile_key()).exists()
    serve_until_profiled(llm, prompts, params, plain)
    assert isinstance(speculator.planner, DSparkPlanner)
    profile = speculator.planner.profile
    assert max(profile.batch_tokens) == 4 * (3 + 1) and all(t > 0 for t in profile.step_s)
    assert profile.draft_requests == [1, 4] and profile.catch_up_s >= 0
    assert CostProfile.load(cache_path(speculator.profile_key())).batch_tokens == profile.batch_tokens
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == plain  # now scheduled
    # the next engine finds it cached: the policy from its first step
    again = LLM(target, max_model_len=256, max_num_seqs=4, speculative_config=spec).engine.speculator
    assert again.profiler is None and again.planner.profile.batch_tokens == profile.batch_tokens


def test_a_drafter_point_waits_for_room_and_leaves_nothing_behind(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path))
    target, draft = str(tiny_model_dir("qwen3")), str(tiny_model_dir("qwen2"))
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 3, "verify_policy": "dspark"}
    engine = LLM(target, max_model_len=256, max_num_seqs=4, speculative_config=spec).engine
    profiler, (group,) = engine.speculator.profiler, engine.caches.drafter.paged
    free = group.blocks.num_free_blocks
    hog = PagedEntry()  # what the engine's own requests might hold: all but a few blocks
    group.blocks.grow(hog, (free - 3) * group.block_size)
    assert not profiler.advance() and profiler.catch_up_s is None  # the 256-token prompt needs more
    group.blocks.free(hog)
    assert profiler.advance() and profiler.catch_up_s is not None
    assert profiler.advance() and list(profiler.draft_s) == [1]
    assert group.blocks.num_free_blocks == free and not group.entries  # the fake requests are gone
