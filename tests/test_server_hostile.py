"""The server against hostile constraints, tools and inputs (issue 56): grammar work runs on workers of its
own (never on the engine thread or the tokenizer pool) within size and time limits, is cancelled when its
client leaves, and the tokenizer's grammar view is built before the server is ready; every text a request
carries is checked as text, with a 400 naming the field; JSON schemas with $defs / $ref work wherever they
are embedded, and one that matches no value is a 400; prompts certain to exceed the context are refused
before they are tokenized in full; and an error no field caused says `param: null`."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import httpx
import jsonschema_rs
import openai
import pydantic
import pytest

import specserve.structured.grammar as grammar_module
from specserve.server.limits import ServerLimits
from tests.server_harness import MODEL_NAME, make_client, running_server, sse_payloads, wait_until
from tests.test_server_tools import HERMES_TEMPLATE, tiny_tool_model

pytestmark = pytest.mark.kernel_agnostic

MAX_MODEL_LEN = 1024
MAX_CONSTRAINT_BYTES = 4096
LIMITS = ServerLimits(max_constraint_bytes=MAX_CONSTRAINT_BYTES, grammar_compile_timeout_s=5.0)
MESSAGES = [{"role": "user", "content": "Ship it."}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_tool_model("qwen3", tmp_path_factory.mktemp("hermes"), HERMES_TEMPLATE)


@pytest.fixture(scope="module")
def server(model_dir):
    with running_server(model_dir, max_model_len=MAX_MODEL_LEN, limits=LIMITS) as srv:
        yield srv


def chat(server, timeout: float = 60, **body) -> httpx.Response:
    body = {"messages": MESSAGES, "max_tokens": 8, "temperature": 0.0, **body}
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=timeout)


def error_of(response: httpx.Response, status: int = 400) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


# ---- 1. grammar work on workers of its own ---------------------------------------------------------------
def test_the_grammar_view_of_the_tokenizer_is_built_before_the_server_is_ready(model_dir, monkeypatch):
    built = []
    from_tokenizer = grammar_module.llguidance.hf.from_tokenizer

    def recording(*args, **kwargs):
        built.append(threading.current_thread().name)
        return from_tokenizer(*args, **kwargs)

    monkeypatch.setattr(grammar_module.llguidance.hf, "from_tokenizer", recording)
    with running_server(model_dir, max_model_len=MAX_MODEL_LEN) as srv:
        assert len(built) == 1  # at start: the first constrained request finds it built
        reply = chat(srv, structured_outputs={"regex": "[a-z]+"})
        assert reply.status_code == 200, reply.text
        assert len(built) == 1


def blocking_grammar_source(monkeypatch, slow_regex: str) -> tuple[threading.Event, threading.Event, list]:
    """Makes compiling `slow_regex` wait for `release`; `entered` is set each time one starts. Returns
    (entered, release, the regexes whose compile started)."""
    source = grammar_module.grammar_source
    entered, release, started = threading.Event(), threading.Event(), []

    def slow(params, *args, **kwargs):
        started.append(params.regex)
        if params.regex == slow_regex:
            entered.set()
            assert release.wait(60)
        return source(params, *args, **kwargs)

    monkeypatch.setattr(grammar_module, "grammar_source", slow)
    return entered, release, started


def test_a_slow_constraint_holds_up_neither_a_stream_nor_other_requests(server, monkeypatch):
    entered, release, _ = blocking_grammar_source(monkeypatch, "slow[0-9]")
    body = {"prompt": [5, 6, 7], "max_tokens": 400, "ignore_eos": True, "stream": True}
    results: list[httpx.Response] = []

    def constrained() -> None:
        results.append(chat(server, structured_outputs={"regex": "slow[0-9]"}))

    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as stream:
        events = sse_payloads(stream.iter_lines())
        next(events)
        # As many slow compiles as there are tokenizer threads: on the tokenizer pool they would hold it all.
        senders = [threading.Thread(target=constrained) for _ in range(2)]
        for sender in senders:
            sender.start()
        try:
            assert entered.wait(30), "no compile started"
            for _ in range(5):
                assert next(events)["choices"][0]["text"] is not None  # the stream goes on
            plain = chat(server, timeout=30, ignore_eos=True)
            assert plain.status_code == 200 and plain.json()["usage"]["completion_tokens"] == 8
        finally:
            release.set()
            for sender in senders:
                sender.join(60)
    assert [r.status_code for r in results] == [200, 200], [r.text for r in results]


def test_a_compile_past_the_time_limit_is_a_400(model_dir, monkeypatch):
    _, release, _ = blocking_grammar_source(monkeypatch, "slow[0-9]")
    limits = ServerLimits(grammar_compile_timeout_s=0.5)
    try:
        with running_server(model_dir, max_model_len=MAX_MODEL_LEN, limits=limits) as srv:
            error = error_of(chat(srv, structured_outputs={"regex": "slow[0-9]"}))
            assert error["param"] == "structured_outputs.regex"
            assert "0.5 s" in error["message"] and "--grammar-compile-timeout" in error["message"]
    finally:
        release.set()


def test_a_client_that_leaves_cancels_its_compile(server, monkeypatch):
    entered, release, started = blocking_grammar_source(monkeypatch, "slow[0-9]")
    blockers = [
        threading.Thread(target=chat, args=(server,), kwargs={"structured_outputs": {"regex": "slow[0-9]"}})
    ]
    blockers.append(
        threading.Thread(target=chat, args=(server,), kwargs={"structured_outputs": {"regex": "slow[0-9]"}})
    )
    for blocker in blockers:
        blocker.start()
    try:
        wait_until(lambda: started.count("slow[0-9]") == 2, what="every grammar worker busy")
        with pytest.raises(httpx.ReadTimeout):  # waits behind them, then gives up and disconnects
            chat(server, timeout=0.5, structured_outputs={"regex": "gone[0-9]"})
        time.sleep(0.3)  # the server sees the disconnect
    finally:
        release.set()
        for blocker in blockers:
            blocker.join(60)
    assert chat(server, structured_outputs={"regex": "after[0-9]"}).status_code == 200
    assert "gone[0-9]" not in started  # dropped from the queue, never compiled
    assert "after[0-9]" in started


CHOICES = [f"choice number {i}" for i in range(400)]  # ~7.6 KB, past this server's 4 KiB


@pytest.mark.parametrize(
    "constraint, param",
    [
        ({"structured_outputs": {"choice": CHOICES}}, "structured_outputs.choice"),
        ({"structured_outputs": {"regex": "|".join(CHOICES)}}, "structured_outputs.regex"),
        ({"structured_outputs": {"json": {"enum": CHOICES}}}, "structured_outputs.json"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "e", "schema": {"enum": CHOICES}},
                }
            },
            "response_format.json_schema.schema",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {"type": "object", "properties": {"a": {"enum": CHOICES}}},
                        },
                    }
                ]
            },
            "tools.0.function.parameters",
        ),
    ],
)
def test_a_constraint_over_the_size_limit_is_a_400_before_any_compile(server, monkeypatch, constraint, param):
    _, _, started = blocking_grammar_source(monkeypatch, "never")
    error = error_of(chat(server, **constraint))
    assert error["param"] == param
    assert (
        f"{MAX_CONSTRAINT_BYTES} bytes" in error["message"] and "--max-constraint-bytes" in error["message"]
    )
    assert started == []


def test_compiler_errors_carry_no_panic_backtrace_or_parser_state():
    raw = (
        "panic: assertion failed: grammar.symbols.len() < u16::MAX as usize - 10\n<backtrace>\n"
        "   0: <unknown>\n   1: <unknown>\n"
    )
    message = grammar_module.compiler_error(raw)
    assert "panic" not in message and "backtrace" not in message and "<unknown>" not in message
    assert "too large or too complex" in message
    state = "lexer error: too many expressions constructed\n<state>\nTokens: ⟦⟧\n0 tokens, 0 bytes"
    assert grammar_module.compiler_error(state) == "lexer error: too many expressions constructed"


def test_a_grammar_that_would_overflow_a_threads_stack_compiles_on_the_workers(model_dir):
    # A chain of optional rules, each holding the next: llguidance recurses once per rule, and ~3,000
    # of them overflow an 8 MiB thread stack (a segmentation fault that took the whole server down).
    # 4,000 fit in the default size limit. In a process of its own, so a crash fails only this test.
    script = f"""
import sys
from specserve import LLM, SamplingParams
n = 4000
grammar = "start: a0\\n" + "\\n".join(f'a{{i}}:"x"a{{i + 1}}?' for i in range(n)) + f'\\na{{n}}:"z"'
assert len(grammar.encode()) <= 64 * 1024
llm = LLM({str(model_dir)!r}, max_model_len=64)
params = SamplingParams(max_tokens=8, temperature=0, structured_outputs={{"grammar": grammar}})
text = llm.generate(["hi"], params)[0].outputs[0].text
assert set(text) <= {{"x", "z"}} and text, text
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]


# ---- 2. every text is text --------------------------------------------------------------------------------
def tool(parameters: dict, name: str = "f") -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


# JSON bodies as text, so the lone surrogate travels as the escape "\ud800", as clients send it.
SURROGATES = [
    ('"structured_outputs": {"regex": "a\\ud800"}', "structured_outputs.regex"),
    ('"structured_outputs": {"choice": ["ok", "b\\udfff"]}', "structured_outputs.choice.1"),
    ('"structured_outputs": {"grammar": "start: \\"\\ud800\\""}', "structured_outputs.grammar"),
    ('"structured_outputs": {"json": {"enum": ["a\\ud800"]}}', "structured_outputs.json.enum.0"),
    ('"structured_outputs": {"json": {"properties": {"\\ud800": {}}}}', "structured_outputs.json.properties"),
    (
        '"response_format": {"type": "json_schema", '
        '"json_schema": {"name": "x", "schema": {"const": "\\ud800"}}}',
        "response_format.json_schema.schema.const",
    ),
    (
        '"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", '
        '"properties": {"a": {"description": "\\ud800"}}}}}]',
        "tools.0.function.parameters.properties.a.description",
    ),
    ('"logit_bias": {"\\ud800": 1}', "logit_bias"),
]


@pytest.mark.parametrize("fragment, param", SURROGATES)
def test_a_lone_surrogate_anywhere_is_a_400_naming_its_field(server, fragment, param):
    body = '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, ' + fragment + "}"
    response = httpx.post(
        f"{server.url}/v1/chat/completions", content=body, headers={"Content-Type": "application/json"}
    )
    error = error_of(response)
    assert error["param"] == param, error
    assert error["message"].startswith(f"{param}: ") and "surrogate" in error["message"], error
    assert response.headers.get("Connection") != "close"


# ---- 3. JSON schemas as users write them ------------------------------------------------------------------
class Address(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=5)


class Shipment(pydantic.BaseModel):
    to: Address
    back: Address | None = None


SHIPMENT_TOOL = openai.pydantic_function_tool(Shipment)  # $defs / $ref, as the official client writes them
SHIPMENT_SCHEMA = SHIPMENT_TOOL["function"]["parameters"]


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "Shipment"}}])
def test_forced_calls_follow_parameters_with_references(server, tool_choice):
    client = make_client(server.url)
    reply = client.chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        tools=[SHIPMENT_TOOL],
        tool_choice=tool_choice,
        max_tokens=200,
        temperature=0.0,
        extra_body={"ignore_eos": False},
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    [call] = choice.message.tool_calls
    assert call.function.name == "Shipment"
    jsonschema_rs.validate(SHIPMENT_SCHEMA, json.loads(call.function.arguments))


TREE = {
    "type": "object",
    "properties": {
        "v": {"type": "integer", "maximum": 9},
        "kids": {"type": "array", "items": {"$ref": "#"}, "maxItems": 2},
    },
    "required": ["v"],
    "additionalProperties": False,
}


def test_a_finite_recursive_schema_constrains_the_output(server):
    reply = chat(server, max_tokens=200, structured_outputs={"json": TREE, "disable_any_whitespace": True})
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    if choice["finish_reason"] == "stop":
        jsonschema_rs.validate(TREE, json.loads(choice["message"]["content"]))
    else:  # cut off at max_tokens: still a prefix of a valid value, never free text
        assert choice["message"]["content"].startswith("{")


ENDLESS = {"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]}


@pytest.mark.parametrize(
    "body, param",
    [
        ({"structured_outputs": {"json": {"$ref": "#"}}}, "structured_outputs.json"),
        ({"structured_outputs": {"json": ENDLESS}}, "structured_outputs.json"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"$ref": "#"}},
                }
            },
            "response_format.json_schema.schema",
        ),
        (
            {
                "tools": [
                    tool(
                        {"type": "object", "properties": {"a": {"$ref": "#/properties/a"}}, "required": ["a"]}
                    )
                ]
            },
            "tools.0.function.parameters",
        ),
        ({"tools": [tool(ENDLESS)], "tool_choice": "required"}, "tools.0.function.parameters"),
    ],
)
def test_a_schema_that_matches_no_value_is_a_400(server, body, param):
    error = error_of(chat(server, **body))
    assert error["param"] == param and "no JSON value" in error["message"], error


# ---- 4. large inputs refused early ------------------------------------------------------------------------
@pytest.fixture
def tokenized_lengths(server, monkeypatch):
    """The length of every text the server's tokenizer is asked to encode."""
    tokenizer = server.engine.tokenizer
    lengths: list[int] = []
    call = type(tokenizer).__call__

    def recording(self, text=None, *args, **kwargs):
        if isinstance(text, str):
            lengths.append(len(text))
        return call(self, text, *args, **kwargs)

    monkeypatch.setattr(type(tokenizer), "__call__", recording)
    return lengths


@pytest.mark.parametrize("path", ["completions", "chat/completions"])
def test_a_prompt_certain_to_exceed_the_context_is_refused_before_it_is_tokenized(
    server, tokenized_lengths, path
):
    text = "lorem ipsum dolor sit amet " * 40_000  # ~1 MB: a thousand times the context
    body = {"prompt": text} if path == "completions" else {"messages": [{"role": "user", "content": text}]}
    error = error_of(httpx.post(f"{server.url}/v1/{path}", json=body, timeout=60))
    assert f"max_model_len is {MAX_MODEL_LEN}" in error["message"]
    assert error["param"] == ("prompt" if path == "completions" else "messages")
    assert max(tokenized_lengths, default=0) < 100 * MAX_MODEL_LEN  # a bounded prefix at most
    # A prompt just over the context is still counted exactly.
    body = {"prompt": "x" * (MAX_MODEL_LEN + 5)}
    error = error_of(httpx.post(f"{server.url}/v1/completions", json=body))
    assert f"the prompt has {MAX_MODEL_LEN + 5} tokens" in error["message"]


# ---- 6. OpenAI's error shape -------------------------------------------------------------------------------
def test_malformed_json_names_no_field(server):
    response = httpx.post(
        f"{server.url}/v1/chat/completions",
        content=b'{"messages": [}',
        headers={"Content-Type": "application/json"},
    )
    error = error_of(response)
    assert error["param"] is None and "not valid JSON" in error["message"], error
