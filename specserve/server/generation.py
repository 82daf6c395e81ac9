"""One generation request (completions or chat): the engine requests it makes, and the OpenAI objects
(full responses or stream chunks) it builds from engine updates.

A request with `n` choices (and, for completions, several prompts) becomes one engine request per choice:
choice `i * n + j` is prompt i's j-th sample, seeded with `seed + j` when a seed is given, so a seeded
request gives the same text whether it asks for one choice or many.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
import uuid

from pydantic import BaseModel

from specserve.config import SamplingParams, SpecserveError, StructuredOutputsParams
from specserve.core.spec_stats import SpecStats
from specserve.engine.engine import PromptType
from specserve.server.async_engine import EngineRequest, EngineUpdate, RenderedText
from specserve.server.limits import ServerLimits
from specserve.server.logprobs import TokenText, chat_logprobs, completion_logprobs
from specserve.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    Delta,
    PromptTokensDetails,
    RequestFieldError,
    SamplingFields,
    SpecDecodeUsage,
    ToolCall,
    ToolCallDelta,
    Usage,
    check_json_text,
)
from specserve.server.tool_calls import ToolCallParser, ToolFormat, ToolUse
from specserve.structured.schema import json_size


def sampling_params(
    body: SamplingFields, max_tokens: int | None, logprobs: int | None, choice: int
) -> SamplingParams:
    """The engine's parameters for choice `choice` (its seed is offset by it); SpecserveError if invalid."""

    def given(value, default):
        return default if value is None else value

    return SamplingParams(
        temperature=given(body.temperature, 1.0),
        top_p=given(body.top_p, 1.0),
        top_k=-1 if body.top_k in (None, 0) else body.top_k,
        min_p=given(body.min_p, 0.0),
        repetition_penalty=given(body.repetition_penalty, 1.0),
        presence_penalty=given(body.presence_penalty, 0.0),
        frequency_penalty=given(body.frequency_penalty, 0.0),
        seed=None if body.seed is None else body.seed + choice,
        max_tokens=max_tokens,
        stop=given(body.stop, []),
        stop_token_ids=given(body.stop_token_ids, []),
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
        structured_outputs=output_constraint(body),
        logit_bias=logit_bias(body.logit_bias),
    )


def logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias (JSON object keys are strings) with token ids as integers."""
    if bias is None:
        return None
    bad = [key for key in bias if not (key.isascii() and key.isdigit())]
    if bad:
        raise RequestFieldError("logit_bias", f"keys must be token ids, got {bad[:5]}")
    return {int(key): value for key, value in bias.items()}


def output_constraint(body: SamplingFields) -> dict | None:
    """`response_format` (OpenAI's) or `structured_outputs` (vLLM's) as the engine's constraint."""
    fmt = body.response_format
    if fmt is not None and fmt.type != "text" and body.structured_outputs is not None:
        raise SpecserveError("response_format and structured_outputs: give one of them")
    if fmt is None or fmt.type == "text":
        return body.structured_outputs
    if fmt.type == "json_object":
        return {"json_object": True}
    if fmt.json_schema is None:
        raise RequestFieldError("response_format.json_schema", "required when type is 'json_schema'")
    return {"json": fmt.json_schema.schema_}


def constraint_field(body: SamplingFields, params: SamplingParams) -> str:
    """The request field that holds `params`' output constraint, as errors name it."""
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_schema":
        return "response_format.json_schema.schema"
    if fmt is not None and fmt.type == "json_object":
        return "response_format"
    return f"structured_outputs.{params.structured_outputs.kind}"


def spec_decode_usage(stats: SpecStats) -> SpecDecodeUsage:
    return SpecDecodeUsage(
        num_drafts=stats.num_drafts,
        num_draft_tokens=stats.num_draft_tokens,
        num_accepted_tokens=stats.num_accepted_tokens,
        num_accepted_tokens_per_pos=stats.accepted_per_position,
        mean_acceptance_length=stats.mean_acceptance_length,
    )


def finish_reason(reason: str | None) -> str | None:
    """The engine's finish reason as an OpenAI value: "abort" (the server cut the request short at its
    shutdown deadline) is not one, and clients that type the field reject it; "length" says what a client
    needs to know, that the text was truncated before the model ended it."""
    return "length" if reason == "abort" else reason


class Generation:
    """What both endpoints share: ids, usage, limits, and the latest update of every choice."""

    id_prefix = "gen"

    def __init__(self, body: SamplingFields, model_name: str, tokenizer, limits: ServerLimits | None = None):
        self.body = body
        self.limits = limits or ServerLimits()
        stop = body.stop if isinstance(body.stop, list) else []
        if len(stop) > self.limits.max_stop_strings:
            raise RequestFieldError(
                "stop", f"at most {self.limits.max_stop_strings} stop strings per request, got {len(stop)}"
            )
        if body.stream_options is not None and not body.stream:
            raise RequestFieldError("stream_options", "only allowed when stream is true")
        self._check_constraints()
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model_name = model_name
        self.text_of = TokenText(tokenizer, as_ids=body.return_tokens_as_token_ids)
        self.latest: dict[int, EngineUpdate] = {}  # the handler records each update here

    def constraint_values(self) -> list[tuple[str, object]]:
        """(field, value) of every constraint the request carries, before anything compiles it."""
        values = list((self.body.structured_outputs or {}).items())
        values = [(f"structured_outputs.{key}", value) for key, value in values]
        fmt = self.body.response_format
        if fmt is not None and fmt.json_schema is not None:
            values.append(("response_format.json_schema.schema", fmt.json_schema.schema_))
        return values

    def _check_constraints(self) -> None:
        """Each constraint within the size limit (checked first: it stops early), then valid text."""
        limit = self.limits.max_constraint_bytes
        for field, value in self.constraint_values():
            if json_size(value, limit) > limit:
                raise RequestFieldError(
                    field,
                    f"is larger than this server's limit of {limit} bytes for a constraint "
                    "(--max-constraint-bytes)",
                )
            check_json_text(value, field)

    def schema_checks(self) -> list[tuple[str, StructuredOutputsParams]]:
        """Schemas the request carries beside its output constraint, to compile (and so check)."""
        return []

    def field_of(self, param: str | None) -> str | None:
        """The request field that holds the engine's argument `param` (an error's `param` names it)."""
        return param

    def _engine_request(self, prompt, params: SamplingParams, strict: bool, field: str | None = None):
        """One choice's EngineRequest; its constraint's field named as the body names it."""
        if params.structured_outputs is not None and field is None:
            field = constraint_field(self.body, params)
        return EngineRequest(prompt, params, strict, constraint_field=field)

    @property
    def stream(self) -> bool:
        return self.body.stream

    @property
    def include_usage(self) -> bool:
        return self.body.stream_options is not None and self.body.stream_options.include_usage

    def usage(self) -> Usage:
        # Choices of one prompt share it: count each prompt once.
        firsts = [u for i, u in self.latest.items() if i % self.body.n == 0]
        prompt = sum(u.num_prompt_tokens for u in firsts)
        completion = sum(len(u.output.token_ids) for u in self.latest.values())
        spec = [u.spec_stats for u in self.latest.values() if u.spec_stats is not None]
        return Usage(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(u.num_cached_tokens for u in firsts)),
            speculative_decoding=spec_decode_usage(SpecStats.total(spec)) if spec else None,
        )

    def opening_chunks(self) -> list[BaseModel]:
        return []

    @staticmethod
    def _new_tokens(update: EngineUpdate) -> tuple[list[int], list[dict[int, float]]]:
        """The tokens this update added, with their logprob steps (empty when none were asked for)."""
        output = update.output
        new = output.delta_token_ids or []
        steps = output.logprobs[len(output.token_ids) - len(new) :] if output.logprobs is not None else []
        return new, steps

    @staticmethod
    def _worth_sending(update: EngineUpdate) -> bool:
        # Tokens can arrive without text (held back while they might begin a stop string): skip those.
        return bool(update.output.delta_text) or update.finished or update.output.logprobs is not None


class CompletionGeneration(Generation):
    """With `echo`, each choice's text (and its logprobs, when asked) starts with its prompt's: the prompt
    tokens' logprobs are the engine's prompt logprobs, null for the first token."""

    id_prefix = "cmpl"

    def __init__(
        self, body: CompletionRequest, model_name: str, tokenizer, limits: ServerLimits | None = None
    ):
        super().__init__(body, model_name, tokenizer, limits)
        self.body: CompletionRequest = body
        self._tokenizer = tokenizer
        self._streamed_chars: dict[int, int] = {}  # per choice, for stream logprobs' text offsets
        if body.max_tokens == 0 and not body.echo:
            raise RequestFieldError("max_tokens", "0 needs echo: true (it asks for the prompt alone)")
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], str):
            num_ids = len(prompt) if isinstance(prompt[0], int) else sum(len(p) for p in prompt)
            if num_ids > self.limits.max_prompt_token_ids:
                raise RequestFieldError(
                    "prompt",
                    f"at most {self.limits.max_prompt_token_ids} token ids per request, got {num_ids}",
                )

    @property
    def echo_only(self) -> bool:
        """max_tokens 0 with echo: the prompt and its logprobs alone. The engine still samples one token (a
        step always does); the answer leaves it out, as vLLM's does."""
        return self.body.echo and self.body.max_tokens == 0

    def prompts(self) -> list[PromptType]:
        prompt = self.body.prompt
        if isinstance(prompt, str) or isinstance(prompt[0], int):
            return [prompt]
        return list(prompt)

    def _prompt_text(self, i: int) -> str:
        """Prompt i as echoed: its text, or its token ids decoded (no text without a tokenizer)."""
        prompt = self.prompts()[i]
        if isinstance(prompt, str):
            return prompt
        return self._tokenizer.decode(prompt) if self._tokenizer is not None else ""

    def _params(self, choice: int) -> SamplingParams:
        max_tokens = 1 if self.echo_only else self.body.max_tokens
        params = sampling_params(self.body, max_tokens, self.body.logprobs, choice)
        if self.body.echo and self.body.logprobs is not None:  # echoed prompt tokens have logprobs too
            params = dataclasses.replace(params, prompt_logprobs=self.body.logprobs)
        return params

    def engine_requests(self) -> list[EngineRequest]:
        # Absent, max_tokens is OpenAI's 16, clamped to the room the prompt leaves; given, it must fit.
        strict = "max_tokens" in self.body.model_fields_set
        return [
            self._engine_request(prompt, self._params(j), strict)
            for prompt in self.prompts()
            for j in range(self.body.n)
        ]

    def _choice(
        self, update: EngineUpdate, text: str, token_ids: list[int], steps: list, offset: int, echo: bool
    ) -> CompletionChoice:
        """A choice from its text, tokens and logprob steps (all of them, or those an update added; the
        text from `offset` in the choice's), after its prompt's when `echo`."""
        reason = update.output.finish_reason
        if self.echo_only:  # ends at its limit, whatever token the engine sampled
            text, token_ids, steps, reason = "", [], [], ("length" if update.finished else None)
        if echo:
            text = self._prompt_text(update.index // self.body.n) + text
            token_ids = update.prompt_token_ids + token_ids
            steps = (update.prompt_logprobs or []) + steps
        logprobs = None
        if self.body.logprobs is not None:
            logprobs = completion_logprobs(self.text_of, token_ids, steps, self.body.logprobs, offset)
        return CompletionChoice(
            index=update.index, text=text, logprobs=logprobs, finish_reason=finish_reason(reason)
        )

    def chunks(self, update: EngineUpdate) -> list[BaseModel]:
        echo = self.body.echo and update.index not in self._streamed_chars  # the first chunk echoes
        if not (echo or self._worth_sending(update)):
            return []
        offset = self._streamed_chars.get(update.index, 0)
        new_tokens, new_steps = self._new_tokens(update)
        choice = self._choice(update, update.output.delta_text, new_tokens, new_steps, offset, echo)
        self._streamed_chars[update.index] = offset + len(choice.text)
        return [self._response([choice], usage=None)]

    def usage(self) -> Usage:
        usage = super().usage()
        if self.echo_only:  # the token the engine had to sample is no part of the answer
            usage.completion_tokens, usage.total_tokens = 0, usage.prompt_tokens
        return usage

    def usage_chunk(self) -> BaseModel:
        return self._response([], usage=self.usage())

    def response(self) -> BaseModel:
        choices = [
            self._choice(u, u.output.text, u.output.token_ids, u.output.logprobs or [], 0, self.body.echo)
            for _, u in sorted(self.latest.items())
        ]
        return self._response(choices, usage=self.usage())

    def _response(self, choices: list[CompletionChoice], usage: Usage | None) -> CompletionResponse:
        return CompletionResponse(
            id=self.id, created=self.created, model=self.model_name, choices=choices, usage=usage
        )


class ChatGeneration(Generation):
    id_prefix = "chatcmpl"

    def __init__(
        self,
        body: ChatCompletionRequest,
        model_name: str,
        tokenizer,
        limits: ServerLimits | None = None,
        special_tokens: re.Pattern | None = None,
        tool_format: ToolFormat | None = None,
    ):
        """`special_tokens`, when given, matches the control tokens that message content may not hold;
        `tool_format` is how the model writes tool calls (`tool_format_of`), None when it has none."""
        super().__init__(body, model_name, tokenizer, limits)
        self.body: ChatCompletionRequest = body
        self._tokenizer = tokenizer
        self._special_tokens = special_tokens
        if body.top_logprobs is not None and not body.logprobs:
            raise RequestFieldError("top_logprobs", "needs logprobs: true")
        if len(body.messages) > self.limits.max_messages:
            raise RequestFieldError(
                "messages",
                f"at most {self.limits.max_messages} messages per request, got {len(body.messages)}",
            )
        self.tools = ToolUse(body, tool_format)
        if self.tools.forced and output_constraint(body) is not None:
            raise RequestFieldError(
                "tool_choice",
                "a required or named tool call constrains the output itself; it cannot be "
                "combined with response_format or structured_outputs",
            )
        self._parsers: dict[int, ToolCallParser] = {}  # per streamed choice

    @property
    def num_top_logprobs(self) -> int | None:
        return (self.body.top_logprobs or 0) if self.body.logprobs else None

    def messages(self) -> list[dict]:
        """The messages as templates take them: text content, and the arguments of calls as objects."""
        messages = []
        for i, m in enumerate(self.body.messages):
            content = m.content if isinstance(m.content, str) else "".join(p.text for p in m.content or [])
            message = {"role": m.role, "content": content}
            message.update(m.model_dump(include={"name", "tool_call_id"}, exclude_none=True))
            if m.tool_calls:
                message["tool_calls"] = [
                    {
                        "id": c.id,
                        "type": c.type,
                        "function": {
                            "name": c.function.name,
                            "arguments": _json_object(
                                c.function.arguments, f"messages.{i}.tool_calls.{j}.function.arguments"
                            ),
                        },
                    }
                    for j, c in enumerate(m.tool_calls)
                ]
            messages.append(message)
        return messages

    def _check_special_tokens(self) -> None:
        for i, message in enumerate(self.body.messages):
            if isinstance(message.content, str):
                parts = [(f"messages.{i}.content", message.content)]
            else:
                parts = [
                    (f"messages.{i}.content.{j}.text", p.text) for j, p in enumerate(message.content or [])
                ]
            parts += [
                (f"messages.{i}.tool_calls.{j}.function.arguments", call.function.arguments)
                for j, call in enumerate(message.tool_calls or [])
            ]
            for field, text in parts:
                found = self._special_tokens.search(text)
                if found:
                    raise RequestFieldError(
                        field,
                        f"holds the special token {found.group()!r}, which this server does not "
                        "accept in message content (--reject-special-tokens-in-content)",
                    )

    def rendered(self, add_generation_prompt: bool = True) -> RenderedText:
        """The conversation through the chat template (run on a tokenizer thread); without the generation
        prompt, as /tokenize may ask."""
        tokenizer = self._tokenizer
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise SpecserveError("this model has no chat template; use /v1/completions")
        if self._special_tokens is not None:
            self._check_special_tokens()
        messages, tools = self.tools.conversation(self.messages())
        text = tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False
        )
        # The template writes the special tokens itself; adding them again would double a BOS.
        return RenderedText(text)

    def constraint_values(self) -> list[tuple[str, object]]:
        tools = [
            (f"tools.{i}.function.parameters", t.function.parameters)
            for i, t in enumerate(self.body.tools or [])
            if t.function.parameters is not None
        ]
        return super().constraint_values() + tools

    def schema_checks(self) -> list[tuple[str, StructuredOutputsParams]]:
        return self.tools.schema_checks()

    def field_of(self, param: str | None) -> str | None:
        if param == "prompt":  # the conversation, rendered
            return "messages"
        if param == "max_tokens" and self.body.max_completion_tokens is not None:
            return "max_completion_tokens"
        return param

    def engine_requests(self) -> list[EngineRequest]:
        max_tokens = self.body.max_completion_tokens or self.body.max_tokens
        source = self.rendered  # one object, so the choices share one rendering
        # Absent, max_tokens means "up to the context"; given, it must fit beside the prompt.
        strict = max_tokens is not None
        grammar = self.tools.grammar(self._tokenizer)
        if grammar is not None and len(grammar.encode()) > self.limits.max_constraint_bytes:
            raise RequestFieldError(
                "tool_choice",
                f"the grammar of a call to these tools is larger than this server's limit of "
                f"{self.limits.max_constraint_bytes} bytes for a constraint (--max-constraint-bytes)",
            )
        requests = []
        for j in range(self.body.n):
            params = sampling_params(self.body, max_tokens, self.num_top_logprobs, j)
            field = None
            if grammar is not None:
                constraint = StructuredOutputsParams(grammar=grammar)
                params, field = dataclasses.replace(params, structured_outputs=constraint), "tool_choice"
            requests.append(self._engine_request(source, params, strict, field))
        return requests

    def _logprobs(self, token_ids, steps):
        if self.num_top_logprobs is None:
            return None
        return chat_logprobs(self.text_of, token_ids, steps, self.num_top_logprobs)

    @staticmethod
    def _reply(parser: ToolCallParser | None, text: str, final: bool) -> tuple[str | None, list[ToolCall]]:
        """The content and the tool calls of (the next piece of) a reply; content is None beside calls
        when there is none."""
        content, calls = parser.feed(text, final) if parser is not None else (text, [])
        return (content if content or not calls else None), calls

    @staticmethod
    def _finish_reason(reason: str | None, parser: ToolCallParser | None) -> str | None:
        # A reply cut short (length) says so even if it made calls: the last one may be missing.
        called = parser is not None and parser.num_calls > 0
        return "tool_calls" if called and reason == "stop" else finish_reason(reason)

    def opening_chunks(self) -> list[BaseModel]:
        return [
            self._chunk([ChatChunkChoice(index=i, delta=Delta(role="assistant", content=""))])
            for i in range(self.body.n)
        ]

    def chunks(self, update: EngineUpdate) -> list[BaseModel]:
        if update.index not in self._parsers:
            self._parsers[update.index] = self.tools.parser()
        parser = self._parsers[update.index]
        content, calls = self._reply(parser, update.output.delta_text, update.finished)
        if not (content or calls or update.finished or update.output.logprobs is not None):
            return []  # nothing yet: held back as a stop string's or a tool call's possible start
        first = parser.num_calls - len(calls) if parser is not None else 0
        deltas = [ToolCallDelta(index=first + k, **call.model_dump()) for k, call in enumerate(calls)]
        choice = ChatChunkChoice(
            index=update.index,
            delta=Delta(content=content, tool_calls=deltas or None),
            logprobs=self._logprobs(*self._new_tokens(update)),
            finish_reason=self._finish_reason(update.output.finish_reason, parser),
        )
        return [self._chunk([choice])]

    def usage_chunk(self) -> BaseModel:
        return self._chunk([], usage=self.usage())

    def response(self) -> BaseModel:
        choices = []
        for i, u in sorted(self.latest.items()):
            parser = self.tools.parser()
            content, calls = self._reply(parser, u.output.text, final=True)
            choices.append(
                ChatChoice(
                    index=i,
                    message=AssistantMessage(content=content, tool_calls=calls or None),
                    logprobs=self._logprobs(u.output.token_ids, u.output.logprobs or []),
                    finish_reason=self._finish_reason(u.output.finish_reason, parser),
                )
            )
        return ChatCompletionResponse(
            id=self.id, created=self.created, model=self.model_name, choices=choices, usage=self.usage()
        )

    def _chunk(self, choices: list[ChatChunkChoice], usage: Usage | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.id, created=self.created, model=self.model_name, choices=choices, usage=usage
        )


def _json_object(text: str, field: str) -> dict:
    """A call's arguments, sent as JSON text, as the object templates render."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise RequestFieldError(field, f"not valid JSON ({exc.msg})") from None
    if not isinstance(value, dict):
        raise RequestFieldError(field, "must be a JSON object")
    return value
