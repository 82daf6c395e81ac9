"""Tool calling on the server, through the official `openai` client: calls forced by tool_choice
("required", a named function) follow the tool's parameters, "auto" parses what the model chose, a stream
carries the same calls as the full reply, and the errors name their field. The parser on fixed text (several
calls, text before them, bad JSON, any split of a stream), the prompts each family gets (Hermes-style
templates render the tools; Gemma 3 gets them in its system turn), and unknown request fields as 400s.
The slow tier asks the real Qwen2.5-Coder-0.5B-Instruct."""

from __future__ import annotations

import json

import httpx
import jsonschema_rs
import openai
import pytest

from specserve.server.generation import ChatGeneration
from specserve.server.protocol import ChatCompletionRequest
from specserve.server.tool_calls import GEMMA, HERMES, ToolCallParser, tool_format_of
from tests.server_harness import MODEL_NAME, make_client, running_server
from tests.tiny_models import save_tiny_chat_model

pytestmark = pytest.mark.kernel_agnostic

# A Hermes-style template of our own for the tiny byte-tokenizer model (Qwen2.5's writes calls the same way).
HERMES_TEMPLATE = """{%- if tools %}<|im_start|>system
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools><|im_end|>
{% endif %}
{%- for m in messages %}<|im_start|>{{ 'user' if m.role == 'tool' else m.role }}
{% if m.role == 'tool' %}<tool_response>
{{ m.content }}
</tool_response>{% else %}{{ m.content }}{% endif %}
{%- for call in m.tool_calls or [] %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

# Gemma 3's template as Google ships it (text parts only): no tools, strict user / model turns.
GEMMA3_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- set role = "model" if message['role'] == 'assistant' else message['role'] -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {{- message['content'] | trim }}
    {{- '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}"""

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 6},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
CLOCK = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "The forecast", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time", "parameters": CLOCK}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris for the next 3 days?"}]
NAMES = {"get_weather", "get_time"}


def tokenizer_of(directory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory)


def tiny_tool_model(arch: str, directory, template: str):
    """A tiny chat model with `template` and a 2048-token context: the byte tokenizer spends a token on
    every character of the tools' JSON."""
    save_tiny_chat_model(arch, directory)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 2048}))
    tokenizer = tokenizer_of(directory)
    tokenizer.chat_template = template
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def hermes_dir(tmp_path_factory):
    return tiny_tool_model("qwen3", tmp_path_factory.mktemp("hermes"), HERMES_TEMPLATE)


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory):
    return tiny_tool_model("gemma3", tmp_path_factory.mktemp("gemma"), GEMMA3_TEMPLATE)


@pytest.fixture(scope="module")
def server(hermes_dir):
    with running_server(hermes_dir, max_model_len=2048) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return make_client(server.url)


def ask(client, **kwargs):
    """A greedy chat request with the tools (the arguments override any of these)."""
    request = dict(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, temperature=0.0, max_tokens=120)
    return client.chat.completions.create(**{**request, **kwargs})


def check_calls(calls, names=NAMES) -> None:
    """Every call names one of `names` and its arguments follow that tool's parameters."""
    assert calls
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        assert call.function.name in names
        jsonschema_rs.validate(SCHEMAS[call.function.name], json.loads(call.function.arguments))


def streamed(client, **kwargs):
    """A streamed reply's content, its calls reassembled from their deltas, and its finish reasons."""
    chunks = list(ask(client, stream=True, **kwargs))
    content, calls, reasons = "", {}, []
    for chunk in chunks:
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or []:
            if delta.index not in calls:  # a call's first delta names it
                assert delta.id.startswith("call_") and delta.type == "function" and delta.function.name
                calls[delta.index] = {"name": delta.function.name, "arguments": ""}
            calls[delta.index]["arguments"] += delta.function.arguments or ""
        if choice.finish_reason:
            reasons.append(choice.finish_reason)
    return content, [calls[i] for i in sorted(calls)], reasons


# ---- the parser ------------------------------------------------------------------------------------------
TWO_CALLS = (
    "Let me look.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
)


def parse(text: str, fmt=HERMES, max_calls=None) -> tuple[str, list[tuple[str, dict]]]:
    content, calls = ToolCallParser(fmt, NAMES, max_calls).feed(text, final=True)
    return content, [(c.function.name, json.loads(c.function.arguments)) for c in calls]


def test_parser_finds_several_calls_and_the_text_before_them():
    assert parse(TWO_CALLS) == (
        "Let me look.",
        [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"zone": "CET"})],
    )
    assert parse(TWO_CALLS, max_calls=1)[1] == [("get_weather", {"city": "Paris", "days": 3})]
    assert parse(TWO_CALLS, max_calls=1)[0].endswith('"zone": "CET"}}\n</tool_call>')  # kept, not dropped
    gemma = 'Sure.\n```tool_code\n{"name": "get_time", "parameters": {"zone": "UTC"}}\n```'
    assert parse(gemma, fmt=GEMMA) == ("Sure.", [("get_time", {"zone": "UTC"})])


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"\n</tool_call>',  # bad JSON
        '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>',  # not one of the tools
        '<tool_call>\n{"name": "get_time", "arguments": "CET"}\n</tool_call>',  # arguments not an object
        '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}',  # cut off
        "no calls at all <tool_call",
    ],
)
def test_parser_leaves_what_is_not_a_call_as_content(text):
    assert parse(text) == (text, [])


@pytest.mark.parametrize("step", [1, 2, 5, 13])
def test_a_stream_splits_into_the_same_content_and_calls(step):
    text = TWO_CALLS + "\nDone. <tool_call>\n{bad}\n</tool_call>  "
    whole = parse(text)
    parser = ToolCallParser(HERMES, NAMES)
    pieces = [text[i : i + step] for i in range(0, len(text), step)]
    content, calls = "", []
    for k, piece in enumerate(pieces):
        more, new = parser.feed(piece, final=k == len(pieces) - 1)
        content += more  # a piece of a tag sent early would show here
        calls += [(c.function.name, json.loads(c.function.arguments)) for c in new]
    assert (content, calls) == whole


def test_a_stream_holds_back_what_may_begin_a_call():
    parser = ToolCallParser(HERMES, NAMES)
    assert parser.feed("Hello <tool") == ("Hello", [])
    assert parser.feed("box> ok") == (" <toolbox> ok", [])


# ---- formats and prompts ---------------------------------------------------------------------------------
def test_the_format_comes_from_the_template_and_family(hermes_dir, gemma_dir, tmp_path):
    assert tool_format_of(tokenizer_of(hermes_dir), "qwen3") is HERMES
    assert tool_format_of(tokenizer_of(gemma_dir), "gemma3_text") is GEMMA
    plain = save_tiny_chat_model("qwen3", tmp_path)  # a template that writes no tool calls
    assert tool_format_of(tokenizer_of(plain), "qwen3") is None


HISTORY = [
    {"role": "system", "content": "Be brief."},
    *MESSAGES,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    {"role": "user", "content": "And tomorrow?"},
]


def rendered(directory, fmt, **body) -> str:
    tokenizer = tokenizer_of(directory)
    request = ChatCompletionRequest.model_validate({"messages": HISTORY, "tools": TOOLS, **body})
    return ChatGeneration(request, "tiny", tokenizer, tool_format=fmt).rendered().text


def test_hermes_templates_render_the_tools_and_the_calls(hermes_dir):
    text = rendered(hermes_dir, HERMES)
    assert json.dumps(TOOLS[0]) in text  # the tool as the client sent it
    assert HERMES.block("get_weather", '{"city": "Paris", "days": 3}') in text  # arguments not re-quoted
    assert "<tool_response>\nsunny\n</tool_response>" in text
    # tool_choice "none" offers no tools: the model answers in text, as OpenAI promises.
    assert "<tools>" not in rendered(hermes_dir, HERMES, tool_choice="none")


def test_gemma_gets_the_tools_in_its_system_turn_and_the_calls_as_text(gemma_dir):
    text = rendered(gemma_dir, GEMMA)
    user = text.index("<start_of_turn>user\nBe brief.\n\nYou have access to functions.")
    assert '"name": "get_weather"' in text[user:]
    call = GEMMA.block("get_weather", '{"city": "Paris", "days": 3}')
    assert f"<start_of_turn>model\n{call}<end_of_turn>" in text
    # The tool's result and the user's next words share one user turn, as the template demands.
    assert "<start_of_turn>user\n```tool_output\nsunny\n```\n\nAnd tomorrow?<end_of_turn>" in text
    assert "You have access" not in rendered(gemma_dir, GEMMA, tool_choice="none")


def test_gemma_required_gives_a_tool_code_call(gemma_dir):
    with running_server(gemma_dir, max_model_len=2048) as srv:
        client = make_client(srv.url)
        reply = ask(client, tool_choice="required", parallel_tool_calls=False)
    assert reply.choices[0].finish_reason == "tool_calls"
    check_calls(reply.choices[0].message.tool_calls)


def test_a_conversation_the_template_refuses_is_a_400_naming_messages(gemma_dir):
    messages = [{"role": "assistant", "content": "hi"}]  # Gemma's template wants the user first
    with running_server(gemma_dir, max_model_len=256) as srv:
        for route in ("v1/chat/completions", "tokenize"):
            response = httpx.post(f"{srv.url}/{route}", json={"messages": messages})
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["param"] == "messages" and "roles must alternate" in error["message"], error


# ---- forced and free calls, streamed and not --------------------------------------------------------------
def test_required_calls_follow_the_parameters(client):
    # A random model never stops calling, so its last call is cut off and stays content.
    check_calls(ask(client, tool_choice="required").choices[0].message.tool_calls)


def test_parallel_tool_calls_false_gives_one_call(client):
    choice = ask(client, tool_choice="required", parallel_tool_calls=False).choices[0]
    assert len(choice.message.tool_calls) == 1 and choice.message.content is None
    assert choice.finish_reason == "tool_calls"
    check_calls(choice.message.tool_calls)


def test_a_reply_with_calls_goes_back_as_history(client):
    message = ask(client, tool_choice="required", parallel_tool_calls=False).choices[0].message
    result = {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "sunny"}
    reply = ask(client, messages=[*MESSAGES, message, result], max_tokens=4)  # the client's own object
    assert reply.choices[0].finish_reason == "length"


def test_a_named_function_is_the_one_called_once(client):
    reply = ask(client, tool_choice={"type": "function", "function": {"name": "get_time"}})
    calls = reply.choices[0].message.tool_calls
    assert len(calls) == 1 and reply.choices[0].finish_reason == "tool_calls"
    check_calls(calls, {"get_time"})


def test_a_forced_tool_without_parameters_takes_no_arguments(client):
    # OpenAI: "omitting parameters defines a function with an empty parameter list".
    ping = [{"type": "function", "function": {"name": "ping"}}]
    for choice in ["required", {"type": "function", "function": {"name": "ping"}}]:
        reply = ask(client, tools=ping, tool_choice=choice, parallel_tool_calls=False)
        assert [c.function.arguments for c in reply.choices[0].message.tool_calls] == ["{}"]


@pytest.mark.parametrize("parallel", [False, True])
def test_a_stream_carries_the_calls_of_the_full_reply(client, parallel):
    full = ask(client, tool_choice="required", parallel_tool_calls=parallel).choices[0]
    content, calls, reasons = streamed(client, tool_choice="required", parallel_tool_calls=parallel)
    assert calls == [
        {"name": c.function.name, "arguments": c.function.arguments} for c in full.message.tool_calls
    ]
    assert (content or None) == full.message.content
    assert reasons == [full.finish_reason]


def test_auto_leaves_the_model_free(client):
    reply = ask(client, max_tokens=8, extra_body={"ignore_eos": True})  # a random model writes no call
    assert reply.choices[0].message.tool_calls is None and reply.choices[0].finish_reason == "length"
    assert len(reply.choices[0].message.content) > 0
    without = ask(client, max_tokens=8, tool_choice="none", extra_body={"ignore_eos": True})
    assert without.usage.prompt_tokens < reply.usage.prompt_tokens  # "none" offers no tools


# ---- errors -----------------------------------------------------------------------------------------------
def function_tool(parameters: dict | None = None, name: str = "f") -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


BAD_ARGUMENTS = {
    **HISTORY[2],
    "tool_calls": [{**HISTORY[2]["tool_calls"][0], "function": {"name": "f", "arguments": "{oops"}}],
}
BAD_TYPE = {"type": "object", "properties": {"a": {"type": "strin"}}}


def post(server, **body) -> httpx.Response:
    return httpx.post(
        f"{server.url}/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 4, **body}
    )


@pytest.mark.parametrize(
    "body, param, words",
    [
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice.function.name",
            "'nope' is not one of the tools",
        ),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        (
            {"tool_choice": {"type": "function", "function": {"name": "get_time"}}},
            "tool_choice",
            "needs tools",
        ),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools.1.function.name", "names an earlier tool"),
        ({"tools": [function_tool(BAD_TYPE)]}, "tools.0.function.parameters", "strin"),
        ({"tools": [function_tool({"type": "array"})]}, "tools.0.function.parameters", "object"),
        ({"tools": [function_tool(name="bad name")]}, "tools.0.function.name", "pattern"),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
            "cannot be combined",
        ),
        ({"messages": [BAD_ARGUMENTS]}, "messages.0.tool_calls.0.function.arguments", "not valid JSON"),
    ],
)
def test_bad_tool_requests_are_400s_naming_the_field(server, body, param, words):
    response = post(server, **body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_tools_on_a_model_whose_template_has_none_are_a_400(tmp_path):
    with running_server(save_tiny_chat_model("qwen3", tmp_path), max_model_len=256) as srv:
        response = post(srv, tools=TOOLS)
        assert response.status_code == 400 and response.json()["error"]["param"] == "tools"
        assert post(srv, tools=TOOLS, tool_choice="none").status_code == 200  # nothing to render


@pytest.mark.parametrize(
    "body, param",
    [
        ({"functions": [{"name": "f"}]}, "functions"),  # OpenAI's deprecated field: not implemented here
        ({"reasoning_effort": "low"}, "reasoning_effort"),
        (
            {"stream_options": {"include_usage": True, "include_obfuscation": True}},
            "stream_options.include_obfuscation",
        ),
        ({"messages": [{"role": "user", "content": "hi", "audio": {"id": "a"}}]}, "messages.0.audio"),
    ],
)
def test_fields_the_server_does_not_implement_are_400s(server, body, param):
    response = post(server, **body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param and "does not implement" in error["message"], error


def test_such_fields_set_to_null_ask_for_nothing(client):
    # A reply's message sent back as history with the client's model_dump(): its types' nulls included.
    message = ask(client, tools=None, max_tokens=4).choices[0].message.model_dump()
    assert message["refusal"] is None and message["audio"] is None and message["function_call"] is None
    follow_up = {"role": "user", "content": "and then?"}
    answer = ask(client, messages=[*MESSAGES, message, follow_up], reasoning_effort=None, tools=None)
    bare = {"role": "assistant", "content": message["content"]}
    assert answer.choices == ask(client, messages=[*MESSAGES, bare, follow_up], tools=None).choices


def test_no_op_fields_are_accepted(server, client):
    no_ops = {
        "user": "u1",
        "metadata": {"k": "v"},
        "store": False,
        "service_tier": "auto",
        "prompt_cache_key": "k",
        "safety_identifier": "s",
        "parallel_tool_calls": False,
    }
    assert post(server, **no_ops).status_code == 200
    with pytest.raises(openai.BadRequestError, match="does not implement"):
        client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=2, extra_body={"tools": TOOLS})


# ---- the real model (slow tier) ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def qwen_client():
    from specserve.models.loader import resolve_model

    try:
        model_dir = resolve_model("qwen2.5-coder-0.5b")
    except Exception as exc:  # the local-models extra is not installed
        pytest.skip(f"local model qwen2.5-coder-0.5b unavailable: {exc}")
    with running_server(model_dir, max_model_len=2048, kv_cache_memory="512MiB") as srv:
        yield make_client(srv.url)


WEATHER_ANYWHERE = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
    "required": ["city", "days"],
}
REAL_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "A city's forecast",
            "parameters": WEATHER_ANYWHERE,
        },
    },
    {
        "type": "function",
        "function": {"name": "get_time", "description": "The time in a zone", "parameters": CLOCK},
    },
]


@pytest.mark.slow
@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_qwen_forced_calls_follow_the_parameters(qwen_client, tool_choice):
    choice = ask(qwen_client, tools=REAL_TOOLS, tool_choice=tool_choice).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    jsonschema_rs.validate(WEATHER_ANYWHERE, arguments)
    assert arguments == {"city": "Paris", "days": 3}


@pytest.mark.slow
def test_qwen_auto_is_free(qwen_client):
    # This 0.5B model writes its calls as bare JSON, not in its template's <tool_call> blocks: "auto" does
    # not reinterpret that (it stays content); "required" is how to get calls from it.
    choice = ask(qwen_client, tools=REAL_TOOLS).choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason == "stop"
    assert '"get_weather"' in choice.message.content


@pytest.mark.slow
def test_qwen_stream_reassembles_and_parallel_false_gives_one_call(qwen_client):
    messages = [{"role": "user", "content": "What time is it in UTC and in CET? Call the tool for each."}]
    ask_twice = dict(tools=REAL_TOOLS, messages=messages, tool_choice="required")
    full = ask(qwen_client, **ask_twice).choices[0]
    assert full.message.tool_calls and full.finish_reason == "tool_calls"
    _, calls, reasons = streamed(qwen_client, **ask_twice)
    assert calls == [
        {"name": c.function.name, "arguments": c.function.arguments} for c in full.message.tool_calls
    ]
    assert reasons == ["tool_calls"]
    one = ask(qwen_client, **ask_twice, parallel_tool_calls=False).choices[0]
    assert len(one.message.tool_calls) == 1 and one.finish_reason == "tool_calls"
