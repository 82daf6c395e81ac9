"""The FastAPI application: OpenAI routes, vLLM's tokenizer routes, health and metrics, API-key check, and
OpenAI-style errors.

Every error a client can cause answers with an OpenAI error body naming the problem (and, in `param`, the
field): bad JSON, wrong types, out-of-range values, fields the server does not implement, invalid prompts
and tools, and requests over the limits are 400, a missing or wrong API key 401, an unknown model or route
404, a known route with the wrong method 405, a body that does not arrive within the read timeout 408, a
body over the size limit 413, a full queue 429 (with Retry-After), a draining server 503 (with
Retry-After), and an engine failure inside one request 500 for that request only.
"""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Callable
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from specserve.config import SpecserveError
from specserve.server.async_engine import AsyncEngine, EngineOverloaded, EngineUnavailable, RequestFailed
from specserve.server.generation import ChatGeneration, CompletionGeneration
from specserve.server.limits import RequestBodyLimit, ServerLimits, special_token_pattern
from specserve.server.metrics import ServerMetrics, outcome_of_status
from specserve.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorInfo,
    ErrorResponse,
    Health,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfo,
)
from specserve.server.serving import serve_generation
from specserve.server.tokenization import check_token_ids, token_ids, tokenizer_info
from specserve.server.tool_calls import tool_format_of

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 1
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}
ERROR_CODES = {405: "method_not_allowed", 408: "request_timeout", 413: "request_too_large"}
_ERROR_DOCS = {status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 429, 500, 503)}
_STREAM_DOC = {
    "description": "the response; with stream: true, server-sent events of chunks, then `data: [DONE]`",
    "content": {
        "text/event-stream": {
            "schema": {  # one event (OpenAPI 3.1 reading): its data is a JSON chunk, or "[DONE]" at the end
                "type": "object",
                "required": ["data"],
                "properties": {"data": {"type": "string"}},
            }
        }
    },
}


def error_response(
    status: int, message: str, headers: dict[str, str] | None = None, param: str | None = None
) -> JSONResponse:
    error = ErrorInfo(
        message=message,
        type=ERROR_TYPES.get(status, "internal_server_error"),
        param=param,
        code=ERROR_CODES.get(status),
    )
    return JSONResponse(ErrorResponse(error=error).model_dump(), status_code=status, headers=headers)


def build_app(
    async_engine: AsyncEngine, model_name: str, api_key: str | None = None, limits: ServerLimits | None = None
) -> FastAPI:
    """The server for `async_engine`, answering to `model_name`; its lifespan starts and stops the engine."""
    limits = limits or ServerLimits()
    metrics = ServerMetrics(lambda: async_engine.snapshot)
    tokenizer = async_engine.engine.tokenizer
    special_tokens = special_token_pattern(tokenizer) if limits.reject_special_tokens_in_content else None
    tool_format = tool_format_of(tokenizer, async_engine.engine.model_config.model_type)
    started = int(time.time())

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        async_engine.start()
        try:
            yield
        finally:
            await async_engine.stop()

    app = FastAPI(title="specserve", summary="OpenAI-compatible LLM server", lifespan=lifespan)
    _add_error_handlers(app, metrics)

    def body_refused(scope: Scope, status: int) -> None:
        if scope["path"].startswith("/v1/"):
            metrics.count(outcome_of_status(status))
        logger.info("%s %s -> %d: the body was refused", scope["method"], scope["path"], status)

    # Added before the key check, so it runs inside it: a request without the key is refused unread.
    app.add_middleware(
        RequestBodyLimit,
        max_bytes=limits.max_request_body_bytes,
        timeout_s=limits.request_read_timeout_s,
        refuse=error_response,
        on_refused=body_refused,
    )
    if api_key is not None:
        app.add_middleware(ApiKeyCheck, api_key=api_key, metrics=metrics)

    def check_model(model: str | None) -> None:
        if model is not None and model != model_name:
            raise HTTPException(404, f"model {model!r} is not served here; this server serves {model_name!r}")

    def chat_generation(body: ChatCompletionRequest) -> ChatGeneration:
        return ChatGeneration(body, model_name, tokenizer, limits, special_tokens, tool_format)

    v1 = APIRouter(prefix="/v1", responses=_ERROR_DOCS)

    @v1.post("/completions", response_model=CompletionResponse, responses={200: _STREAM_DOC})
    async def create_completion(body: CompletionRequest, request: Request) -> Response:
        check_model(body.model)
        generation = CompletionGeneration(body, model_name, tokenizer, limits)
        return await serve_generation(generation, async_engine, request, metrics)

    @v1.post("/chat/completions", response_model=ChatCompletionResponse, responses={200: _STREAM_DOC})
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
        check_model(body.model)
        generation = chat_generation(body)
        return await serve_generation(generation, async_engine, request, metrics)

    def model_card() -> ModelCard:
        return ModelCard(id=model_name, created=started, max_model_len=async_engine.engine.max_model_len)

    @v1.get("/models")
    async def list_models() -> ModelList:
        return ModelList(data=[model_card()])

    @v1.get("/models/{model:path}")  # a served name may hold slashes ("Qwen/Qwen3-8B")
    async def retrieve_model(model: str) -> ModelCard:
        check_model(model)
        return model_card()

    app.include_router(v1)
    app.include_router(_tokenizer_routes(async_engine, check_model, chat_generation))

    @app.get("/health", responses={503: {"model": ErrorResponse}})
    async def health() -> Health:
        if async_engine.draining:
            raise HTTPException(503, "the server is shutting down", {"Retry-After": str(RETRY_AFTER_S)})
        if not async_engine.is_alive:
            raise HTTPException(503, "the engine loop is not running")
        return Health()

    @app.get("/metrics", response_class=Response, responses={200: {"content": {"text/plain": {}}}})
    async def prometheus_metrics() -> Response:
        return Response(metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


def _tokenizer_routes(
    async_engine: AsyncEngine,
    check_model: Callable[[str | None], None],
    chat_generation: Callable[[ChatCompletionRequest], ChatGeneration],
) -> APIRouter:
    """vLLM's tokenizer routes, at the root where vLLM (and so lm-eval) has them."""
    engine = async_engine.engine
    tokenizer = engine.tokenizer
    routes = APIRouter(responses=_ERROR_DOCS)

    def check_served(model: str | None) -> None:
        check_model(model)
        if tokenizer is None:
            raise HTTPException(404, "this model has no tokenizer: it serves token ids only")

    @routes.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        check_served(body.model)
        chat = None
        if body.messages is not None:  # rendered as the chat route renders it, checks included
            chat = chat_generation(
                ChatCompletionRequest(model=body.model, messages=body.messages, tools=body.tools)
            )

        def job() -> tuple[list[int], list[str] | None]:
            ids = token_ids(tokenizer, body, chat)
            return ids, tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None

        ids, strs = await async_engine.on_tokenizer(job)
        return TokenizeResponse(
            count=len(ids), max_model_len=engine.max_model_len, tokens=ids, token_strs=strs
        )

    @routes.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        check_served(body.model)
        check_token_ids(body, engine.vocab_size)
        return DetokenizeResponse(
            prompt=await async_engine.on_tokenizer(lambda: tokenizer.decode(body.tokens))
        )

    @routes.get("/tokenizer_info")
    async def get_tokenizer_info() -> TokenizerInfo:
        check_served(None)
        return tokenizer_info(tokenizer)

    return routes


def _add_error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
    def fail(
        request: Request,
        status: int,
        message: str,
        headers: dict | None = None,
        counted: bool = False,
        param: str | None = None,
    ) -> JSONResponse:
        if request.url.path.startswith("/v1/") and not counted:
            metrics.count(outcome_of_status(status))
        logger.info("%s %s -> %d: %s", request.method, request.url.path, status, message)
        return error_response(status, message, headers, param)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _describe_validation_errors(exc)
        return fail(request, 400, message, param=param)

    @app.exception_handler(SpecserveError)
    async def invalid_arguments(request: Request, exc: SpecserveError) -> JSONResponse:
        return fail(request, 400, str(exc), param=exc.param)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        message = str(exc.detail)
        if exc.status_code == 405:
            allowed = (exc.headers or {}).get("Allow", "another method")
            message = f"{request.method} is not allowed on {request.url.path}; use {allowed}"
        return fail(request, exc.status_code, message, exc.headers)

    @app.exception_handler(EngineOverloaded)
    async def overloaded(request: Request, exc: EngineOverloaded) -> JSONResponse:
        return fail(request, 429, f"{exc}; retry later", {"Retry-After": str(RETRY_AFTER_S)})

    @app.exception_handler(EngineUnavailable)
    async def unavailable(request: Request, exc: EngineUnavailable) -> JSONResponse:
        # Another replica (or this one, restarted) can take it: say so, as for 429.
        return fail(request, 503, f"{exc}; retry later", {"Retry-After": str(RETRY_AFTER_S)})

    @app.exception_handler(RequestFailed)
    async def failed(request: Request, exc: RequestFailed) -> JSONResponse:
        return fail(request, 500, str(exc), counted=True)  # serve_generation recorded it, with its tokens

    @app.exception_handler(Exception)
    async def bug(request: Request, exc: Exception) -> JSONResponse:
        # Starlette re-raises after this answer goes out (uvicorn logs it and drops the connection): say so.
        message = f"internal server error: {type(exc).__name__}: {exc}"
        return fail(request, 500, message, {"Connection": "close"})


_NOT_FIELDS = {"body", "str", "int", "float", "bool"}


def _describe_validation_errors(exc: RequestValidationError) -> tuple[str, str | None]:
    """('temperature: Input should be less than or equal to 2; ...', one clause per field; the first
    field, as the error's `param`)."""
    by_field: dict[str, list[dict]] = {}
    for error in exc.errors():
        # Drop the body's own location and the names pydantic gives union members ('str', 'list[...]');
        # malformed JSON is no field's fault (its location is a character offset).
        parts = [p for p in error["loc"] if isinstance(p, int) or (p.isidentifier() and p not in _NOT_FIELDS)]
        if error["type"] == "json_invalid":
            parts = []
        by_field.setdefault(".".join(map(str, parts)), []).append(error)
    # A union's member that only says "not a string" is noise beside another member's complaint deeper in.
    for field in [f for f in by_field if f]:
        deeper = any(other.startswith(f"{field}.") for other in by_field)
        if deeper and all(e["type"].endswith("_type") for e in by_field[field]):
            del by_field[field]
    clauses = []
    for field, errors in by_field.items():
        # For a union, a member's specific complaint (too short, too big) beats "not a list" from the others.
        specific = [e for e in errors if not e["type"].endswith("_type")] or errors
        messages = list(dict.fromkeys(_message(e, field) for e in specific))
        clauses.append(f"{field}: {' or '.join(messages)}" if field else "; ".join(messages))
    return "; ".join(clauses) or "invalid request", next(iter(by_field), None) or None


def _message(error: dict, field: str) -> str:
    if error["type"] == "json_invalid":
        at = next((f" at character {p}" for p in error["loc"] if isinstance(p, int)), "")
        return f"the body is not valid JSON ({error.get('ctx', {}).get('error', error['msg'])}{at})"
    if not field and error["type"] in ("model_attributes_type", "dict_type"):
        return "the body must be a JSON object, sent with Content-Type: application/json"
    if error["type"] == "extra_forbidden":
        return "this server does not implement this field (see /openapi.json)"
    return error["msg"]


# Routes outside /v1 that do work for a client, so the key guards them too (vLLM leaves them open; lm-eval
# sends its key to them as to /v1).
KEYED_ROUTES = ("/tokenize", "/detokenize", "/tokenizer_info")


def _keyed(path: str) -> bool:
    return path.startswith("/v1/") or path in KEYED_ROUTES


class ApiKeyCheck:
    """Answers 401 to /v1 and tokenizer requests without `Authorization: Bearer <key>`, before their body
    is read."""

    def __init__(self, app: ASGIApp, api_key: str, metrics: ServerMetrics):
        self.app = app
        self._expected = f"Bearer {api_key}".encode()
        self._metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and _keyed(scope["path"]) and not self._authorized(scope):
            self._metrics.count("unauthorized")
            response = error_response(
                401,
                "a valid API key is required: send 'Authorization: Bearer <key>'",
                {"WWW-Authenticate": "Bearer"},
            )
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        given = dict(scope["headers"]).get(b"authorization", b"")
        return hmac.compare_digest(given, self._expected)
