"""Speculative decoding in the engine: greedy equivalence with every drafter, stops inside accepted
drafts, metrics, and configuration errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specserve import LLM, SamplingParams, SpecserveError
from specserve.spec.drafters.ngram import lookup
from tests.tiny_models import VOCAB


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


SPEC_CONFIGS = {
    "ngram": lambda dirs: {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1},
    # The target itself as its own draft model: every draft is accepted (a strong check of bookkeeping).
    "draft_model_self": lambda dirs: {
        "method": "draft_model",
        "model": dirs("qwen3"),
        "num_speculative_tokens": 3,
    },
    # A different random model: drafts are mostly rejected.
    "draft_model_other": lambda dirs: {
        "method": "draft_model",
        "model": dirs("qwen2"),
        "num_speculative_tokens": 5,
    },
}


@pytest.mark.parametrize("name", list(SPEC_CONFIGS))
def test_greedy_speculation_equals_greedy_decoding(name, target_dir, reference, tiny_model_dir):
    prompts, expected = reference
    spec = SPEC_CONFIGS[name](lambda arch: str(tiny_model_dir(arch)))
    llm = LLM(target_dir, max_model_len=256, speculative_config=spec)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == expected
    stats = llm.engine.spec_stats
    assert stats.num_drafts > 0 and stats.num_draft_tokens >= stats.num_accepted_tokens
    if name == "draft_model_self":
        assert stats.num_accepted_tokens == stats.num_draft_tokens
    assert llm.engine.block_manager.num_used_blocks == 0


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
