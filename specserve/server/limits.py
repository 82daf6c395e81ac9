"""What one client may ask of the server, and how long it may take to ask it.

- `ServerLimits`: the request limits (body size, messages, stop strings, prompt token ids) and timeouts.
- `RequestBodyLimit`: an ASGI middleware that reads every request body before the app sees it, refusing
  one over the limit with 413 (from its Content-Length, or as soon as the bytes streamed in pass the limit,
  before any JSON parsing) and one that does not arrive within the read timeout with 408; both close the
  connection.
- `PromptBound`: refuses a prompt text certain to exceed the context before it is tokenized in full.
- `http_protocol`: uvicorn's h11 protocol with a header timeout: a connection that opens and sends
  nothing, or sends part of its headers and stalls, is closed after the read timeout (uvicorn itself only
  times out idle keep-alive connections between requests).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from specserve.config import SpecserveError, check

DEFAULT_MAX_REQUEST_BODY_BYTES = 32 * 2**20


@dataclass(frozen=True)
class ServerLimits:
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    request_read_timeout_s: float = 30.0  # for the headers, and then for the whole body
    timeout_keep_alive_s: float = 5.0  # an idle keep-alive connection between requests (uvicorn's)
    max_messages: int = 2048  # chat messages per request
    max_stop_strings: int = 64
    max_prompt_token_ids: int = 2**20  # token ids a completions request may send, all its prompts together
    reject_special_tokens_in_content: bool = False
    max_constraint_bytes: int = 64 * 1024  # a constraint's text (regex, grammar, choices, a JSON schema)
    grammar_compile_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            check(isinstance(value, bool) or value > 0, f"{name} must be > 0, got {value}")


class RequestBodyLimit:
    """Reads each HTTP request's body (at most `max_bytes`, within `timeout_s`) and replays it to `app`.

    `refuse(status, message)` builds the error response (413 or 408); `on_refused(scope, status)` is told.
    """

    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int,
        timeout_s: float,
        refuse: Callable[[int, str], Callable],
        on_refused: Callable[[Scope, int], None] = lambda scope, status: None,
    ):
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self._refuse = refuse
        self._on_refused = on_refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        too_large = (
            f"the request body is larger than this server's limit of {self.max_bytes} bytes "
            "(--max-request-body-bytes)"
        )
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._answer(scope, receive, send, 413, too_large)
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        chunks: list[bytes] = []
        size = 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                message_text = (
                    f"the request body did not arrive within {self.timeout_s:g} s (--request-read-timeout)"
                )
                await self._answer(scope, receive, send, 408, message_text)
                return
            if message["type"] == "http.disconnect":
                return  # the client left before it finished sending: nobody to answer
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_bytes:
                await self._answer(scope, receive, send, 413, too_large)
                return
            chunks.append(body)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _answer(self, scope: Scope, receive: Receive, send: Send, status: int, message: str) -> None:
        self._on_refused(scope, status)
        response = self._refuse(status, message)
        response.headers["Connection"] = "close"  # the rest of the body is not read
        await response(scope, receive, send)


class HeaderTimeoutProtocol(H11Protocol):
    """h11 with a deadline for a request's headers: from the connection's start, and from the first bytes
    of each later request on it; a connection still without complete headers then is closed."""

    header_timeout_s: float = 30.0

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self._header_timer: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.transport.is_closing() or (self.cycle is not None and not self.cycle.response_complete):
            self._cancel_header_timer()  # the headers are in: the body has its own deadline
        else:
            self._arm_header_timer()  # the first bytes of another request

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_timeout)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self.cycle is None or self.cycle.response_complete:
            self.timeout_keep_alive_handler()  # closes the connection


def http_protocol(header_timeout_s: float) -> type[H11Protocol]:
    """The uvicorn `http` protocol class with this header timeout."""
    return type("HeaderTimeoutProtocol", (HeaderTimeoutProtocol,), {"header_timeout_s": header_timeout_s})


def special_token_pattern(tokenizer) -> re.Pattern | None:
    """A pattern matching any special (control) token string of `tokenizer`, or None when it has none."""
    if tokenizer is None:
        return None
    specials = set(getattr(tokenizer, "all_special_tokens", []) or [])
    for token in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(token, "special", False):
            specials.add(token.content)
    specials.discard("")
    if not specials:
        return None
    # Longest first, so a token that begins another is not matched in its place.
    return re.compile("|".join(re.escape(t) for t in sorted(specials, key=len, reverse=True)))


class PromptBound:
    """Refuses a prompt text certain to exceed the context before it is tokenized in full, so no request
    holds a tokenizer thread for seconds only to be told no.

    Two bounds, built from the tokenizer at start: no token covers more characters than the longest
    string of its vocabulary, so a text longer than `max_model_len` times that is too long untokenized;
    past 16 characters a token of context, only a prefix is tokenized (cut before a space, where the
    tokenizers' pre-tokenization splits, less a margin for the piece at the cut), and a prefix that is
    already too long refuses the whole.
    """

    PREFIX_CHARS_PER_TOKEN = 16
    MARGIN_TOKENS = 16

    def __init__(self, tokenizer, max_model_len: int):
        self.max_model_len = max_model_len
        vocab = tokenizer.get_vocab() if tokenizer is not None else {}
        self.max_token_chars = max((len(token) for token in vocab), default=0)

    def check(self, text: str, count_tokens: Callable[[str], int]) -> None:
        """SpecserveError when `text` surely holds at least `max_model_len` tokens; `count_tokens`
        tokenizes a piece of it."""
        limit = self.max_model_len
        if self.max_token_chars and len(text) >= limit * self.max_token_chars:
            raise SpecserveError(
                f"the prompt has {len(text)} characters, so at least {len(text) // self.max_token_chars} "
                f"tokens (no token of this tokenizer spans more than {self.max_token_chars}); max_model_len "
                f"is {limit}",
                "prompt",
            )
        prefix = self.PREFIX_CHARS_PER_TOKEN * (limit + self.MARGIN_TOKENS)
        if len(text) <= prefix:
            return
        cut = text.rfind(" ", 0, prefix)
        cut = cut if cut > 0 else prefix
        counted = count_tokens(text[:cut]) - self.MARGIN_TOKENS
        if counted >= limit:
            raise SpecserveError(
                f"the prompt has more than {counted} tokens (counted in its first {cut} of {len(text)} "
                f"characters); max_model_len is {limit}, so at most {limit - 1} prompt tokens leave room for "
                "one generated token",
                "prompt",
            )
