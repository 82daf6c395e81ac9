"""Prompt logprobs (vLLM's `prompt_logprobs`) and the completions API's `echo`: every prompt token's raw
logprob equals a full forward of the model, with and without chunked prefill, past a warm prefix cache,
after preemption and under speculation; lm-eval's loglikelihood requests through the server."""

from __future__ import annotations

import httpx
import pytest
import torch

from specserve import LLM, SamplingParams, SpecserveError
from tests.server_harness import MODEL_NAME, chat_server_fixtures
from tests.test_engine import prompts
from tests.test_server import greedy
from tests.test_speculative import repetitive_prompts
from tests.tiny_models import build_reference, save_tiny_chat_model


def scoring(prompt_logprobs: int | None, max_tokens: int = 4) -> SamplingParams:
    return SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, prompt_logprobs=prompt_logprobs
    )


@torch.no_grad()
def reference_logprobs(model, prompt: list[int]) -> torch.Tensor:
    """[P, V] log_softmax of a full forward of the transformers model: row p scores prompt token p + 1."""
    return model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)


def assert_scores(prompt_logprobs, prompt: list[int], reference: torch.Tensor, k: int) -> None:
    """vLLM's shape: None, then per prompt token its own logprob first and the top k; values within 1e-4."""
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == len(prompt)
    for p, step in enumerate(prompt_logprobs[1:], start=1):
        assert next(iter(step)) == prompt[p]
        assert set(step) == {prompt[p], *reference[p - 1].topk(k).indices.tolist()}
        for token, logprob in step.items():
            assert logprob == pytest.approx(reference[p - 1, token].item(), abs=1e-4)


@pytest.mark.parametrize("max_num_batched_tokens", [2048, 7])
@pytest.mark.parametrize("arch", ["qwen3", "gemma4", "qwen3_5"])
def test_prompt_logprobs_equal_a_full_forward(arch, max_num_batched_tokens, tiny_model_dir):
    """Whole prompts and chunks of 7 (chunked prefill), per request its own k, beside a request that
    asks for none; Gemma 4's soft-capped logits and a hybrid (Qwen3.5) target included."""
    llm = LLM(str(tiny_model_dir(arch)), max_model_len=128, max_num_batched_tokens=max_num_batched_tokens)
    batch = prompts(4, seed=21)
    ks = [0, 1, 5, None]
    outs = llm.generate(batch, [scoring(k) for k in ks])
    model = build_reference(arch)
    for prompt, k, out in zip(batch, ks, outs):
        if k is None:
            assert out.prompt_logprobs is None
        else:
            assert_scores(out.prompt_logprobs, prompt, reference_logprobs(model, prompt), k)


def test_a_one_token_prompt_has_only_the_first_entry(tiny_model_dir):
    llm = LLM(str(tiny_model_dir("qwen3")), max_model_len=64)
    assert llm.generate([[7]], scoring(3))[0].prompt_logprobs == [None]


def test_a_request_with_prompt_logprobs_computes_its_prompt_but_publishes_it(tiny_model_dir):
    """Cached tokens have no logits: the request takes no cached block, yet caches its own for others."""
    llm = LLM(str(tiny_model_dir("qwen3")), max_model_len=128, block_size=4)
    shared = prompts(1, seed=23)[0] * 2
    warm = llm.generate([shared + [9, 9, 9]], scoring(None))[0]
    prompt = shared + [17, 18, 19, 20, 21]
    scored = llm.generate([prompt], scoring(2))[0]
    assert (warm.num_cached_tokens, scored.num_cached_tokens) == (0, 0)
    assert_scores(scored.prompt_logprobs, prompt, reference_logprobs(build_reference("qwen3"), prompt), 2)
    assert llm.generate([prompt], scoring(None))[0].num_cached_tokens == (len(prompt) - 1) // 4 * 4


def test_preempted_requests_score_each_prompt_token_once(tiny_model_dir):
    batch = prompts(6, seed=7)
    # 768 bytes of KV per token (see test_engine): 160 tokens, about two of these requests at a time.
    tight = LLM(str(tiny_model_dir("qwen3")), max_model_len=128, kv_cache_memory=160 * 768, block_size=4)
    outs = tight.generate(batch, scoring(1, max_tokens=64))
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    model = build_reference("qwen3")
    for prompt, out in zip(batch, outs):
        assert_scores(out.prompt_logprobs, prompt, reference_logprobs(model, prompt), 1)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_prompt_logprobs_do_not_depend_on_speculation(method, tiny_model_dir):
    """Prompts prefilled in chunks while earlier requests verify drafts: the same prompt logprobs."""
    spec = {
        "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1},
        "draft_model": {
            "method": "draft_model",
            "model": str(tiny_model_dir("qwen2")),
            "num_speculative_tokens": 3,
        },
    }[method]
    target, batch, params = str(tiny_model_dir("qwen3")), repetitive_prompts(6, seed=3), scoring(3, 24)
    plain = LLM(target, max_model_len=128, max_num_batched_tokens=16).generate(batch, params)
    speculative = LLM(target, max_model_len=128, max_num_batched_tokens=16, speculative_config=spec)
    outs = speculative.generate(batch, params)
    assert speculative.engine.spec_stats.num_drafts > 0
    # Each request's own counters (RequestOutput.spec_stats) add up to the engine's.
    assert (
        sum(o.spec_stats.num_accepted_tokens for o in outs)
        == speculative.engine.spec_stats.num_accepted_tokens
    )
    for a, b in zip(plain, outs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert b.prompt_logprobs[0] is None and len(a.prompt_logprobs) == len(b.prompt_logprobs)
        for step_a, step_b in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert list(step_a) == list(step_b)
            assert list(step_a.values()) == pytest.approx(list(step_b.values()), abs=1e-6)


@pytest.mark.parametrize("bad", [-1, 21, 1.5, "2"])
def test_prompt_logprobs_out_of_range_are_errors(bad):
    with pytest.raises(SpecserveError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=bad)


# ---- the server: echo ------------------------------------------------------------------------------------
model_dir, server, client, llm = chat_server_fixtures(lambda d: save_tiny_chat_model("qwen3", d), 256)


CONTEXT = "Question: what colour is the sky?\nAnswer:"
CONTINUATIONS = [" blue", " green", " a deep shade of red"]


def assert_offsets_follow_the_prompt(text: str, logprobs, num_prompt_tokens: int) -> None:
    """The echoed prompt's tokens lie in the text where text_offset says, and the completion's come after
    (a generated byte may be part of a character, with no text of its own yet)."""
    tokens, offsets = logprobs.tokens, logprobs.text_offset
    for token, offset in zip(tokens[:num_prompt_tokens], offsets):
        assert text[offset : offset + len(token)] == token
    assert offsets[num_prompt_tokens:][:1] in ([], [len("".join(tokens[:num_prompt_tokens]))])


@pytest.mark.parametrize("as_token_ids", [False, True])
def test_lm_eval_loglikelihood_requests(as_token_ids, client, llm):
    """lm-eval's multiple-choice shape: context + continuation, echo, logprobs 1, max_tokens 1; the summed
    continuation logprobs (token_logprobs[ctxlen:-1]) are the engine's own prompt logprobs."""
    tokenizer = llm.tokenizer
    context_len = len(tokenizer(CONTEXT).input_ids)
    texts = [CONTEXT + c for c in CONTINUATIONS]
    token_ids = [tokenizer(t).input_ids for t in texts]
    prompt = token_ids if as_token_ids else texts
    reply = client.completions.create(
        model=MODEL_NAME, prompt=prompt, echo=True, logprobs=1, max_tokens=1, **greedy()
    )
    expected = llm.generate(token_ids, scoring(1, max_tokens=1))
    for choice, ids, text, out in zip(reply.choices, token_ids, texts, expected):
        logprobs = choice.logprobs
        assert choice.text == text + out.outputs[0].text
        assert len(logprobs.tokens) == len(ids) + 1
        assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
        own = sum(step[t] for t, step in zip(ids[context_len:], out.prompt_logprobs[context_len:]))
        assert sum(logprobs.token_logprobs[context_len:-1]) == pytest.approx(own, abs=1e-4)
        for top, step in zip(logprobs.top_logprobs[1 : len(ids)], out.prompt_logprobs[1:]):
            # what lm-eval's is_greedy compares with the token's logprob
            assert max(top.values()) == pytest.approx(max(step.values()), abs=1e-4)
        assert_offsets_follow_the_prompt(choice.text, logprobs, len(ids))


def test_max_tokens_0_with_echo_gives_the_prompt_alone(client, server, llm):
    reply = client.completions.create(model=MODEL_NAME, prompt=CONTEXT, echo=True, logprobs=2, max_tokens=0)
    choice = reply.choices[0]
    prompt_ids = llm.tokenizer(CONTEXT).input_ids
    assert (choice.text, choice.finish_reason) == (CONTEXT, "length")
    assert len(choice.logprobs.tokens) == len(prompt_ids)
    assert_offsets_follow_the_prompt(choice.text, choice.logprobs, len(prompt_ids))
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(prompt_ids), 0)
    refused = httpx.post(f"{server.url}/v1/completions", json={"prompt": CONTEXT, "max_tokens": 0})
    assert refused.status_code == 400 and "echo" in refused.json()["error"]["message"]


def test_echo_without_logprobs_prepends_the_prompt(client):
    args = dict(model=MODEL_NAME, prompt=[72, 105, 33, 32], max_tokens=6, **greedy())
    plain = client.completions.create(**args)
    echoed = client.completions.create(echo=True, **args)
    assert echoed.choices[0].text == "Hi! " + plain.choices[0].text
    assert echoed.choices[0].logprobs is None


def test_an_echo_stream_sends_the_prompt_first(client, llm):
    args = dict(model=MODEL_NAME, prompt=CONTEXT, echo=True, logprobs=1, max_tokens=8, **greedy())
    full = client.completions.create(**args).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **args)]
    assert chunks[0].text.startswith(CONTEXT) and chunks[0].logprobs.token_logprobs[0] is None
    assert "".join(c.text for c in chunks) == full.text
    for column in ("tokens", "token_logprobs", "top_logprobs"):
        assert [v for c in chunks for v in getattr(c.logprobs, column)] == getattr(full.logprobs, column)
    # Past the prompt a stream's offsets count the text sent (a partial character is held back).
    assert_offsets_follow_the_prompt(full.text, chunks[0].logprobs, len(llm.tokenizer(CONTEXT).input_ids))
