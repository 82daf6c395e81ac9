"""Speculative decoding in the engine: greedy equivalence with every drafter, stops inside accepted
drafts, metrics, and configuration errors."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from specserve import LLM, SamplingParams, SpecserveError
from specserve.spec_decode.calibration.offline import save_temperatures
from specserve.spec_decode.cost_profile import CostProfile
from specserve.spec_decode.drafters.ngram import lookup
from specserve.spec_decode.planner import ScheduledPlanner
from tests.tiny_models import VOCAB, save_tiny_drafter


def repetitive_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a motif, so prompt lookup finds matches and drafts get accepted and rejected."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        motif = torch.randint(3, VOCAB, (int(torch.randint(3, 8, (1,), generator=g)),), generator=g).tolist()
        noise = torch.randint(3, VOCAB, (int(torch.randint(1, 20, (1,), generator=g)),), generator=g).tolist()
        out.append(noise + motif * int(torch.randint(2, 5, (1,), generator=g)))
    return out


@pytest.fixture(scope="module")
def target_dir(tiny_model_dir):
    return str(tiny_model_dir("qwen3"))


@pytest.fixture(scope="module")
def reference(target_dir):
    """Plain greedy outputs of the target for the test prompts."""
    llm = LLM(target_dir, max_model_len=256)
    prompts = repetitive_prompts(8)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    return prompts, [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


@pytest.fixture(scope="module")
def cheap_drafting(tmp_path_factory) -> str:
    """A cost table where a draft step costs a tenth of a target step: the scheduled policies draft."""
    profile = CostProfile([1, 2048], [1.0, 3.0], draft_requests=[1, 64], draft_s=[0.5, 0.5])
    return str(profile.save(tmp_path_factory.mktemp("cost") / "cheap-drafting.json"))


# name -> (tiny model directory by arch, a cost profile) -> speculative config
SPEC_CONFIGS = {
    "ngram": lambda dirs, _: {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1},
    # The target itself as its own draft model: every draft is accepted (a strong check of bookkeeping).
    "draft_model_self": lambda dirs, _: {
        "method": "draft_model",
        "model": dirs("qwen3"),
        "num_speculative_tokens": 3,
    },
    # A different random model: drafts are mostly rejected.
    "draft_model_other": lambda dirs, _: {
        "method": "draft_model",
        "model": dirs("qwen2"),
        "num_speculative_tokens": 5,
    },
    # Draft probabilities as confidences for the load-aware planner; near max_tokens it gets empty proposals.
    "draft_model_scheduled": lambda dirs, profile: {
        "method": "draft_model",
        "model": dirs("qwen2"),
        "num_speculative_tokens": 5,
        "verify_policy": "dspark",
        "cost_profile": profile,
    },
}


def greedy_bigram_bias(target_dir: str, strength: float = 30.0) -> torch.Tensor:
    """[V, V] Markov bias pointing from each token to the target's greedy successor of that token alone:
    a context-free guess, right only part of the time, so that drafts are both accepted and rejected."""
    llm = LLM(target_dir, max_model_len=16)
    outs = llm.generate([[t] for t in range(VOCAB)], SamplingParams(temperature=0.0, max_tokens=1))
    successor = torch.tensor([o.outputs[0].token_ids[0] for o in outs])
    return torch.nn.functional.one_hot(successor, VOCAB).float() * strength


@pytest.fixture(scope="module")
def drafter_dirs(tmp_path_factory, tiny_model_dir):
    """(target arch, drafter kind) -> a saved DeepSpec-format drafter for that tiny target."""
    cache = {}

    def get(arch: str, kind: str) -> str:
        if (arch, kind) not in cache:
            target = str(tiny_model_dir(arch))
            config = {
                "vanilla": dict(markov_bias=greedy_bigram_bias(target)),
                "gated": dict(markov_head_type="gated"),
                "rnn": dict(markov_head_type="rnn", block_size=5),
                "dflash": dict(markov_rank=0, confidence_head=False),
                "eagle3": dict(eagle3=True, ttt_length=4),
            }[kind]
            directory = tmp_path_factory.mktemp(f"{arch}_{kind}")
            cache[arch, kind] = str(save_tiny_drafter(target, directory, std=0.2, **config))
        return cache[arch, kind]

    return get


DSPARK_CONFIGS = {
    "dspark_vanilla": lambda d: {"method": "dspark", "model": d("qwen3", "vanilla")},
    "dspark_vanilla_k2": lambda d: {
        "method": "dspark",
        "model": d("qwen3", "vanilla"),
        "num_speculative_tokens": 2,
    },
    "dspark_gated": lambda d: {"method": "dspark", "model": d("qwen3", "gated")},
    "dspark_rnn": lambda d: {"method": "dspark", "model": d("qwen3", "rnn")},
    "dspark_threshold": lambda d: {
        "method": "dspark",
        "model": d("qwen3", "vanilla"),
        "verify_policy": "threshold",
        "confidence_threshold": 0.5,
    },
    "dspark_scheduled": lambda d: {
        "method": "dspark",
        "model": d("qwen3", "vanilla"),
        "verify_policy": "dspark",
    },
    "dspark_async": lambda d: {
        "method": "dspark",
        "model": d("qwen3", "vanilla"),
        "verify_policy": "dspark_async",
    },
    "dflash": lambda d: {"method": "dflash", "model": d("qwen3", "dflash")},
    "eagle3": lambda d: {"method": "eagle3", "model": d("qwen3", "eagle3")},
}


@pytest.mark.parametrize("name", list(DSPARK_CONFIGS))
def test_dspark_greedy_equals_greedy_decoding(name, target_dir, reference, drafter_dirs, cheap_drafting):
    prompts, expected = reference
    spec = DSPARK_CONFIGS[name](drafter_dirs)
    if spec.get("verify_policy") in ("dspark", "dspark_async"):
        spec["cost_profile"] = cheap_drafting  # a measured table may make drafting not pay: nothing checked
    llm = LLM(target_dir, max_model_len=256, max_num_seqs=4, speculative_config=spec)
    observed = record_observe(llm)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == expected
    stats = llm.engine.spec_stats
    assert stats.num_drafts > 0
    if "vanilla" in name:
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # both outcomes were exercised
    check_context_bookkeeping(observed)
    if name != "dflash" and name != "eagle3":  # a confidence head: live calibration and the step log
        assert sum(llm.engine.speculator.calibration.samples_per_position()) > 0
        assert all(sum(r.budgets) + len(r.budgets) <= r.batch_tokens for r in llm.engine.speculator.step_log)
    drafter = llm.engine.speculator.drafter
    assert drafter.states == {} and drafter.blocks.num_used_blocks == 0
    assert llm.engine.block_manager.num_used_blocks == 0


def test_deepspec_threshold_semantics(target_dir, drafter_dirs, tmp_path):
    """`threshold_semantics: "deepspec"` thresholds the head's raw confidences (an STS file beside the
    drafter changes nothing) and verifies a headless drafter's whole block; specserve's default reads the
    calibrated confidences, and a DFlash drafter's peak probabilities."""
    prompts = repetitive_prompts(3, seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

    def budgets(spec):
        llm = LLM(target_dir, max_model_len=128, speculative_config=spec)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
        return [r.budgets for r in llm.engine.speculator.step_log]

    expected = [o.outputs[0].token_ids for o in LLM(target_dir, max_model_len=128).generate(prompts, params)]
    raw = drafter_dirs("qwen3", "vanilla")
    calibrated = shutil.copytree(raw, tmp_path / "calibrated")
    save_temperatures([100.0] * 4, calibrated)  # every calibrated confidence ~0.5
    threshold = {"method": "dspark", "verify_policy": "threshold", "confidence_threshold": 0.45}
    raw_budgets = budgets(threshold | {"model": raw})
    assert budgets(threshold | {"model": str(calibrated), "threshold_semantics": "deepspec"}) == raw_budgets
    assert budgets(threshold | {"model": str(calibrated)}) != raw_budgets

    dflash = {"method": "dflash", "model": drafter_dirs("qwen3", "dflash"), "verify_policy": "threshold"}
    dflash["confidence_threshold"] = 0.9  # above every peak probability of this random drafter
    assert not any(map(any, budgets(dflash)))
    assert max(map(max, budgets(dflash | {"threshold_semantics": "deepspec"}))) == 4  # the block size


@pytest.mark.parametrize("arch", ["gemma4", "qwen2", "qwen3_moe"])
def test_hidden_state_drafters_on_other_targets(arch, tiny_model_dir, drafter_dirs):
    target = str(tiny_model_dir(arch))
    prompts = repetitive_prompts(4, seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in LLM(target, max_model_len=128).generate(prompts, params)]
    for kind, method in (("vanilla", "dspark"), ("dflash", "dflash"), ("eagle3", "eagle3")):
        spec = {"method": method, "model": drafter_dirs(arch, kind)}
        llm = LLM(target, max_model_len=128, speculative_config=spec)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected, kind


def record_observe(llm) -> list:
    """Wrap the drafter's observe: (request id, start, rows, drafts verified, accepted) per call."""
    drafter, calls = llm.engine.speculator.drafter, []
    real = drafter.observe

    def observe(seq, start, features):
        calls.append((seq.request_id, start, features.shape[0], seq.num_computed_tokens))
        real(seq, start, features)

    drafter.observe = observe
    return calls


def check_context_bookkeeping(calls) -> None:
    """Pitfall 8: the drafter gets every position exactly once and in order (prompt rows, then anchor +
    accepted drafts of each verification), and never a row beyond what the target cache holds."""
    next_row: dict[str, int] = {}
    for request_id, start, rows, computed in calls:
        assert start == next_row.get(request_id, 0)
        assert start + rows == computed
        next_row[request_id] = start + rows


@pytest.mark.parametrize("name", list(SPEC_CONFIGS))
def test_greedy_speculation_equals_greedy_decoding(
    name, target_dir, reference, tiny_model_dir, cheap_drafting
):
    prompts, expected = reference
    spec = SPEC_CONFIGS[name](lambda arch: str(tiny_model_dir(arch)), cheap_drafting)
    llm = LLM(target_dir, max_model_len=256, speculative_config=spec)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == expected
    stats = llm.engine.spec_stats
    assert stats.num_drafts > 0 and stats.num_draft_tokens >= stats.num_accepted_tokens
    if name == "draft_model_self":
        assert stats.num_accepted_tokens == stats.num_draft_tokens
    assert llm.engine.block_manager.num_used_blocks == 0


def test_a_draft_model_drafts_nothing_where_drafting_cannot_pay(
    target_dir, reference, tiny_model_dir, tmp_path
):
    """A draft step costs as much as 60 target steps: the scheduled policy decides before the first draft
    that no request drafts, every step is a plain decode step and the output is greedy decoding's."""
    prompts, expected = reference
    profile = CostProfile([1, 2048], [1.0, 1.0], draft_requests=[1, 256], draft_s=[300.0, 300.0])
    spec = SPEC_CONFIGS["draft_model_scheduled"](
        lambda arch: str(tiny_model_dir(arch)), str(profile.save(tmp_path / "p.json"))
    )
    llm = LLM(target_dir, max_model_len=256, speculative_config=spec)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.engine.spec_stats.num_drafts == 0 and llm.engine.speculator.drafter.states == {}


def test_a_draft_model_catches_up_after_steps_without_drafts(
    target_dir, reference, tiny_model_dir, cheap_drafting, monkeypatch
):
    """Every other step drafts nothing: the next drafting step feeds the draft cache every token it
    missed, and the output is still greedy decoding's."""
    decide = ScheduledPlanner.keep_drafting
    calls = {"first": 0}

    def every_other_step(self, proposals, base_tokens, may_draft=None):
        if all(not p.token_ids for p in proposals):
            calls["first"] += 1
            if calls["first"] % 2:
                return [False] * len(proposals)
        return decide(self, proposals, base_tokens, may_draft)

    monkeypatch.setattr(ScheduledPlanner, "keep_drafting", every_other_step)
    prompts, expected = reference
    spec = SPEC_CONFIGS["draft_model_scheduled"](lambda arch: str(tiny_model_dir(arch)), cheap_drafting)
    llm = LLM(target_dir, max_model_len=256, speculative_config=spec)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == expected
    stats = llm.engine.spec_stats
    assert stats.num_drafts > 0 and calls["first"] >= 4  # steps with and without drafts


def test_the_planner_prices_queued_requests_as_decoding_ones(
    target_dir, reference, tiny_model_dir, cheap_drafting, monkeypatch
):
    """Long prompts arrive while others decode (chunked prefill rides in the same steps): the planner is
    asked with one plain token per request the engine holds, decoding, in prefill or waiting (what a
    second of drafting delays), never with the prompt chunks (which would make drafting look cheap)."""
    asked = []
    decide = ScheduledPlanner.keep_drafting

    def record(self, proposals, base_tokens, may_draft=None):
        scheduler = llm.engine.scheduler
        asked.append((len(proposals), len(scheduler.running) + len(scheduler.waiting), base_tokens))
        return decide(self, proposals, base_tokens, may_draft)

    monkeypatch.setattr(ScheduledPlanner, "keep_drafting", record)
    spec = SPEC_CONFIGS["draft_model_scheduled"](lambda arch: str(tiny_model_dir(arch)), cheap_drafting)
    llm = LLM(target_dir, max_model_len=256, max_num_batched_tokens=32, speculative_config=spec)
    prompts = [list(range(3, 10)), list(range(3, 100)), list(range(5, 150))]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    assert asked and all(base == held for _, held, base in asked)
    assert any(decoding < base for decoding, _, base in asked)  # steps with prompts still in prefill


def test_the_planner_weighs_each_requests_backlog_against_the_tokens_it_has_left(
    target_dir, tiny_model_dir, cheap_drafting, monkeypatch
):
    """A draft model is asked about a new request's backlog (its prompt and first token) with the tokens
    left counting down from max_tokens; after a verified round the backlog is at most that round's
    tokens. A request whose catch-up does not pay never drafts and decodes plainly, exactly."""
    asked = []
    decide = ScheduledPlanner.catch_up

    def record(self, backlogs, remaining, base_tokens):
        asked.append((backlogs[0], remaining[0]))
        return decide(self, backlogs, remaining, base_tokens)

    monkeypatch.setattr(ScheduledPlanner, "catch_up", record)
    spec = SPEC_CONFIGS["draft_model_scheduled"](lambda arch: str(tiny_model_dir(arch)), cheap_drafting)
    llm = LLM(target_dir, max_model_len=256, speculative_config=spec)
    prompt = list(range(3, 40))
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    plain = LLM(target_dir, max_model_len=256).generate([prompt], params)[0].outputs[0].token_ids
    assert llm.generate([prompt], params)[0].outputs[0].token_ids == plain
    k = llm.engine.speculator.num_draft_tokens
    assert asked[0] == (len(prompt) + 1, 19) and llm.engine.spec_stats.num_drafts > 0
    assert len(asked) > 1 and all(1 <= backlog <= k + 1 for backlog, _ in asked[1:])
    assert [left for _, left in asked] == sorted({left for _, left in asked}, reverse=True)

    monkeypatch.setattr(ScheduledPlanner, "catch_up", lambda self, backlogs, *_: [False] * len(backlogs))
    llm = LLM(target_dir, max_model_len=256, speculative_config=spec)
    assert llm.generate([prompt], params)[0].outputs[0].token_ids == plain
    assert llm.engine.spec_stats.num_drafts == 0 and llm.engine.speculator.drafter.states == {}


@pytest.mark.parametrize("name", ["dspark_scheduled", "eagle3"])
def test_round_drafters_catch_up_after_steps_without_a_round(
    name, target_dir, reference, drafter_dirs, cheap_drafting, monkeypatch
):
    """Every other step drafts no round: the drafter still collects the target's features and takes them
    all into its context at the next round, and the output is still greedy decoding's."""
    calls = {"rounds": 0}

    def every_other_step(self, num_requests, base_tokens):
        calls["rounds"] += 1
        return calls["rounds"] % 2 == 0

    monkeypatch.setattr(ScheduledPlanner, "draft_round", every_other_step)
    prompts, expected = reference
    spec = {**DSPARK_CONFIGS[name](drafter_dirs), "verify_policy": "dspark", "cost_profile": cheap_drafting}
    llm = LLM(target_dir, max_model_len=256, max_num_seqs=4, speculative_config=spec)
    observed = record_observe(llm)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.engine.spec_stats.num_drafts > 0 and calls["rounds"] >= 20
    assert any(not any(r.budgets) for r in llm.engine.speculator.step_log)  # plain steps are logged too
    check_context_bookkeeping(observed)


def test_stops_and_max_tokens_inside_accepted_drafts(target_dir, reference, tiny_model_dir):
    prompts, expected = reference
    spec = {"method": "draft_model", "model": str(tiny_model_dir("qwen3")), "num_speculative_tokens": 4}
    llm = LLM(target_dir, max_model_len=256, speculative_config=spec)
    stop_ids = [e[6] for e in expected]
    params = [
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop_token_ids=[s]) for s in stop_ids
    ]
    outs = llm.generate(prompts, params)
    for out, full, stop in zip(outs, expected, stop_ids):
        assert out.outputs[0].token_ids == full[: full.index(stop) + 1]
        assert out.outputs[0].stop_reason == stop
    # Every draft is accepted: output token i > 0 comes from round ceil(i / 5) (4 drafts + bonus). A round
    # that ends on an accepted stop token counts up to the stop, with no bonus token (DeepSpec's tau).
    stops = [full.index(stop) for full, stop in zip(expected, stop_ids)]
    stats = llm.engine.spec_stats
    assert stats.num_drafts == sum(-(-s // 5) for s in stops)
    assert stats.mean_acceptance_length == sum(stops) / stats.num_drafts
    assert stats.num_accepted_tokens == sum(stops) - sum(s // 5 for s in stops)
    for max_tokens in (1, 2, 3, 7):
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        assert [o.outputs[0].token_ids for o in outs] == [e[:max_tokens] for e in expected]
    assert llm.engine.block_manager.num_used_blocks == 0


def test_per_request_metrics(target_dir, tiny_model_dir):
    spec = {"method": "draft_model", "model": str(tiny_model_dir("qwen3")), "num_speculative_tokens": 3}
    llm = LLM(target_dir, max_model_len=256, speculative_config=spec)
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=21, ignore_eos=True))[0]
    stats = llm.engine.spec_stats
    # 1 token from the prefill, then rounds of 3 drafts + 1 bonus token: 5 rounds give 20 tokens.
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (5, 15, 15)
    assert stats.accepted_per_position == [5, 5, 5] and stats.mean_acceptance_length == 4.0
    assert len(out.outputs[0].token_ids) == 21


def test_ngram_lookup():
    tokens = np.array([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3])
    assert lookup(tokens, 1, 3, 2) == [7, 8]  # latest earlier match of [1, 2, 3] is followed by 7, 8
    assert lookup(np.array([4, 5, 6]), 1, 3, 2) == []
    assert lookup(np.array([5, 6, 5]), 1, 2, 3) == [6, 5]


@pytest.mark.parametrize(
    "spec, match",
    [
        ({"method": "medusa"}, "unknown speculative method"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "draft_model"}, "needs 'model'"),
        ({"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_max"),
        ({"method": "ngram", "lookahead": 2}, "unknown speculative config keys"),
        ({"method": "ngram", "live_recalibration": "yes"}, "live_recalibration must be true or false"),
        ({"method": "ngram", "threshold_semantics": "deepspec"}, "only used with verify_policy 'threshold'"),
        ({"method": "ngram", "threshold_semantics": "vllm"}, "threshold_semantics must be one of"),
        ('{"method": ', "not valid JSON"),
    ],
)
def test_bad_speculative_config(spec, match, target_dir):
    with pytest.raises(SpecserveError, match=match):
        LLM(target_dir, max_model_len=256, speculative_config=spec)


def test_draft_model_with_another_vocabulary_is_refused(target_dir, tmp_path):
    import transformers

    config = transformers.Qwen3Config(
        vocab_size=VOCAB + 8,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
    )
    transformers.Qwen3ForCausalLM(config).save_pretrained(tmp_path)
    with pytest.raises(SpecserveError, match="vocabulary"):
        LLM(
            target_dir,
            max_model_len=256,
            speculative_config={"method": "draft_model", "model": str(tmp_path)},
        )
