"""The OpenAI HTTP API as pydantic models: what clients send and what the server answers.

Names, defaults and ranges follow the OpenAI API, so the official client works unchanged; `top_k`,
`min_p`, `repetition_penalty`, `ignore_eos`, `stop_token_ids` and `return_tokens_as_token_ids` are vLLM's
extensions. Requests are validated strictly (a string where a number belongs is an error, not a
conversion). Fields the server does not know are accepted and ignored, as clients send many the engine
has no use for; the app logs their names.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field

MAX_CHOICES = 128  # `n` above this is surely a mistake; each choice is one engine request
MAX_LOGPROBS = 20  # the engine returns at most 20 alternatives per token


def _integral_float_as_int(value: object) -> object:
    # JSON Schema (and so the published schema) counts 2.0 as an integer; strict pydantic would not.
    return int(value) if isinstance(value, float) and value.is_integer() else value


def integer(**bounds) -> Any:
    """An integer field type with `Field` bounds (ge=, le=) that also takes 2.0 for 2."""
    # The bounds go before the validator, so the schema shows them as minimum/maximum.
    return Annotated[int, Field(**bounds), BeforeValidator(_integral_float_as_int)]


def _valid_unicode(value: str) -> str:
    # JSON may carry lone surrogates ("\\ud800"); they are not text, and the tokenizer cannot take them.
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(
                f"the text holds a lone surrogate (U+{ord(value[exc.start]):04X} at character {exc.start}), "
                "which is not valid Unicode"
            ) from None
    return value


# Every text field of a request: valid Unicode (pydantic lets lone surrogates through in some unions).
Text = Annotated[str, AfterValidator(_valid_unicode)]
# OpenAI's values only (its clients type them as a Literal); an aborted request reports "length".
FinishReason = Literal["stop", "length"]
NonEmptyStr = Annotated[str, Field(min_length=1), AfterValidator(_valid_unicode)]
TokenId = integer(ge=0)


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


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


class SamplingFields(_Request):
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
    user: Text | None = None
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
    max_tokens: integer(ge=1) | None = 16
    logprobs: integer(ge=0, le=MAX_LOGPROBS) | None = None


class TextPart(_Request):
    type: Literal["text"]
    text: Text


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart]


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: integer(ge=1) | None = Field(None, description="OpenAI deprecated it: max_completion_tokens")
    max_completion_tokens: integer(ge=1) | None = None
    logprobs: bool = False
    top_logprobs: integer(ge=0, le=MAX_LOGPROBS) | None = None


# ---- responses ------------------------------------------------------------------------------------------
class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens whose KV came from the prefix cache


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
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


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None


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


class ChatChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None


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
