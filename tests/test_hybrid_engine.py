"""Hybrid targets (Qwen3.5, Qwen3.5-MoE, Qwen3-Next: Gated DeltaNet + gated attention) through the whole
engine: plain greedy equals transformers; greedy speculation equals plain greedy for every drafter, with
drafts accepted and rejected (the recurrent state is rolled back to the accepted prefix); batch
invariance, preemption, a drafted and a plain request in one batch; sampled speculation follows the
target's distribution."""

from __future__ import annotations

import pytest
import torch
import transformers

from specserve import LLM, SamplingParams, SpecserveError
from specserve.spec_decode.cost_profile import CostProfile
from specserve.worker.model_runner import state_bytes_per_slot
from tests import test_lossless as lossless
from tests.test_profiler import serve_until_profiled
from tests.test_speculative import repetitive_prompts
from tests.tiny_models import HYBRID_ARCHS, build_reference, save_tiny_drafter, save_tiny_model, save_tiny_mtp

GREEDY = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)


@pytest.fixture(scope="module")
def hybrid_dirs(tmp_path_factory):
    """arch -> a saved tiny hybrid model (seed 0) with a random MTP layer, and "other" -> a different random
    Qwen3.5 (without one)."""
    dirs = {
        arch: str(save_tiny_mtp(save_tiny_model(arch, tmp_path_factory.mktemp(arch))))
        for arch in HYBRID_ARCHS
    }
    other = build_reference("qwen3_5", seed=1)
    other.save_pretrained(path := tmp_path_factory.mktemp("other"))
    dirs["other"] = str(path)
    return dirs


@pytest.fixture(scope="module")
def prompts():
    return repetitive_prompts(4, seed=3)


@pytest.fixture(scope="module")
def plain(hybrid_dirs, prompts):
    """arch -> plain greedy outputs of the engine."""
    return {
        arch: [
            o.outputs[0].token_ids
            for o in LLM(hybrid_dirs[arch], max_model_len=256).generate(prompts, GREEDY)
        ]
        for arch in HYBRID_ARCHS
    }


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_plain_greedy_equals_transformers(arch, hybrid_dirs, prompts, plain):
    reference = transformers.AutoModelForCausalLM.from_pretrained(hybrid_dirs[arch], dtype=torch.float32)
    for prompt, ours in zip(prompts, plain[arch]):
        out = reference.generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False)
        assert out[0, len(prompt) :].tolist() == ours


def drafter_configs(dirs, arch, tmp_path_factory) -> dict[str, dict]:
    target = dirs[arch]
    # A draft step costs a tenth of a target step: the load-aware policies draft.
    cheap = CostProfile([1, 2048], [1.0, 3.0], draft_requests=[1, 64], draft_s=[0.1, 0.1])
    cheap = str(cheap.save(tmp_path_factory.mktemp("cost") / "cheap.json"))

    def checkpoint(name, **config):
        directory = tmp_path_factory.mktemp(f"{arch}_{name}")
        return str(save_tiny_drafter(target, directory, std=0.2, **config))

    # Hidden-state drafters read a linear-attention layer (0) and the full-attention layer (1).
    taps = dict(target_layer_ids=[0, 1])
    return {
        "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1},
        "draft_model_self": {"method": "draft_model", "model": target, "num_speculative_tokens": 3},
        "draft_model_other": {"method": "draft_model", "model": dirs["other"], "num_speculative_tokens": 3},
        "dspark": {"method": "dspark", "model": checkpoint("dspark", **taps)},
        "dflash": {"method": "dflash", "model": checkpoint("dflash", markov_rank=0, confidence_head=False)},
        "eagle3": {"method": "eagle3", "model": checkpoint("eagle3", eagle3=True, ttt_length=3, **taps)},
        "mtp": {"method": "mtp"},
        "mtp_k3": {"method": "mtp", "num_speculative_tokens": 3},  # the layer applied recursively
        "mtp_dspark": {
            "method": "mtp",
            "num_speculative_tokens": 3,
            "verify_policy": "dspark",
            "cost_profile": cheap,
        },
        "mtp_threshold": {"method": "mtp", "verify_policy": "threshold", "confidence_threshold": 0.01},
        "dspark_async": {
            "method": "dspark",
            "model": checkpoint("dspark_async", **taps),
            "verify_policy": "dspark_async",
            "cost_profile": cheap,
        },
    }


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_greedy_speculation_equals_plain_greedy(arch, hybrid_dirs, prompts, plain, tmp_path_factory):
    for name, spec in drafter_configs(hybrid_dirs, arch, tmp_path_factory).items():
        llm = LLM(hybrid_dirs[arch], max_model_len=256, speculative_config=spec)
        outs = llm.generate(prompts, GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == plain[arch], name
        stats = llm.engine.spec_stats
        assert stats.num_drafts > 0, name
        if name == "draft_model_self":
            assert stats.num_accepted_tokens == stats.num_draft_tokens  # every draft accepted
        else:
            assert stats.num_accepted_tokens < stats.num_draft_tokens, name  # rejections rolled back
        assert llm.engine.block_manager.num_used_blocks == 0, name
        assert len(llm.engine.caches.states.free_slots) == llm.engine.config.max_num_seqs, name


def test_a_hybrid_draft_model_rolls_its_own_state_back(hybrid_dirs, prompts, plain):
    """A random Qwen3.5 drafting for Qwen3-Next: most drafts are rejected, so the draft model starts again
    from its committed slot nearly every round; a Qwen3 (attention-only) draft model for a hybrid target
    too."""
    for draft in (hybrid_dirs["other"], hybrid_dirs["qwen3_5"]):
        spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 4}
        llm = LLM(hybrid_dirs["qwen3_next"], max_model_len=256, speculative_config=spec)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == plain["qwen3_next"]
        drafter = llm.engine.speculator.drafter
        assert drafter.states == {} and len(drafter.slots.free_slots) == llm.engine.config.max_num_seqs


def test_batch_invariance_and_a_plain_request_beside_drafted_ones(hybrid_dirs, prompts, plain):
    """Each request alone equals the batch; a request that never drafts (max_tokens 1 leaves no room for a
    draft) rides beside drafted ones."""
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
    llm = LLM(hybrid_dirs["qwen3_5"], max_model_len=256, speculative_config=spec)
    for prompt, expected in zip(prompts, plain["qwen3_5"]):
        assert llm.generate([prompt], GREEDY)[0].outputs[0].token_ids == expected
    short = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    outs = llm.generate(prompts + prompts[:1], [GREEDY] * len(prompts) + [short])
    assert [o.outputs[0].token_ids for o in outs[:-1]] == plain["qwen3_5"]
    assert outs[-1].outputs[0].token_ids == plain["qwen3_5"][0][:1]


def test_preemption_recomputes_the_recurrent_state(hybrid_dirs, prompts, plain):
    """A KV budget for about two requests: the others are preempted, lose their state slot and restart
    from position 0 (a zero state) with the same output, speculating all along."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    # 1 full-attention layer x 2 (k, v) x 2 kv heads x 32 dims x 4 bytes = 512 bytes a token; plus the
    # recurrent states of max_num_seqs = 4 sequences.
    model = LLM(hybrid_dirs["qwen3_5"], max_model_len=128).engine.model
    states = 4 * state_bytes_per_slot(model, torch.float32)
    tight = LLM(
        hybrid_dirs["qwen3_5"],
        max_model_len=128,
        max_num_seqs=4,
        block_size=4,
        kv_cache_memory=states + 200 * 512,
        speculative_config=spec,
    )
    outs = tight.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == plain["qwen3_5"]
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    assert tight.engine.block_manager.num_used_blocks == 0
    assert len(tight.engine.caches.states.free_slots) == 4


# ---- sampled speculation on a hybrid target: the chi-square harness of test_lossless -------------------


def make_hybrid(directory, seed: int, logit_scale: float):
    torch.manual_seed(seed)
    config = transformers.Qwen3_5TextConfig(
        vocab_size=lossless.V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    model = transformers.Qwen3_5ForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2 if p.dim() == 1 else 0.3)
        model.lm_head.weight.mul_(logit_scale)  # peaked distributions, so that a wrong sampler shows
    model.save_pretrained(directory)
    return model


def test_the_cost_profile_is_measured_on_a_hybrid_target(hybrid_dirs, prompts, plain, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path))
    spec = {"method": "mtp", "num_speculative_tokens": 2, "verify_policy": "dspark"}
    llm = LLM(hybrid_dirs["qwen3_5"], max_model_len=256, max_num_seqs=4, speculative_config=spec)
    # measured between steps, slot 0's recurrent state put back each time: the outputs stay plain decoding's
    serve_until_profiled(llm, prompts, GREEDY, plain["qwen3_5"])
    profile = llm.engine.speculator.planner.profile
    assert all(t > 0 for t in profile.step_s) and all(t > 0 for t in profile.draft_s)


def test_mtp_needs_a_hybrid_checkpoint_with_its_layer(hybrid_dirs, tiny_model_dir):
    with pytest.raises(SpecserveError, match="Qwen3-Next / Qwen3.5"):
        LLM(str(tiny_model_dir("qwen3")), max_model_len=64, speculative_config={"method": "mtp"})
    with pytest.raises(SpecserveError, match="no mtp"):
        LLM(hybrid_dirs["other"], max_model_len=64, speculative_config={"method": "mtp"})
    with pytest.raises(SpecserveError, match="takes a Gemma 4 assistant"):
        LLM(hybrid_dirs["qwen3_5"], speculative_config={"method": "mtp", "model": hybrid_dirs["other"]})


@pytest.fixture(scope="module")
def hybrid_models(tmp_path_factory):
    target_dir, draft_dir = tmp_path_factory.mktemp("h_target"), tmp_path_factory.mktemp("h_draft")
    # The drafter is the target at a higher temperature: related, but often wrong.
    reference = make_hybrid(target_dir, 0, 3.0)
    make_hybrid(draft_dir, 0, 1.0)
    save_tiny_mtp(target_dir, output_scale=0.1)  # flat drafts: poor but not useless
    bigram = lossless.bigram_log_probs(reference) * 0.7
    dspark_dir = tmp_path_factory.mktemp("h_dspark")
    save_tiny_drafter(
        str(target_dir),
        dspark_dir,
        mask_token_id=lossless.V - 1,
        block_size=3,
        head_scale=0.02,
        markov_bias=bigram,
    )
    return (
        reference,
        str(target_dir),
        {
            "draft_model": {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": 3},
            "dspark": {"method": "dspark", "model": str(dspark_dir)},
            "mtp": {"method": "mtp", "num_speculative_tokens": 3},
        },
    )


@pytest.mark.parametrize("drafter", ["draft_model", "dspark", "mtp"])
def test_sampled_speculation_on_a_hybrid_target_matches_its_distribution(drafter, hybrid_models):
    reference, target_dir, drafters = hybrid_models
    params = lossless.CASES["temperature_1"]
    exact = lossless.exact_joint(reference, params, 3)
    counts = lossless.sampled_joint(target_dir, drafters[drafter], params, 3, lossless.DRAFTER_SAMPLES)
    assert lossless.chi_square_pvalue(counts, exact, lossless.DRAFTER_SAMPLES) > 0.001
