"""Tool calling per model family: how a family writes a call, the conversation its chat template is
handed, the calls found in a reply (whole or as it streams), and the grammar that makes a model call.

- Qwen2.5 / Qwen3 (any template that writes Hermes-style calls): the template renders the tools and the
  turns of calls itself; a call is `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one
  block per call.
- Gemma 3: its template knows no tools, so the tools are described in the system turn (which the template
  folds into the first user turn), in the JSON style of Google's Gemma function-calling guide; a call is a
  ```tool_code``` block holding `{"name": ..., "parameters": {...}}`, and a tool's result goes back in a
  ```tool_output``` block of a user turn.
"""

from __future__ import annotations

import json
import uuid

from specserve.config import StructuredOutputsParams
from specserve.server.protocol import (
    ChatCompletionRequest,
    FunctionCall,
    NamedToolChoice,
    RequestFieldError,
    Tool,
    ToolCall,
)
from specserve.structured.schema import embed

# The JSON layout of Python's json.dumps, and so of the templates' `tojson`: what the model saw in training.
JSON_LAYOUT = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}
# A tool without `parameters` (or with `{}`) takes none, as OpenAI defines it: its forced arguments are `{}`.
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


class ToolFormat:
    """A family whose template renders tools itself (Hermes-style blocks); subclasses change that."""

    def __init__(self, open_tag: str, close_tag: str, arguments_key: str):
        self.open_tag = open_tag
        self.close_tag = close_tag
        self.arguments_key = arguments_key

    def block(self, name: str, arguments: str) -> str:
        """One call as the family writes it; `arguments` is JSON text."""
        call = f'{{"name": {json.dumps(name, ensure_ascii=False)}, "{self.arguments_key}": {arguments}}}'
        return f"{self.open_tag}\n{call}\n{self.close_tag}"

    def conversation(
        self, messages: list[dict], tools: list[dict] | None
    ) -> tuple[list[dict], list[dict] | None]:
        """The messages and tools to hand the chat template (assistant calls carry their arguments as
        objects, as templates expect)."""
        return messages, tools


class GemmaFormat(ToolFormat):
    def __init__(self):
        super().__init__("```tool_code", "```", "parameters")

    def conversation(self, messages: list[dict], tools: list[dict] | None) -> tuple[list[dict], None]:
        turns = [self._as_text(m) for m in messages]
        if tools:
            prompt = self._tools_prompt(tools)
            if turns[0]["role"] == "system":
                turns[0] = {"role": "system", "content": f"{turns[0]['content']}\n\n{prompt}"}
            else:
                turns.insert(0, {"role": "system", "content": prompt})
        # The template insists on user / model turns in turn: a tool's result followed by the user's next
        # words (both user turns here) become one.
        merged = turns[:1]
        for turn in turns[1:]:
            if turn["role"] == merged[-1]["role"] == "user":
                merged[-1] = {"role": "user", "content": f"{merged[-1]['content']}\n\n{turn['content']}"}
            else:
                merged.append(turn)
        return merged, None

    def _as_text(self, message: dict) -> dict:
        if message["role"] == "tool":
            return {"role": "user", "content": f"```tool_output\n{message['content']}\n```"}
        if message.get("tool_calls"):
            blocks = [
                self.block(c["function"]["name"], json.dumps(c["function"]["arguments"], ensure_ascii=False))
                for c in message["tool_calls"]
            ]
            return {"role": "assistant", "content": "\n".join(filter(None, [message["content"], *blocks]))}
        return message

    def _tools_prompt(self, tools: list[dict]) -> str:
        functions = json.dumps([tool["function"] for tool in tools], indent=2, ensure_ascii=False)
        return (
            "You have access to functions. If you decide to invoke any of the function(s), you MUST put each "
            "call in its own block, in the format of\n"
            f"{self.open_tag}\n"
            '{"name": function name, "parameters": dictionary of argument name and its value}\n'
            f"{self.close_tag}\n"
            "You SHOULD NOT include any other text in the response if you call a function.\n"
            f"{functions}"
        )


HERMES = ToolFormat("<tool_call>", "</tool_call>", "arguments")
GEMMA = GemmaFormat()


def tool_format_of(tokenizer, model_type: str) -> ToolFormat | None:
    """The tool-call format of this model, from its chat template and family; None when there is none
    specserve knows."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str):
        return None
    if _writes_hermes_calls(tokenizer):
        return HERMES
    if model_type.startswith("gemma") and "tools" not in template:
        return GEMMA
    return None


def _writes_hermes_calls(tokenizer) -> bool:
    # The template shows how it writes an assistant's call: ask it, rather than guess from its source.
    call = {"id": "call_0", "type": "function", "function": {"name": "probe", "arguments": {}}}
    probe = [{"role": "user", "content": "?"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    try:
        text = tokenizer.apply_chat_template(probe, tokenize=False)
    except Exception:  # a template that refuses the probe writes no calls we know
        return False
    return HERMES.block("probe", "{}") in text


def check_parameters(tools: list[Tool]) -> None:
    """Each tool's `parameters` must be the JSON schema of an object (whether it compiles, the grammar
    workers check)."""
    for i, tool in enumerate(tools):
        schema = tool.function.parameters
        if schema is not None and schema.get("type", "object") != "object":
            raise RequestFieldError(
                f"tools.{i}.function.parameters",
                "must be the JSON schema of an object (the call's arguments)",
            )


def forcing_grammar(fmt: ToolFormat, tools: list[Tool], tokenizer, parallel: bool) -> str:
    """A Lark grammar (llguidance's) for a reply that is one call of one of `tools`, or several, one per
    line, when `parallel`: the family's block with arguments valid under the tool's parameters."""
    key = fmt.arguments_key
    call = {
        "anyOf": [
            {
                "type": "object",
                "properties": {
                    "name": {"const": t.function.name},
                    # Its references ("#/$defs/...") mean the parameters' own root, wherever it sits.
                    key: embed(t.function.parameters or NO_PARAMETERS, f"/anyOf/{i}/properties/{key}"),
                },
                "required": ["name", key],
                "additionalProperties": False,
            }
            for i, t in enumerate(tools)
        ],
        "x-guidance": JSON_LAYOUT,
    }
    # A tag the tokenizer holds as one added token (Qwen's <tool_call>) is that token, not its spelling.
    added = tokenizer.get_added_vocab()

    def lark(text: str) -> str:
        return text if text in added and text.startswith("<") and text.endswith(">") else json.dumps(text)

    # After a call a model may write a newline before it ends (Qwen does): parallel calls may end so.
    calls = 'call ("\\n" call)* "\\n"?' if parallel else "call"
    rule = f'{lark(fmt.open_tag)} "\\n" %json {json.dumps(call)} "\\n" {lark(fmt.close_tag)}'
    return f"start: {calls}\ncall: {rule}\n"


class ToolCallParser:
    """One choice's reply split into content and tool calls, fed whole or as it streams; the same text
    gives the same split either way. A block that is not a call of one of `tool_names` (bad JSON, an
    unknown tool, cut off) stays content, and so do the blocks after the first `max_calls`. Whitespace
    next to a call is dropped."""

    def __init__(self, fmt: ToolFormat, tool_names: set[str], max_calls: int | None = None):
        self.fmt = fmt
        self.tool_names = tool_names
        self.max_calls = max_calls
        self.num_calls = 0
        self._pending = ""  # text not yet known to be content or a call
        self._after_call = False

    def feed(self, text: str, final: bool = False) -> tuple[str, list[ToolCall]]:
        """The content and the calls that `text` (the next piece of the reply) completes; `final` when
        the reply ends with it."""
        self._pending += text
        content, calls = [], []
        open_tag, close_tag = self.fmt.open_tag, self.fmt.close_tag
        while True:
            start = self._pending.find(open_tag)
            if start < 0:
                cut = len(self._pending) if final else self._undecided_from()
                break
            end = self._pending.find(close_tag, start + len(open_tag))
            if end < 0:  # a call under way: what comes before it is content
                cut = len(self._pending) if final else len(self._pending[:start].rstrip())
                break
            stop = end + len(close_tag)
            call = self._call(self._pending[start + len(open_tag) : end])
            content.append(self._content(self._pending[:start].rstrip() if call else self._pending[:stop]))
            self._pending = self._pending[stop:]
            if call:
                calls.append(call)
                self._after_call = True
        content.append(self._content(self._pending[:cut]))
        self._pending = self._pending[cut:]
        return "".join(content), calls

    def _undecided_from(self) -> int:
        """Where the tail that could still begin a call starts: a piece of the open tag, and the
        whitespace before it (dropped if a call follows)."""
        text, tag = self._pending, self.fmt.open_tag
        piece = next((k for k in range(min(len(tag) - 1, len(text)), 0, -1) if text.endswith(tag[:k])), 0)
        return len(text[: len(text) - piece].rstrip())

    def _content(self, text: str) -> str:
        if self._after_call:
            text = text.lstrip()
            self._after_call = not text
        return text

    def _call(self, body: str) -> ToolCall | None:
        if self.max_calls is not None and self.num_calls >= self.max_calls:
            return None
        try:
            value = json.loads(body)
        except json.JSONDecodeError:
            return None
        key = self.fmt.arguments_key
        if not (
            isinstance(value, dict)
            and set(value) == {"name", key}
            and value["name"] in self.tool_names
            and isinstance(value[key], dict)
        ):
            return None
        self.num_calls += 1
        function = FunctionCall(name=value["name"], arguments=json.dumps(value[key], ensure_ascii=False))
        return ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", function=function)


class ToolUse:
    """What one chat request asks of tools: the tools its prompt offers, the grammar that forces a call
    (tool_choice "required" or a named function), and the parser of its replies. A request that offers no
    tools (none given, or tool_choice "none") gets plain text back, parsed for nothing."""

    def __init__(self, body: ChatCompletionRequest, fmt: ToolFormat | None):
        tools = body.tools or []
        names = [t.function.name for t in tools]
        for i, name in enumerate(names):
            if name in names[:i]:
                raise RequestFieldError(f"tools.{i}.function.name", f"{name!r} names an earlier tool too")
        choice = body.tool_choice or "auto"
        named = choice.function.name if isinstance(choice, NamedToolChoice) else None
        if choice == "required" or named is not None:
            if not tools:
                raise RequestFieldError("tool_choice", "a required or named tool call needs tools")
            if named is not None and named not in names:
                message = f"{named!r} is not one of the tools {names}"
                raise RequestFieldError("tool_choice.function.name", message)
        check_parameters(tools)
        self.fmt = fmt
        self.given = tools
        self.offered = tools if choice != "none" else []
        if self.offered and fmt is None:
            raise RequestFieldError(
                "tools",
                "this model's chat template writes tool calls in no format specserve knows (Qwen2.5 / "
                "Qwen3's <tool_call> blocks; Gemma 3, which has none, gets its tools in the system turn)",
            )
        if named is not None:
            self.forced = [t for t in tools if t.function.name == named]
        else:
            self.forced = tools if choice == "required" else []
        # A named function is called once; otherwise once unless parallel calls are allowed.
        self.max_calls = 1 if named is not None or not body.parallel_tool_calls else None

    def conversation(self, messages: list[dict]) -> tuple[list[dict], list[dict] | None]:
        """The messages and tools for the chat template; previous calls render in the family's way even
        when no tools are offered now."""
        tools = [t.model_dump(exclude_none=True, exclude={"function": {"strict"}}) for t in self.offered]
        if self.fmt is None:
            return messages, None
        return self.fmt.conversation(messages, tools or None)

    def schema_checks(self) -> list[tuple[str, StructuredOutputsParams]]:
        """Each tool's parameters as a JSON constraint to compile (and so check), by its field."""
        return [
            (f"tools.{i}.function.parameters", StructuredOutputsParams(json=t.function.parameters))
            for i, t in enumerate(self.given)
            if t.function.parameters is not None
        ]

    def grammar(self, tokenizer) -> str | None:
        if not self.forced:
            return None
        return forcing_grammar(self.fmt, self.forced, tokenizer, parallel=self.max_calls is None)

    def parser(self) -> ToolCallParser | None:
        if not self.offered:
            return None
        return ToolCallParser(self.fmt, {t.function.name for t in self.offered}, self.max_calls)
