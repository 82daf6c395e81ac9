"""The OpenAI HTTP API as pydantic models: what clients send and what the server answers.

Names, defaults and ranges follow the OpenAI API, so the official client works unchanged; `top_k`,
`min_p`, `repetition_penalty`, `ignore_eos`, `stop_token_ids` and `return_tokens_as_token_ids` are vLLM's
extensions. Requests are validated strictly (a string where a number belongs is an error, not a
conversion), and a field the server does not implement is a 400 naming it, at any depth: nothing a client
asks for is silently ignored. The exceptions are `NoOpFields`, which change nothing by definition.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from specserve.config import SpecserveError

MAX_CHOICES = 128  # `n` above this is surely a mistake; each choice is one engine request
MAX_LOGPROBS = 20  # the engine returns at most 20 alternatives per token
# Fields with a default here that OpenAI's schema and client types let be null: null means the default.
NULLABLE = ("n", "stream", "echo", "logprobs")


def _integral_float_as_int(value: object) -> object:
    # JSON Schema (and so the published schema) counts 2.0 as an integer; strict pydantic would not.
    return int(value) if isinstance(value, float) and value.is_integer() else value


def integer(**bounds) -> Any:
    """An integer field type with `Field` bounds (ge=, le=) that also takes 2.0 for 2."""
    # The bounds go before the validator, so the schema shows them as minimum/maximum.
    return Annotated[int, Field(**bounds), BeforeValidator(_integral_float_as_int)]


def _valid_unicode(value: str, what: str = "the text") -> str:
    # JSON may carry lone surrogates ("\\ud800"); they are not text, and the tokenizer cannot take them.
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(
                f"{what} holds a lone surrogate (U+{ord(value[exc.start]):04X} at character {exc.start}), "
                "which is not valid Unicode"
            ) from None
    return value


def check_json_text(value: object, field: str) -> None:
    """Every key and string inside `value` (a JSON object a request carries: a schema, a constraint) is
    valid Unicode; a RequestFieldError naming the first that is not, by its path under `field`."""
    pending = [(value, field)]
    while pending:
        node, path = pending.pop()
        if isinstance(node, str):
            _valid_text(node, path)
        elif isinstance(node, dict):
            for key, item in node.items():
                if isinstance(key, str):
                    _valid_text(key, path, what="a key here")
                pending.append((item, f"{path}.{key}"))
        elif isinstance(node, list):
            pending += [(item, f"{path}.{i}") for i, item in enumerate(node)]


def _valid_text(text: str, field: str, what: str = "the text") -> None:
    try:
        _valid_unicode(text, what)
    except ValueError as exc:
        raise RequestFieldError(field, str(exc)) from None


# Every text field of a request: valid Unicode (pydantic lets lone surrogates through in some unions).
Text = Annotated[str, AfterValidator(_valid_unicode)]
# OpenAI's values only (its clients type them as a Literal); an aborted request reports "length".
FinishReason = Literal["stop", "length"]
ChatFinishReason = Literal["stop", "length", "tool_calls"]
NonEmptyStr = Annotated[str, Field(min_length=1), AfterValidator(_valid_unicode)]
TokenId = integer(ge=0)


class RequestFieldError(SpecserveError):
    """A 400 about one field of the request: the message starts with the field, and `param` names it."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}", param)


def _published_nulls(schema: dict) -> None:
    # The published schema says what `_null_asks_for_nothing` takes: NULLABLE fields take null (OpenAPI 3.1:
    # a list of types), and a field this server does not implement only as null.
    schema["additionalProperties"] = {"type": "null"}
    for name in NULLABLE:
        field = schema.get("properties", {}).get(name)
        if field is not None and "type" in field:
            field["type"] = [field["type"], "null"]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra=_published_nulls)

    @model_validator(mode="before")
    @classmethod
    def _null_asks_for_nothing(cls, data: object) -> object:
        # A null is as absent where it can ask for nothing: a field this server does not implement (clients
        # send their types' nulls back: an assistant message's refusal, audio, function_call), or one of
        # NULLABLE (null means its default).
        if not isinstance(data, dict):
            return data
        return {
            k: v for k, v in data.items() if v is not None or (k in cls.model_fields and k not in NULLABLE)
        }


class StreamOptions(_Request):
    include_usage: bool = False


class JsonSchemaFormat(_Request):
    name: Text | None = None
    description: Text | None = None
    schema_: dict = Field(alias="schema", description="the JSON schema the output must follow")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class NoOpFields(_Request):
    """OpenAI fields that cannot change what a server answers, so they are accepted and do nothing here
    (every other field this server does not implement is a 400)."""

    user: Text | None = Field(None, description="an end user's id, for the provider's abuse monitoring")
    safety_identifier: Text | None = Field(None, description="the same, under its newer name")
    metadata: dict[Text, Text] | None = Field(None, description="tags for stored completions")
    store: bool | None = Field(None, description="whether the provider keeps the completion: never here")
    service_tier: Text | None = Field(None, description="the provider's pricing and latency tier")
    prompt_cache_key: Text | None = Field(None, description="a cache-routing hint; prefix caching needs none")


class SamplingFields(NoOpFields):
    """Everything both generation endpoints share: the model, how many choices, and how to sample."""

    model: Text | None = Field(None, description="must name the served model when given")
    n: integer(ge=1, le=MAX_CHOICES) = 1
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: integer(ge=-1) | None = Field(None, description="-1 or 0 turns it off")
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0, le=2)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    # Choice i of a seeded request samples with seed + i, so the bound keeps every seed a valid 64-bit one.
    seed: integer(ge=-(2**63), le=2**63 - 1) | None = None
    stop: NonEmptyStr | list[NonEmptyStr] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    return_tokens_as_token_ids: bool = Field(False, description="logprob tokens as 'token_id:<id>'")
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    # vLLM's: {"json": schema} | {"json_object": true} | {"regex": ...} | {"choice": [...]} | {"grammar": ...}
    structured_outputs: dict | None = None
    logit_bias: dict[Text, float] | None = Field(
        None, description="token id (as a string) -> a bias in [-100, 100] added to its logit"
    )


class CompletionRequest(SamplingFields):
    prompt: (
        NonEmptyStr
        | Annotated[list[NonEmptyStr], Field(min_length=1)]
        | Annotated[list[TokenId], Field(min_length=1)]
        | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]
    ) = Field(description="a string, a list of strings, a list of token ids, or a list of those")
    max_tokens: integer(ge=0) | None = Field(16, description="0 only with echo: the prompt alone")
    logprobs: integer(ge=0, le=MAX_LOGPROBS) | None = None
    echo: bool = Field(False, description="the prompt before each choice's text (and in its logprobs)")


class TextPart(_Request):
    type: Literal["text"]
    text: Text


class FunctionDefinition(_Request):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: Text | None = None
    parameters: dict | None = Field(None, description="the JSON schema of the arguments (an object)")
    # Calls forced by tool_choice follow the schema whatever it says; under "auto" nothing enforces it.
    strict: bool | None = None


class Tool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Request):
    name: Text


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: FunctionName


class FunctionCallParam(_Request):
    name: Text
    arguments: Text = Field(description="JSON text, as the server sent it")


class ToolCallParam(_Request):
    id: Text
    type: Literal["function"]
    function: FunctionCallParam


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = Field(None, description="null only for an assistant's tool calls")
    name: Text | None = None
    tool_calls: list[ToolCallParam] | None = Field(None, description="an assistant's")
    tool_call_id: Text | None = Field(None, description="a tool's: the call it answers")

    @model_validator(mode="after")
    def _fields_fit_the_role(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise PydanticCustomError(
                "content_missing", "content is required unless an assistant calls tools"
            )
        if self.tool_calls is not None and self.role != "assistant":
            raise PydanticCustomError("tool_calls_role", "only an assistant's message has tool_calls")
        if self.role == "tool" and self.tool_call_id is None:
            raise PydanticCustomError("tool_call_id_missing", "a tool's message needs a tool_call_id")
        return self


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: integer(ge=1) | None = Field(None, description="OpenAI deprecated it: max_completion_tokens")
    max_completion_tokens: integer(ge=1) | None = None
    logprobs: bool = False
    top_logprobs: integer(ge=0, le=MAX_LOGPROBS) | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description='"auto" when tools are given, else "none"'
    )
    parallel_tool_calls: bool = Field(True, description="false: at most one call per reply")


# ---- vLLM's tokenizer routes ----------------------------------------------------------------------------
class TokenizeRequest(_Request):
    """vLLM's /tokenize: a prompt as completions tokenizes it, or messages as chat renders them."""

    model: Text | None = Field(None, description="must name the served model when given")
    prompt: Text | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    tools: list[Tool] | None = Field(None, description="with messages: the tools the template shows")
    add_generation_prompt: bool = Field(True, description="with messages: open the assistant's turn")
    # vLLM's defaults: completions add them; a chat template writes its own.
    add_special_tokens: bool | None = Field(None, description="default: true for prompt, false for messages")
    return_token_strs: bool = Field(False, description="the tokens' strings too, as token_strs")

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise PydanticCustomError("prompt_or_messages", "needs one of prompt and messages")
        chat_only = {"tools", "add_generation_prompt"} & self.model_fields_set
        if self.prompt is not None and chat_only:
            raise PydanticCustomError("chat_only", f"{min(chat_only)} goes with messages, not prompt")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Request):
    model: Text | None = Field(None, description="must name the served model when given")
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str


class TokenizerInfo(BaseModel):
    """What lm-eval's remote tokenizer reads (vLLM's answer carries the tokenizer's whole config)."""

    tokenizer_class: str
    bos_token: str | None
    eos_token: str | None
    pad_token: str | None
    chat_template: str | None


# ---- responses ------------------------------------------------------------------------------------------
class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens whose KV came from the prefix cache


class SpecDecodeUsage(BaseModel):
    """The speculative decoding of a response's choices together (`--per-request-spec-decode-metrics`),
    named as the /metrics counters."""

    num_drafts: int  # verification rounds that checked at least one draft token
    num_draft_tokens: int
    num_accepted_tokens: int
    num_accepted_tokens_per_pos: list[int]  # position i: rounds that accepted draft i + 1
    mean_acceptance_length: float  # tokens committed per round, the bonus token included


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    speculative_decoding: SpecDecodeUsage | None = None  # with --per-request-spec-decode-metrics


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]  # None for an echoed prompt's first token: nothing comes before it
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None  # always set on full responses; on stream chunks only the last, if asked


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ToolCallDelta(ToolCall):
    index: int  # of the call in the choice's reply; a stream sends each call whole, once it is complete


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None  # None when the reply is tool calls alone
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: ChatFinishReason | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: ChatFinishReason | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "specserve"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class Health(BaseModel):
    status: Literal["ok"] = "ok"
