"""Statistical losslessness of the whole engine: with a poor drafter, sampled continuations follow the
exact target distribution, computed by enumeration with transformers; a broken sampler fails the test, and
so does a verify policy that reads a draft's own probability.
Every drafter kind runs here (draft model; DSpark with each sequential head, with and without confidence
truncation; DFlash; 1+N infill and pruned-vocabulary drafters of the speculators format; DFlash2's candidate
selector), its sampled requests batched together with greedy requests on other prompts."""

from __future__ import annotations

import itertools

import pytest
import torch
import transformers
from scipy import stats

from specserve import LLM, SamplingParams
from specserve.layers.sampler import SamplingBatch, target_probs
from specserve.models.loader import load_model
from specserve.spec_decode.cost_profile import CostProfile
from tests.drafter_formats import speculators_config, write_drafter
from tests.tiny_models import save_tiny_drafter

pytestmark = pytest.mark.kernel_agnostic

V = 16
PROMPT = [3, 7, 1, 12, 5]
NUM_SAMPLES = 20_000  # the slow tier's reference cases
DRAFTER_SAMPLES = 8_000  # every case of the default tier and the power checks


def make_model(directory, seed: int, logit_scale: float):
    torch.manual_seed(seed)
    config = transformers.Qwen3Config(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    model = transformers.Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)  # peaked distributions, so that a wrong sampler shows
    model.save_pretrained(directory)
    return model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    target_dir, draft_dir = tmp_path_factory.mktemp("target"), tmp_path_factory.mktemp("draft")
    # The drafter is the target at a much higher temperature: related, but often wrong.
    return make_model(target_dir, 0, 60.0), str(target_dir), str(draft_dir), make_model(draft_dir, 0, 15.0)


@torch.no_grad()
def bigram_log_probs(reference) -> torch.Tensor:
    """[V, V]: log p(next | PROMPT + [x]) for every x, a context-free guess at what follows x."""
    ids = torch.tensor([PROMPT + [x] for x in range(V)])
    return reference(ids).logits[:, -1].float().log_softmax(-1)


@pytest.fixture(scope="module")
def drafters(models, tmp_path_factory):
    """name -> speculative config. DSpark drafters: random backbones reading the target's layer 0 and a
    flattened LM head; vanilla and gated heads get a planted bigram table (blurred), so that they are poor
    but not useless; with no head (DFlash), a random RNN head or EAGLE-3's, drafts are near-uniform."""
    reference, target_dir, draft_dir, _ = models
    bigram = bigram_log_probs(reference) * 0.7

    def dspark(name, **config):
        directory = tmp_path_factory.mktemp(name)
        # A planted bigram is a vanilla head's bias (and gated's, scaled by its gate); the RNN's is not.
        if config.get("eagle3"):
            save_tiny_drafter(target_dir, directory, head_scale=0.02, **config)
            return str(directory)
        planted = {"markov_bias": bigram} if config.get("markov_head_type", "vanilla") != "rnn" else {}
        if config.get("markov_rank") == 0:
            planted = {}
        save_tiny_drafter(
            target_dir, directory, mask_token_id=V - 1, block_size=3, head_scale=0.02, **planted, **config
        )
        return str(directory)

    def other_format(kind: str, draft_vocab: int | None = None) -> str:
        _, target_config, _ = load_model(target_dir)
        if kind in ("dflash", "dflash2"):  # with a flattened LM head of its own: poor, not useless
            raw = speculators_config(target_config, kind, tokens=3, aux_hidden_state_layer_ids=[1])
            raw["selector_top_k"] = 12  # DFlash2
            options = {"drop": ("embed_tokens.weight",), "head_scale": 0.02}
        else:
            raw = speculators_config(target_config, "dspark", tokens=3, draft_vocab_size=draft_vocab)
            raw |= {"sample_from_anchor": False, "aux_hidden_state_layer_ids": [1], "mask_token_id": V - 1}
            options = {"kept_ids": list(range(1, 1 + draft_vocab))}
        std = 0.01 if kind == "dflash2" else 0.05  # (DFlash2: flatter, so that its third drafts survive too)
        return str(write_drafter(target_dir, tmp_path_factory.mktemp(kind), raw, std=std, **options))

    vanilla = dspark("vanilla")
    # Step time 1 + 0.0002 B: at ~1000 decoding requests a draft pays when its survival exceeds ~0.17, at
    # fewer requests lower, so the scheduled planners verify different lengths from step to step.
    profile = CostProfile([1, 4096], [1.0002, 1 + 0.0002 * 4096]).save(
        tmp_path_factory.mktemp("cost") / "p.json"
    )
    # Drafting costs 0.1 s a step: the draft model stops early where the next draft would not pay.
    drafting = CostProfile(
        [1, 4096], [1.0002, 1 + 0.0002 * 4096], draft_requests=[1, 4096], draft_s=[0.3, 0.3]
    ).save(tmp_path_factory.mktemp("cost") / "p.json")
    return {
        "draft_model": {"method": "draft_model", "model": draft_dir, "num_speculative_tokens": 3},
        "draft_model_scheduled": {
            "method": "draft_model",
            "model": draft_dir,
            "num_speculative_tokens": 3,
            "verify_policy": "dspark",
            "cost_profile": str(drafting),
        },
        "dspark_vanilla": {"method": "dspark", "model": vanilla},
        "dspark_scheduled": {
            "method": "dspark",
            "model": vanilla,
            "verify_policy": "dspark",
            "cost_profile": str(profile),
        },
        "dspark_async": {
            "method": "dspark",
            "model": vanilla,
            "verify_policy": "dspark_async",
            "cost_profile": str(profile),
        },
        "dspark_rnn": {"method": "dspark", "model": dspark("rnn", markov_head_type="rnn")},
        "dspark_gated_threshold": {
            "method": "dspark",
            "model": dspark("gated", markov_head_type="gated"),
            "verify_policy": "threshold",
            "confidence_threshold": 0.5,
        },
        "dflash": {
            "method": "dflash",
            "model": dspark("dflash", markov_rank=0, confidence_head=False),
        },
        "eagle3": {"method": "eagle3", "model": dspark("eagle3", eagle3=True), "num_speculative_tokens": 3},
        # speculators-format drafters in 1+N infill blocks: DSpark with a pruned vocabulary (q is 0 off
        # it), DFlash.
        "speculators_dspark_pruned": {"method": "dspark", "model": other_format("dspark", V - 6)},
        "speculators_dflash": {"method": "dflash", "model": other_format("dflash")},
        # DFlash2: q is the candidate selector's distribution over each slot's top 12 (0 elsewhere).
        "speculators_dflash2": {"method": "dflash", "model": other_format("dflash2")},
    }


def exact_joint(reference, params: SamplingParams, length: int) -> dict[tuple[int, ...], float]:
    """P(x1..x_length | PROMPT) under the request's sampling transforms, by enumeration."""
    dist = {(): 1.0}
    for _ in range(length):
        prefixes = list(dist)
        ids = torch.tensor([PROMPT + list(p) for p in prefixes])
        with torch.no_grad():
            logits = reference(ids).logits[:, -1].float()
        for token, bias in (params.logit_bias or {}).items():
            logits[:, token] += bias  # OpenAI's definition: added to the model's logits before sampling
        batch = SamplingBatch.build(
            [params] * len(prefixes), [PROMPT] * len(prefixes), [list(p) for p in prefixes], V
        )
        probs = target_probs(logits, batch).double()
        dist = {p + (x,): dist[p] * float(probs[i, x]) for i, p in enumerate(prefixes) for x in range(V)}
    return dist


GREEDY_PROMPTS = [[1, 2, 3], [9, 9, 4, 0, 11, 2, 5, 6], [14]]


def sampled_joint(
    target_dir: str,
    spec: dict,
    params: SamplingParams,
    length: int,
    num_samples: int,
    tensor_parallel_size: int = 1,
    **engine_args,
) -> dict:
    llm = LLM(
        target_dir,
        max_model_len=64,
        max_num_seqs=1024,
        max_num_batched_tokens=8192,
        speculative_config=spec,
        tensor_parallel_size=tensor_parallel_size,
        **engine_args,
    )
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    # Greedy requests on other prompts ride in the same batches and must come out as plain greedy does.
    mixed = GREEDY_PROMPTS * 20 + [PROMPT] * num_samples
    try:
        outs = llm.generate(mixed, [greedy] * (len(mixed) - num_samples) + [params] * num_samples)
    finally:
        llm.engine.close()  # tensor-parallel workers
    plain = LLM(target_dir, max_model_len=64, **engine_args).generate(GREEDY_PROMPTS, greedy)
    assert [o.outputs[0].token_ids for o in outs[: len(GREEDY_PROMPTS)]] == [
        o.outputs[0].token_ids for o in plain
    ]
    counts: dict[tuple[int, ...], int] = {}
    for o in outs[len(mixed) - num_samples :]:
        key = tuple(o.outputs[0].token_ids[:length])
        counts[key] = counts.get(key, 0) + 1
    stats_ = llm.engine.spec_stats
    if spec.get("verify_policy", "fixed") != "fixed":  # the planner chose different lengths
        assert len({sum(r.budgets) / len(r.budgets) for r in llm.engine.speculator.step_log}) > 3
    assert len(stats_.accepted_per_position) == 3  # drafts at positions 1..3 were verified
    assert 0.05 < stats_.acceptance_rate < 0.95, stats_  # the drafter is poor, not useless
    assert min(stats_.accepted_per_position) >= 20, stats_  # and every position accepts sometimes
    return counts


def chi_square_pvalue(counts: dict, exact: dict, n: int) -> float:
    """Pearson chi-square, with cells of expected count < 5 pooled into one."""
    observed, expected, pooled_obs, pooled_exp = [], [], 0, 0.0
    for key in set(exact) | set(counts):
        e = exact.get(key, 0.0) * n
        if e < 5:
            pooled_obs += counts.get(key, 0)
            pooled_exp += e
        else:
            observed.append(counts.get(key, 0))
            expected.append(e)
    if pooled_exp > 0:
        observed.append(pooled_obs)
        expected.append(pooled_exp)
    elif pooled_obs:
        return 0.0  # tokens the target can never produce were sampled
    scale = sum(observed) / sum(expected)  # float rounding: scipy wants equal totals
    return stats.chisquare(observed, [e * scale for e in expected]).pvalue


# max_tokens 5: after the prefill token, one round verifies 3 drafts; x1..x3 are compared.
CASES = {
    "temperature_1": SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True),
    "temperature_0.7_top_p_top_k": SamplingParams(
        temperature=0.7, top_p=0.9, top_k=5, max_tokens=5, ignore_eos=True
    ),
    # Token 8 is the target's likeliest first token; banning it and favouring others moves the whole joint.
    "temperature_1_logit_bias": SamplingParams(
        temperature=1.0, max_tokens=5, ignore_eos=True, logit_bias={8: -100, 2: 4.0, 13: 6.5}
    ),
}


@pytest.mark.parametrize(
    "drafter, case",
    [
        ("draft_model", "temperature_1"),
        ("draft_model", "temperature_0.7_top_p_top_k"),
        ("dspark_vanilla", "temperature_1"),
        ("dspark_rnn", "temperature_1"),
        ("dspark_gated_threshold", "temperature_0.7_top_p_top_k"),
        ("dflash", "temperature_1"),
        ("eagle3", "temperature_1"),
        ("dspark_scheduled", "temperature_1"),
        ("draft_model_scheduled", "temperature_1"),
        ("draft_model", "temperature_1_logit_bias"),
        ("dspark_async", "temperature_0.7_top_p_top_k"),
        ("speculators_dspark_pruned", "temperature_1"),
        ("speculators_dflash", "temperature_1"),
        ("speculators_dflash2", "temperature_1"),
    ],
)
def test_speculative_sampling_matches_the_target_distribution(drafter, case, models, drafters):
    reference, target_dir, _, _ = models
    params = CASES[case]
    exact = exact_joint(reference, params, 3)
    counts = sampled_joint(target_dir, drafters[drafter], params, 3, DRAFTER_SAMPLES)
    assert chi_square_pvalue(counts, exact, DRAFTER_SAMPLES) > 0.001


@pytest.mark.slow
@pytest.mark.parametrize("case", ["temperature_1", "temperature_0.7_top_p_top_k"])
def test_the_draft_model_matches_the_target_distribution_at_more_samples(case, models, drafters):
    """The reference cases with 2.5x the samples: a bias of 1/sqrt(2.5) the size is seen."""
    reference, target_dir, _, _ = models
    counts = sampled_joint(target_dir, drafters["draft_model"], CASES[case], 3, NUM_SAMPLES)
    assert chi_square_pvalue(counts, exact_joint(reference, CASES[case], 3), NUM_SAMPLES) > 0.001


def test_speculative_sampling_matches_the_target_distribution_at_tp2(models, drafters):
    """The target split over 2 gloo ranks (1 KV head, replicated; logits gathered over the vocabulary)."""
    reference, target_dir, _, _ = models
    params = CASES["temperature_1"]
    counts = sampled_joint(target_dir, drafters["dspark_vanilla"], params, 3, DRAFTER_SAMPLES, 2)
    assert chi_square_pvalue(counts, exact_joint(reference, params, 3), DRAFTER_SAMPLES) > 0.001


def test_a_sampler_without_the_residual_fails(models, drafters, monkeypatch):
    """Power check: resampling from p instead of max(p - q, 0) after a rejection is biased, and seen."""
    import specserve.spec_decode.rejection as rejection

    monkeypatch.setattr(rejection, "_residual_weights", lambda p, *args: p.clone())
    reference, target_dir, _, _ = models
    params = CASES["temperature_1"]
    exact = exact_joint(reference, params, 3)
    counts = sampled_joint(target_dir, drafters["dspark_vanilla"], params, 3, DRAFTER_SAMPLES)
    assert chi_square_pvalue(counts, exact, DRAFTER_SAMPLES) < 1e-6


def test_verifying_drafts_by_their_own_probability_fails(models, drafters, monkeypatch):
    """Power check of Appendix A on a real engine: a scheduled policy that reads q(d_j), which depends on
    d_j itself, as the draft model's confidence verifies a biased selection of drafts, and it shows."""
    from specserve.core.proposal import DraftProposal

    def own_probability(self):
        if self.probs is None:  # what keep_drafting reads carries the peaks only
            return self.confidences
        drafted = torch.tensor(self.token_ids, dtype=torch.long)
        return self.probs[torch.arange(len(drafted)), drafted]

    monkeypatch.setattr(DraftProposal, "slot_confidences", own_probability)
    reference, target_dir, _, _ = models
    params = CASES["temperature_1"]
    exact = exact_joint(reference, params, 3)
    counts = sampled_joint(target_dir, drafters["draft_model_scheduled"], params, 3, DRAFTER_SAMPLES)
    assert chi_square_pvalue(counts, exact, DRAFTER_SAMPLES) < 1e-6


def test_enumeration_is_a_distribution(models):
    reference = models[0]
    exact = exact_joint(reference, CASES["temperature_0.7_top_p_top_k"], 2)
    # Each row of target_probs is an fp32 distribution (sums to 1 within a few 1e-8, by the CPU's order).
    assert abs(sum(exact.values()) - 1.0) < 1e-6
    assert len(exact) == V**2 and set(exact) == set(itertools.product(range(V), repeat=2))
