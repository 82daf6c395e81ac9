"""Gemma 4 assistants (method `mtp` with `model`): drafts match transformers' Gemma4AssistantForCausalLM fed
the target's own shared KV states (the centroid-narrowed vocabulary too), greedy speculation equals plain
greedy, sampling stays lossless (chi-square), and unfit assistants are refused naming the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from specserve import LLM, SamplingParams, SpecserveError
from specserve.spec_decode.cost_profile import CostProfile
from tests.test_speculative import repetitive_prompts
from tests.tiny_models import VOCAB, build_reference

# The tiny Gemma 4 target's geometry (tests/tiny_models.py): what an assistant's attention must match.
TARGET = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "global_head_dim": 32,
}


def save_assistant(directory, target: dict = TARGET, *, ordered: bool = False, seed: int = 0, **text) -> str:
    """A random Gemma 4 assistant for a target, saved by transformers (its own checkpoint layout)."""
    torch.manual_seed(seed)
    text_config = transformers.Gemma4TextConfig(
        **{
            "vocab_size": target["vocab_size"],
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": target["num_key_value_heads"],
            "head_dim": target["head_dim"],
            "global_head_dim": target["global_head_dim"],
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"],
            "hidden_size_per_layer_input": 0,
            "vocab_size_per_layer_input": 0,
            "max_position_embeddings": 512,
            **text,
        }
    )
    per_centroid = 16
    config = transformers.Gemma4AssistantConfig(
        text_config=text_config,
        backbone_hidden_size=target["hidden_size"],
        use_ordered_embeddings=ordered,
        num_centroids=target["vocab_size"] // per_centroid,
        centroid_intermediate_top_k=4,
    )
    model = transformers.Gemma4AssistantForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2 if p.dim() == 1 else 0.1)
        if ordered:
            model.masked_embedding.token_ordering.copy_(torch.randperm(target["vocab_size"]))
    model.save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="module")
def gemma(tiny_model_dir, tmp_path_factory):
    target_dir = str(tiny_model_dir("gemma4"))
    reference = build_reference("gemma4")  # the saved tiny target's weights
    assistants = {
        kind: save_assistant(tmp_path_factory.mktemp(kind), ordered=kind == "ordered")
        for kind in ("plain", "ordered")
    }
    return target_dir, reference, assistants


@torch.no_grad()
def reference_steps(reference, assistant_dir, tokens: list[int], drafts: list[int]) -> list[torch.Tensor]:
    """transformers' logits of each draft step after `tokens` (the anchor last), fed `drafts`: its assisted
    decoding's first round after a prefill (KV and hidden states of the tokens before the anchor)."""
    assistant = transformers.Gemma4AssistantForCausalLM.from_pretrained(assistant_dir).eval()
    a = len(tokens) - 1
    out = reference(
        torch.tensor([tokens[:a]]), output_hidden_states=True, return_shared_kv_states=True, use_cache=False
    )
    hidden, logits = out.hidden_states[-1][:, -1:], []
    for token in [tokens[a], *drafts]:
        embeds = reference.model.embed_tokens(torch.tensor([[token]]))
        step = assistant(
            inputs_embeds=torch.cat([embeds, hidden], -1),
            position_ids=torch.tensor([[a]]),
            shared_kv_states=out.shared_kv_states,
        )
        logits.append(step.logits[0, 0])
        hidden = step.last_hidden_state
    return logits


def recorded_proposals(llm) -> list:
    drafter, calls = llm.engine.speculator.drafter, []
    real = drafter.propose

    def propose(seqs, num_tokens, keep_drafting=None):
        out = real(seqs, num_tokens, keep_drafting)
        calls.extend((list(s.all_token_ids), p) for s, p in zip(seqs, out) if p.token_ids)
        return out

    drafter.propose = propose
    return calls


ON_CUDA = pytest.param(
    "cuda",
    marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")],
)


@pytest.mark.parametrize("device", ["cpu", ON_CUDA])
@pytest.mark.parametrize("kind", ["plain", "ordered"])
def test_drafts_match_transformers(kind, device, gemma):
    """A prompt longer than the sliding window; q of each draft step (temperature 1: the softmax of the
    assistant's logits) against transformers' assistant on the target's shared KV states. The centroid
    vocabulary: q is 0 off the selected tokens, transformers' logits there are a floor. On CUDA too: the
    assistant beside the target on the GPU, reading its caches through the Triton kernel."""
    target_dir, reference, assistants = gemma
    llm = LLM(
        target_dir,
        device=device,
        dtype="float32",
        max_model_len=128,
        speculative_config={"method": "mtp", "model": assistants[kind], "num_speculative_tokens": 3},
    )
    calls = recorded_proposals(llm)
    prompt = torch.randint(3, VOCAB, (20,), generator=torch.Generator().manual_seed(1)).tolist()
    llm.generate([prompt], SamplingParams(temperature=1.0, max_tokens=2, seed=3, ignore_eos=True))
    tokens, proposal = calls[0]
    assert len(tokens) == 21 and len(proposal.token_ids) == 3
    expected = reference_steps(reference, assistants[kind], tokens, proposal.token_ids[:-1])
    for q, logits in zip(proposal.probs.cpu(), expected):
        support = q.nonzero().flatten()
        if kind == "ordered":
            assert len(support) == 4 * 16  # the tokens of the top 4 centroids
            assert (logits[support].min() > logits.min()) or len(support) == VOCAB
        else:
            assert len(support) == VOCAB
        torch.testing.assert_close(q[support], logits[support].float().softmax(-1), atol=1e-5, rtol=1e-4)


def test_greedy_speculation_equals_greedy_decoding(gemma, tmp_path):
    target_dir, _, assistants = gemma
    prompts = repetitive_prompts(4, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in LLM(target_dir, max_model_len=128).generate(prompts, params)]
    # A load-aware policy too, on the assistant's peak-probability confidences (drafting priced cheap).
    profile = CostProfile([1, 2048], [1.0, 3.0], draft_requests=[1, 64], draft_s=[0.5, 0.5])
    scheduled = {"verify_policy": "dspark", "cost_profile": str(profile.save(tmp_path / "cost.json"))}
    for kind, policy in (("plain", {}), ("ordered", {}), ("plain", scheduled)):
        spec = {"method": "mtp", "model": assistants[kind], "num_speculative_tokens": 3, **policy}
        llm = LLM(target_dir, max_model_len=128, speculative_config=spec)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected, kind
        assert llm.engine.spec_stats.num_drafts > 0


@pytest.mark.parametrize(
    "change, match",
    [
        ({"model_type": "gemma3"}, "Gemma 4 assistant"),
        ({"backbone_hidden_size": 48}, "backbone_hidden_size is 48"),
        ({"text_config.vocab_size": 300}, "text_config.vocab_size is 300"),
        ({"text_config.num_key_value_heads": 1}, "KV heads"),
    ],
)
def test_unfit_assistants_are_refused(change, match, gemma, tmp_path):
    target_dir, _, assistants = gemma
    raw = json.loads((Path(assistants["plain"]) / "config.json").read_text())
    for key, value in change.items():
        node, _, leaf = key.rpartition(".")
        (raw[node] if node else raw)[leaf] = value
    (tmp_path / "config.json").write_text(json.dumps(raw))
    (tmp_path / "model.safetensors").symlink_to(f"{assistants['plain']}/model.safetensors")
    with pytest.raises(SpecserveError, match=match):
        LLM(target_dir, max_model_len=64, speculative_config={"method": "mtp", "model": str(tmp_path)})


def test_an_assistant_needs_a_gemma4_target(gemma, tiny_model_dir):
    _, _, assistants = gemma
    with pytest.raises(SpecserveError, match="Gemma 4 target"):
        LLM(
            str(tiny_model_dir("qwen3")),
            max_model_len=64,
            speculative_config={"method": "mtp", "model": assistants["plain"]},
        )


def test_assistant_sampling_matches_the_target_distribution(tmp_path):
    """Chi-square over the first three sampled tokens with a poor assistant (a flattened tied head) on a
    peaked 16-token Gemma 4 target: the engine's output follows the target's exact distribution."""
    from tests.test_lossless import CASES, DRAFTER_SAMPLES, V, chi_square_pvalue, exact_joint, sampled_joint

    torch.manual_seed(0)
    geometry = {
        "vocab_size": V,
        "hidden_size": 32,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "global_head_dim": 16,
    }
    config = transformers.Gemma4TextConfig(
        **{k: v for k, v in geometry.items()},
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
        hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=0,
        max_position_embeddings=64,
        final_logit_softcapping=None,
        tie_word_embeddings=False,
    )
    reference = transformers.Gemma4ForCausalLM(config).eval()
    with torch.no_grad():
        for p in reference.parameters():
            p.normal_(0.0, 0.2 if p.dim() == 1 else 0.1)
        reference.lm_head.weight.mul_(20.0)  # peaked distributions, so that a wrong sampler shows
    reference.save_pretrained(tmp_path / "target")
    assistant = save_assistant(tmp_path / "assistant", geometry, sliding_window=4)
    model = transformers.Gemma4AssistantForCausalLM.from_pretrained(assistant)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(0.05)  # the tied head: flat drafts, poor but not useless
    model.save_pretrained(assistant)
    params = CASES["temperature_1"]
    spec = {"method": "mtp", "model": assistant, "num_speculative_tokens": 3}
    counts = sampled_joint(str(tmp_path / "target"), spec, params, 3, DRAFTER_SAMPLES)
    assert chi_square_pvalue(counts, exact_joint(reference, params, 3), DRAFTER_SAMPLES) > 0.001
