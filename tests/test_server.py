"""The OpenAI-compatible server through the official `openai` client: chat and completions, streaming and
not, usage, stop strings, seeds, `n`, logprobs, metrics; and the errors: bad input (400), unknown model
(404), API key (401), the queue bound (429), an engine failure inside one request (500)."""

from __future__ import annotations

import httpx
import openai
import pytest

from specserve import SamplingParams
from tests.server_harness import (
    MODEL_NAME,
    chat_server_fixtures,
    make_client,
    running_server,
    sse_payloads,
    wait_until,
)
from tests.tiny_models import CHAT_TEMPLATE, VOCAB, save_tiny_chat_model, save_tiny_model

pytestmark = pytest.mark.kernel_agnostic

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]


def greedy(**extra) -> dict:
    """Arguments for greedy decoding that runs to max_tokens (random tiny models hit EOS early)."""
    return {"temperature": 0.0, "extra_body": {"ignore_eos": True, **extra}}


def engine_greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


model_dir, server, client, llm = chat_server_fixtures(lambda d: save_tiny_chat_model("qwen3", d), 256)


def test_models_and_health(client, server):
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}


def test_a_model_is_retrieved_by_its_name(client):
    assert client.models.retrieve(MODEL_NAME) == client.models.list().data[0]
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client.models.retrieve("gpt-17")


def test_chat_matches_the_engine_and_reports_usage(client, llm):
    reply = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=12, **greedy())
    expected = llm.chat(MESSAGES, engine_greedy(12))[0]
    choice = reply.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == expected.outputs[0].text
    assert choice.finish_reason == "length"
    prompt_tokens = len(expected.prompt_token_ids)
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (prompt_tokens, 12)
    assert reply.usage.total_tokens == prompt_tokens + 12


def test_chat_stream_carries_the_same_text_then_usage(client):
    full = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=12, **greedy()
    )
    chunks = list(
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=MESSAGES,
            max_completion_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
            **greedy(),
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        "length"
    ]
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_of_several_prompts_with_n(client, llm):
    prompts = ["The sky is", "Once upon a time"]
    reply = client.completions.create(model=MODEL_NAME, prompt=prompts, n=2, max_tokens=8, **greedy())
    expected = llm.generate(prompts, engine_greedy(8))
    texts = [o.outputs[0].text for o in expected]
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    # Choice i * n + j is prompt i's j-th sample; greedy samples of one prompt agree.
    assert [c.text for c in reply.choices] == [texts[0], texts[0], texts[1], texts[1]]
    assert reply.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in expected)  # each prompt once
    assert reply.usage.completion_tokens == 4 * 8


def test_token_id_prompt_streams_the_same_text(client):
    prompt = [10, 20, 30, 40, 50]
    full = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=10, **greedy())
    chunks = list(
        client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=10, stream=True, **greedy())
    )
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert full.usage.prompt_tokens == len(prompt)


def test_stop_string_ends_the_text_just_before_it(client):
    base = client.completions.create(model=MODEL_NAME, prompt="The sky is", max_tokens=24, **greedy())
    text = base.choices[0].text
    # A stop string that first occurs past the start, so the cut text is not empty.
    stop = next(ch for i, ch in enumerate(text) if i > 0 and ch.isascii() and text.index(ch) == i)
    args = dict(model=MODEL_NAME, prompt="The sky is", max_tokens=24, stop=[stop], **greedy())
    reply = client.completions.create(**args)
    assert reply.choices[0].text == text[: text.index(stop)]
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.completion_tokens < 24
    streamed = list(client.completions.create(stream=True, **args))
    assert "".join(c.choices[0].text for c in streamed) == reply.choices[0].text
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_seeded_sampling_is_reproducible_and_n_takes_consecutive_seeds(client):
    def sample(seed: int, n: int = 1) -> list[str]:
        reply = client.chat.completions.create(
            model=MODEL_NAME,
            messages=MESSAGES,
            max_tokens=16,
            temperature=1.0,
            seed=seed,
            n=n,
            extra_body={"ignore_eos": True},
        )
        return [c.message.content for c in reply.choices]

    first = sample(7)
    assert sample(7) == first
    assert sample(8) != first
    assert sample(7, n=2) == first + sample(8)


def test_chat_logprobs_rank_the_alternatives(client):
    reply = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=6, logprobs=True, top_logprobs=3, **greedy()
    )
    content = reply.choices[0].logprobs.content
    assert len(content) == 6
    for entry in content:
        ranked = [t.logprob for t in entry.top_logprobs]
        assert len(ranked) == 3 and ranked == sorted(ranked, reverse=True)
        assert entry.logprob == pytest.approx(ranked[0])  # greedy took the likeliest token
        assert entry.bytes == list(entry.token.encode())


def test_completion_logprobs_name_the_generated_tokens(client, llm):
    reply = client.completions.create(
        model=MODEL_NAME, prompt="hi", max_tokens=6, logprobs=2, **greedy(return_tokens_as_token_ids=True)
    )
    expected = llm.generate("hi", engine_greedy(6, logprobs=2))[0].outputs[0]
    logprobs = reply.choices[0].logprobs
    assert logprobs.tokens == [f"token_id:{t}" for t in expected.token_ids]
    assert logprobs.token_logprobs == pytest.approx(
        [step[t] for t, step in zip(expected.token_ids, expected.logprobs)], abs=1e-4
    )
    assert [len(top) for top in logprobs.top_logprobs] == [2] * 6


def test_nulls_the_openai_types_allow_mean_the_defaults(client, server):
    # The official client sends `n=None` as `"n": null` (its types, and OpenAI's schema, allow it).
    schemas = httpx.get(f"{server.url}/openapi.json").json()["components"]["schemas"]
    assert schemas["ChatCompletionRequest"]["properties"]["n"]["type"] == ["integer", "null"]
    args = dict(model=MODEL_NAME, max_tokens=4, **greedy())
    nulls = dict(n=None, stream=None)
    chat = client.chat.completions.create(messages=MESSAGES, logprobs=None, **nulls, **args)
    assert chat.choices == client.chat.completions.create(messages=MESSAGES, **args).choices
    completion = client.completions.create(prompt="hi", echo=None, **nulls, **args)
    assert completion.choices == client.completions.create(prompt="hi", **args).choices
    # a field this server does not implement is taken as null only, and the schema says so
    assert schemas["DetokenizeRequest"]["additionalProperties"] == {"type": "null"}
    detokenize = f"{server.url}/detokenize"
    assert httpx.post(detokenize, json={"tokens": [104], "": None}).status_code == 200
    assert httpx.post(detokenize, json={"tokens": [104], "": 1}).status_code == 400


def test_unknown_model_is_a_404(client):
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client.completions.create(model="gpt-17", prompt="hi")


BAD_REQUESTS = [
    ("chat/completions", b'{"messages": [', "not valid JSON"),
    ("completions", b"[1, 2]", "JSON object"),
    ("completions", {}, "prompt"),
    ("completions", {"prompt": "hi", "temperature": "hot"}, "temperature"),
    ("completions", {"prompt": "hi", "temperature": 3}, "temperature"),
    ("completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("completions", {"prompt": "hi", "n": 0}, "n"),
    ("completions", {"prompt": "hi", "top_p": 0}, "top_p"),
    ("completions", {"prompt": "hi", "logprobs": 21}, "logprobs"),
    ("completions", {"prompt": "hi", "stop": [""]}, "stop"),
    ("completions", {"prompt": "hi", "seed": 2**64}, "seed"),
    ("completions", {"prompt": ""}, "prompt: String should have at least 1 character"),
    ("completions", {"prompt": [5, 999]}, "token ids"),
    ("completions", {"prompt": list(range(5, 250)) * 2}, "max_model_len"),
    ("chat/completions", {"messages": []}, "messages"),
    ("chat/completions", {"messages": [{"role": "user"}]}, "content"),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "role"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x" * 300}]}, "max_model_len"),
    ("chat/completions", {"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs"),
]


@pytest.mark.parametrize("path, body, names", BAD_REQUESTS)
def test_bad_input_is_a_400_that_names_the_problem(server, path, body, names):
    invalid_before = server.metric("specserve:requests_total", outcome="invalid")
    if isinstance(body, bytes):
        response = httpx.post(
            f"{server.url}/v1/{path}", content=body, headers={"Content-Type": "application/json"}
        )
    else:
        response = httpx.post(f"{server.url}/v1/{path}", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert names in error["message"]
    assert server.metric("specserve:requests_total", outcome="invalid") == invalid_before + 1


FIELD_ERRORS = [
    ("completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("completions", {"prompt": "hi", "logit_bias": {"a": 1}}, "logit_bias"),
    ("completions", {"prompt": "hi", "stop": ["a"] * 65}, "stop"),
    ("chat/completions", {"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs"),
    (
        "chat/completions",
        {"messages": MESSAGES, "response_format": {"type": "json_schema"}},
        "response_format.json_schema",
    ),
    ("completions", {"prompt": "hi", "stream": None, "stream_options": {}}, "stream_options"),
]


@pytest.mark.parametrize("path, body, param", FIELD_ERRORS)
def test_an_error_about_one_field_names_it_in_param(server, path, body, param):
    error = httpx.post(f"{server.url}/v1/{path}", json=body).json()["error"]
    assert error["param"] == param and error["message"].startswith(f"{param}: ")


# The engine's checks name their field too, as the request names it: chat's prompt is its messages.
ENGINE_FIELD_ERRORS = [
    ("completions", {"prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias"),
    ("completions", {"prompt": "hi", "logit_bias": {str(VOCAB): 1}}, "logit_bias"),
    ("chat/completions", {"messages": MESSAGES, "stop_token_ids": [VOCAB]}, "stop_token_ids"),
    ("completions", {"prompt": [5, VOCAB]}, "prompt"),
    ("completions", {"prompt": [5] * 256}, "prompt"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x" * 300}]}, "messages"),
    ("completions", {"prompt": [5] * 200, "max_tokens": 100}, "max_tokens"),
    ("chat/completions", {"messages": MESSAGES, "max_tokens": 250}, "max_tokens"),
    ("chat/completions", {"messages": MESSAGES, "max_completion_tokens": 250}, "max_completion_tokens"),
    (
        "completions",
        {"prompt": "hi", "structured_outputs": {"regex": "a", "choice": ["b"]}},
        "structured_outputs",
    ),
    ("completions", {"prompt": "hi", "structured_outputs": {"choice": []}}, "structured_outputs.choice"),
]


@pytest.mark.parametrize("path, body, param", ENGINE_FIELD_ERRORS)
def test_the_engines_checks_name_the_field_in_param(server, path, body, param):
    response = httpx.post(f"{server.url}/v1/{path}", json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


def test_stream_options_need_stream_and_a_null_is_as_absent(client):
    args = dict(model=MODEL_NAME, messages=MESSAGES, max_tokens=2)
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(stream_options={"include_usage": True}, **args)
    assert refused.value.status_code == 400 and refused.value.param == "stream_options"
    assert client.chat.completions.create(stream_options=None, **args).choices


def test_api_key_guards_the_v1_and_tokenizer_routes_only(model_dir):
    with running_server(model_dir, api_key="sesame", max_model_len=64) as srv:
        missing = httpx.post(f"{srv.url}/v1/completions", content=b"{not json")  # refused before parsing
        assert missing.status_code == 401
        assert missing.json()["error"]["type"] == "authentication_error"
        assert httpx.get(f"{srv.url}/health").status_code == 200
        with pytest.raises(openai.AuthenticationError):
            make_client(srv.url, api_key="wrong").models.list()
        reply = make_client(srv.url, api_key="sesame").completions.create(
            model=MODEL_NAME, prompt="hi", max_tokens=2, **greedy()
        )
        assert reply.usage.completion_tokens == 2
        # The tokenizer routes sit at the root, as vLLM's do, and take the key as lm-eval sends it.
        key = {"Authorization": "Bearer sesame"}
        assert httpx.post(f"{srv.url}/tokenize", json={"prompt": "hi"}).status_code == 401
        assert httpx.post(f"{srv.url}/detokenize", json={"tokens": [104]}).status_code == 401
        assert httpx.get(f"{srv.url}/tokenizer_info").status_code == 401
        assert httpx.post(f"{srv.url}/tokenize", json={"prompt": "hi"}, headers=key).json()["count"] == 2
        assert httpx.get(f"{srv.url}/tokenizer_info", headers=key).status_code == 200
        assert srv.metric("specserve:requests_total", outcome="unauthorized") == 5


def tokenize(server, **body) -> dict:
    response = httpx.post(f"{server.url}/tokenize", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_tokenize_gives_the_ids_completions_uses_and_detokenize_gives_the_text_back(client, server):
    text = "The sky is blue, and grass is green."
    answer = tokenize(server, model=MODEL_NAME, prompt=text)
    ids = answer["tokens"]
    assert answer == {"count": len(ids), "max_model_len": 256, "tokens": ids, "token_strs": None}
    echoed = client.completions.create(
        model=MODEL_NAME,
        prompt=text,
        max_tokens=0,
        echo=True,
        logprobs=0,
        **greedy(return_tokens_as_token_ids=True),
    )
    assert echoed.usage.prompt_tokens == len(ids)
    assert echoed.choices[0].logprobs.tokens == [f"token_id:{i}" for i in ids]
    detokenized = httpx.post(f"{server.url}/detokenize", json={"model": MODEL_NAME, "tokens": ids})
    assert detokenized.json() == {"prompt": text}
    strs = tokenize(server, prompt="hi", return_token_strs=True)["token_strs"]
    assert strs == ["h", "i"]


def test_tokenize_of_messages_gives_the_chat_prompt_tokens(client, server, llm):
    ids = tokenize(server, messages=MESSAGES)["tokens"]
    assert ids == llm.chat(MESSAGES, engine_greedy(1))[0].prompt_token_ids
    reply = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=1, **greedy())
    assert reply.usage.prompt_tokens == len(ids)
    without_turn = tokenize(server, messages=MESSAGES, add_generation_prompt=False)["tokens"]
    assert len(without_turn) < len(ids) and ids[: len(without_turn)] == without_turn


def test_tokenizer_info_carries_what_lm_eval_reads(server):
    info = httpx.get(f"{server.url}/tokenizer_info").json()
    assert info == {
        "tokenizer_class": type(server.engine.tokenizer).__name__,
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "chat_template": CHAT_TEMPLATE,
    }
    # lm-eval takes the EOS id as the first id of its text, tokenized without special tokens added.
    eos_ids = tokenize(server, prompt=info["eos_token"], add_special_tokens=False)["tokens"]
    assert eos_ids == [server.engine.tokenizer.eos_token_id]


BAD_TOKENIZER_REQUESTS = [
    ("tokenize", {"prompt": 5}, "prompt"),
    ("tokenize", {"prompt": "hi", "add_special_tokens": "yes"}, "add_special_tokens"),
    ("tokenize", {"prompt": "hi", "truncate_prompt_tokens": 2}, "truncate_prompt_tokens"),
    ("tokenize", {"messages": []}, "messages"),
    ("tokenize", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    ("detokenize", {"tokens": [5, 999]}, "tokens"),
    ("detokenize", {"tokens": [-1]}, "tokens.0"),
    ("detokenize", {}, "tokens"),
]


@pytest.mark.parametrize("path, body, param", BAD_TOKENIZER_REQUESTS)
def test_a_bad_tokenizer_request_is_a_400_naming_its_field(server, path, body, param):
    response = httpx.post(f"{server.url}/{path}", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param and error["message"].startswith(f"{param}: ")


@pytest.mark.parametrize(
    "body, names",
    [
        ({}, "one of prompt and messages"),
        ({"prompt": "hi", "messages": MESSAGES}, "one of prompt and messages"),
        ({"prompt": "hi", "add_generation_prompt": False}, "add_generation_prompt goes with messages"),
    ],
)
def test_tokenize_takes_a_prompt_or_messages(server, body, names):
    response = httpx.post(f"{server.url}/tokenize", json=body)
    assert response.status_code == 400 and names in response.json()["error"]["message"]


def test_tokenizer_routes_name_the_model_and_need_a_tokenizer(server, tmp_path):
    response = httpx.post(f"{server.url}/tokenize", json={"model": "gpt-17", "prompt": "hi"})
    assert response.status_code == 404 and "not served here" in response.json()["error"]["message"]
    with running_server(save_tiny_model("qwen3", tmp_path), max_model_len=64) as ids_only:
        for response in (
            httpx.get(f"{ids_only.url}/tokenizer_info"),
            httpx.post(f"{ids_only.url}/tokenize", json={"prompt": "hi"}),
            httpx.post(f"{ids_only.url}/detokenize", json={"tokens": [5]}),
        ):
            assert response.status_code == 404
            assert "no tokenizer" in response.json()["error"]["message"]


def test_queue_bound_answers_429_with_retry_after(model_dir):
    long_stream = {"prompt": "hi", "max_tokens": 400, "stream": True, "ignore_eos": True}
    short = {"prompt": "hi", "max_tokens": 2}
    # Room for one running request and one waiting.
    with running_server(model_dir, max_model_len=512, max_num_seqs=1, max_waiting=1) as srv:
        with httpx.Client(base_url=srv.url) as first, httpx.Client(base_url=srv.url) as second:
            with (
                first.stream("POST", "/v1/completions", json=long_stream),
                second.stream("POST", "/v1/completions", json=long_stream),
            ):
                refused = httpx.post(f"{srv.url}/v1/completions", json=short)
                assert refused.status_code == 429
                assert refused.headers["Retry-After"] == "1"
                assert refused.json()["error"]["type"] == "rate_limit_error"
        too_many = httpx.post(f"{srv.url}/v1/completions", json={**short, "n": 3})
        assert too_many.status_code == 400 and "at most 2" in too_many.json()["error"]["message"]
        # The two streams were closed, which gave their places back.
        wait_until(lambda: srv.metric("specserve:num_requests_running") == 0, what="streams aborted")
        assert httpx.post(f"{srv.url}/v1/completions", json=short).status_code == 200


def test_engine_failure_fails_that_request_only(model_dir):
    with running_server(model_dir, max_model_len=64) as srv:
        runner = srv.engine.runner
        forward = runner.forward

        def fail_once(*args, **kwargs):
            runner.forward = forward
            raise RuntimeError("injected fault")

        client = make_client(srv.url)
        runner.forward = fail_once
        with pytest.raises(openai.InternalServerError, match="injected fault"):
            client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=4)

        runner.forward = fail_once
        with httpx.stream(
            "POST", f"{srv.url}/v1/completions", json={"prompt": "hi", "max_tokens": 4, "stream": True}
        ) as response:
            assert response.status_code == 200  # the status went out before the failure
            events = list(sse_payloads(response.iter_lines()))
        assert "injected fault" in events[-2]["error"]["message"] and events[-1] == "[DONE]"

        reply = client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=4, **greedy())
        assert reply.usage.completion_tokens == 4
        assert srv.metric("specserve:requests_total", outcome="error") == 2
        assert srv.metric("specserve:kv_cache_used_blocks") == 0


def test_metrics_count_requests_tokens_latencies_and_speculation(model_dir):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    with running_server(model_dir, max_model_len=256, speculative_config=spec) as srv:
        reply = make_client(srv.url).completions.create(
            model=MODEL_NAME, prompt="abcabcabcabcabcabc", max_tokens=32, **greedy()
        )
        stats = srv.engine.spec_stats
        assert stats.num_drafts > 0
        expected = {
            ("specserve:requests_total", (("outcome", "completed"),)): 1,
            ("specserve:prompt_tokens_total", ()): reply.usage.prompt_tokens,
            ("specserve:generation_tokens_total", ()): 32,
            ("specserve:time_to_first_token_seconds_count", ()): 1,
            ("specserve:time_per_output_token_seconds_count", ()): 1,
            ("specserve:e2e_request_latency_seconds_count", ()): 1,
            ("specserve:num_requests_running", ()): 0,
            ("specserve:kv_cache_used_blocks", ()): 0,
            ("specserve:spec_decode_num_drafts_total", ()): stats.num_drafts,
            ("specserve:spec_decode_num_draft_tokens_total", ()): stats.num_draft_tokens,
            ("specserve:spec_decode_num_accepted_tokens_total", ()): stats.num_accepted_tokens,
        }
        expected |= {
            ("specserve:spec_decode_num_accepted_tokens_per_pos_total", (("position", str(i)),)): count
            for i, count in enumerate(stats.accepted_per_position)
        }
        # The engine thread publishes its gauges just after the step that finished the request.
        wait_until(
            lambda: {key: srv.metrics().get(key) for key in expected} == expected, what="metrics to settle"
        )


def test_per_request_spec_decode_metrics_count_the_choices_drafts(model_dir, client):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    args = dict(model=MODEL_NAME, prompt=["abcabcabcabcabcabc", "xyzxyzxyzxyz"], max_tokens=24, **greedy())
    with running_server(
        model_dir, max_model_len=256, speculative_config=spec, per_request_spec_decode_metrics=True
    ) as srv:
        spec_client = make_client(srv.url)
        usage = spec_client.completions.create(**args).usage.speculative_decoding
        stats = srv.engine.spec_stats  # of these two choices alone, so far
        assert stats.num_drafts > 0
        assert usage == {
            "num_drafts": stats.num_drafts,
            "num_draft_tokens": stats.num_draft_tokens,
            "num_accepted_tokens": stats.num_accepted_tokens,
            "num_accepted_tokens_per_pos": stats.accepted_per_position,
            "mean_acceptance_length": pytest.approx(stats.mean_acceptance_length),
        }
        chunks = list(
            spec_client.completions.create(stream=True, stream_options={"include_usage": True}, **args)
        )
        assert chunks[-1].usage.speculative_decoding == usage  # greedy: the same drafts again
    assert client.completions.create(**args).usage.speculative_decoding is None  # off unless asked


def test_metrics_expose_the_live_calibration_ece():
    from specserve.server.async_engine import EngineSnapshot
    from specserve.server.metrics import ServerMetrics

    text = ServerMetrics(lambda: EngineSnapshot(calibration_ece=[0.125, 0.25])).exposition().decode()
    assert 'specserve:spec_decode_calibration_ece{position="0"} 0.125' in text
    assert 'specserve:spec_decode_calibration_ece{position="1"} 0.25' in text


def test_a_ruled_out_tokens_logprob_is_finite_json():
    import json

    from specserve.server.logprobs import MIN_LOGPROB, TokenText, chat_logprobs, completion_logprobs

    steps = [{5: -0.1, 6: float("-inf")}, {6: float("-inf"), 5: -0.2}]
    chat = chat_logprobs(TokenText(None), [5, 6], steps, 2).model_dump_json()
    completion = completion_logprobs(TokenText(None), [5, 6], steps, 2, 0).model_dump(mode="json")
    assert "inf" not in chat.lower() and json.loads(chat)["content"][1]["logprob"] == MIN_LOGPROB
    assert completion["token_logprobs"] == [-0.1, MIN_LOGPROB]
    assert completion["top_logprobs"][0]["token_id:6"] == MIN_LOGPROB
    json.dumps(completion, allow_nan=False)
