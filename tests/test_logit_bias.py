"""logit_bias (OpenAI's): validated, added to every row a request samples from, verification rows included,
so greedy speculation still equals greedy decoding under it (its sampled distribution is checked against
the exact biased target in tests/test_lossless.py)."""

from __future__ import annotations

import httpx
import pytest

from specserve import LLM, SamplingParams, SpecserveError
from tests.server_harness import make_client
from tests.tiny_models import (
    HYBRID_ARCHS,
    build_reference,
    save_byte_tokenizer,
    save_tiny_chat_model,
    save_tiny_model,
    save_tiny_mtp,
)

pytestmark = pytest.mark.kernel_agnostic

PROMPTS = ["Answer:", "abcabcabc abcabc", "[1, 2, 3, 1, 2"]


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    return str(save_tiny_chat_model("qwen3", tmp_path_factory.mktemp("chat")))


@pytest.fixture(scope="module")
def other_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("other")
    build_reference("qwen3", seed=1).save_pretrained(directory)
    return str(save_byte_tokenizer(directory))


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, **kwargs)


def test_bad_logit_bias_is_a_clear_error(chat_dir):
    for bias, message in [
        ({5: 101}, "in \\[-100, 100\\], got 101"),
        ({5: float("nan")}, "got nan"),
        ({-1: 1.0}, "integers >= 0"),
        ({"5": 1.0}, "integers >= 0\\), got '5'"),
        ({5: True}, "got True"),
        ([5], "must be a dict"),
    ]:
        with pytest.raises(SpecserveError, match=message):
            SamplingParams(logit_bias=bias)
    llm = LLM(chat_dir, max_model_len=64)
    with pytest.raises(SpecserveError, match="outside the vocabulary"):
        llm.generate(["x"], SamplingParams(logit_bias={10**6: 1.0}))


def test_the_bias_moves_greedy_decoding(chat_dir):
    llm = LLM(chat_dir, max_model_len=128)
    plain = llm.generate(PROMPTS, greedy())[0].outputs[0].token_ids
    banned = llm.generate(PROMPTS, greedy(logit_bias={plain[0]: -100}))[0].outputs[0].token_ids
    assert banned[0] != plain[0]
    forced = llm.generate(PROMPTS, greedy(logit_bias={plain[3]: 100}))[0].outputs[0].token_ids
    assert set(forced) == {plain[3]}


@pytest.mark.parametrize("spec_name", ["ngram", "draft_model_self", "draft_model_other"])
def test_greedy_speculation_equals_greedy_decoding_under_a_bias(spec_name, chat_dir, other_dir):
    spec = {
        "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1},
        "draft_model_self": {"method": "draft_model", "model": chat_dir, "num_speculative_tokens": 3},
        "draft_model_other": {"method": "draft_model", "model": other_dir, "num_speculative_tokens": 3},
    }[spec_name]
    plain_llm = LLM(chat_dir, max_model_len=128)
    unbiased = [o.outputs[0].token_ids for o in plain_llm.generate(PROMPTS, greedy())]
    # Ban each prompt's two likeliest first picks and favour a token it would not choose: drafts that the
    # unbiased target would accept are now rejected in verification, unless the bias is applied there too.
    params = [greedy(logit_bias={out[0]: -100, out[1]: -100, (out[0] + 7) % 200: 3.5}) for out in unbiased]
    plain = [o.outputs[0].token_ids for o in plain_llm.generate(PROMPTS, params)]
    llm = LLM(chat_dir, max_model_len=128, speculative_config=spec)
    speculative = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    assert speculative == plain
    assert plain != unbiased
    assert llm.engine.spec_stats.num_drafts > 0


def test_the_server_maps_logit_bias(chat_dir):
    import openai

    from tests.server_harness import MODEL_NAME, running_server

    llm = LLM(chat_dir, max_model_len=128)
    first = llm.generate(["Answer:"], greedy())[0].outputs[0].token_ids[0]
    expected = llm.generate(["Answer:"], greedy(logit_bias={first: -100}))[0].outputs[0].token_ids
    with running_server(chat_dir, max_model_len=128) as srv:
        client = make_client(srv.url)
        ask = dict(model=MODEL_NAME, prompt="Answer:", max_tokens=24, temperature=0.0)
        reply = client.completions.create(
            logit_bias={str(first): -100},
            extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
            logprobs=0,
            **ask,
        )
        assert [int(t.removeprefix("token_id:")) for t in reply.choices[0].logprobs.tokens] == expected
        for bias, message in [({"x1": 5}, "logit_bias: keys must be token ids"), ({"5": 200}, "logit_bias")]:
            with pytest.raises(openai.BadRequestError, match=message):
                client.completions.create(logit_bias=bias, **ask)
        answer = httpx.post(f"{srv.url}/v1/completions", json={**ask, "logit_bias": {"5": "high"}})
        assert answer.status_code == 400 and "logit_bias" in answer.text


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory):
    return str(save_tiny_mtp(save_tiny_model(HYBRID_ARCHS[0], tmp_path_factory.mktemp("mtp"))))


@pytest.mark.parametrize(
    "drafter, transform",
    [
        ("draft_model_self", {"logit_bias": {ord("q"): 30.0}}),
        ("draft_model_self", {"structured_outputs": {"regex": "[a-e]{60}"}}),
        ("mtp", {"logit_bias": {7: 30.0}}),
    ],
)
def test_drafts_are_sampled_under_the_requests_transforms(drafter, transform, chat_dir, mtp_dir):
    # A drafter that is the target itself proposes what the target samples, once its drafts see the same
    # bias and mask as the target's rows: nearly every draft is accepted (unbiased, unmasked drafts of a
    # +30 bias or a 5-letter regex are nearly all rejected). The outputs are right either way.
    if drafter == "mtp":  # drafts from the target's own multi-token-prediction layer
        model, spec, prompt = mtp_dir, {"method": "mtp", "num_speculative_tokens": 3}, [[5, 6, 7, 8]]
    else:
        model, spec = chat_dir, {"method": "draft_model", "model": chat_dir, "num_speculative_tokens": 3}
        prompt = ["Answer:"]
    llm = LLM(model, max_model_len=128, speculative_config=spec)
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=40, ignore_eos=True, **transform)
    out = llm.generate(prompt, params)[0].outputs[0]
    if "logit_bias" in transform:
        assert set(out.token_ids) == set(transform["logit_bias"])
    else:
        assert set(out.text) <= set("abcde"), out.text
    stats = llm.engine.spec_stats
    assert stats.num_draft_tokens >= 20
    assert stats.num_accepted_tokens >= 0.9 * stats.num_draft_tokens, stats
