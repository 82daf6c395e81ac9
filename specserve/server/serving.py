"""Serving one generation over HTTP: submit its choices, answer with one JSON response or a stream of
server-sent events, and free the engine's work the moment the client goes away.

A client that disconnects while its request is being admitted (its constraints compiling, its prompt
tokenized) cancels the admission, and its compiles still waiting for a worker are dropped. Later, a
streaming client that disconnects cancels the response's generator (Starlette watches the socket); a
non-streaming one is watched here while the completion is collected. Either way the stream is closed,
which aborts unfinished choices in the engine and frees their KV blocks at once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

from fastapi import Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from specserve.config import SpecserveError
from specserve.server.async_engine import AsyncEngine, EngineUnavailable, RequestFailed, RequestStream
from specserve.server.generation import Generation
from specserve.server.metrics import ServerMetrics
from specserve.server.protocol import ErrorInfo, ErrorResponse

T = TypeVar("T")


async def serve_generation(
    generation: Generation, engine: AsyncEngine, request: Request, metrics: ServerMetrics
) -> Response:
    """Raises SpecserveError (400), EngineOverloaded (429), EngineUnavailable (503), RequestFailed (500)."""
    arrival = time.monotonic()
    try:
        submitting = engine.submit(
            generation.id,
            generation.engine_requests(),
            generation.schema_checks(),
            generation.limits.grammar_compile_timeout_s,
        )
        stream = await _unless_disconnected(submitting, request)
    except SpecserveError as exc:  # the engine names its own arguments: name the request's fields
        exc.param = generation.field_of(exc.param)
        raise
    if stream is None:  # the client left while its constraints compiled or its prompt was tokenized
        metrics.record_request(generation.id, arrival, [], generation.usage(), "aborted")
        return Response(status_code=499)
    if generation.stream:
        return _EventStream(generation, stream, arrival, metrics)
    outcome = "aborted"
    try:
        if not await _collect_unless_disconnected(generation, stream, request):
            return Response(status_code=499)  # nobody is there to read it
        outcome = _outcome(generation)
        return JSONResponse(generation.response().model_dump(mode="json"))
    except RequestFailed:
        outcome = "error"
        raise
    finally:
        stream.close()
        metrics.record_request(
            generation.id, arrival, generation.latest.values(), generation.usage(), outcome
        )


class _EventStream(StreamingResponse):
    """Server-sent events of one generation; however the response ends (done, failed, or cancelled
    because the client left or the server is stopping), the engine stream is closed on the way out."""

    def __init__(self, generation: Generation, stream: RequestStream, arrival: float, metrics: ServerMetrics):
        self._generation = generation
        self._stream = stream
        self._arrival = arrival
        self._metrics = metrics
        self._outcome = "aborted"  # unless the events get to the end
        super().__init__(
            self._events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            # Here rather than in the generator: a generator cancelled while suspended at a yield only
            # runs its `finally` when it is garbage-collected, and the KV should be freed now.
            self._stream.close()
            generation = self._generation
            self._metrics.record_request(
                generation.id, self._arrival, generation.latest.values(), generation.usage(), self._outcome
            )

    async def _events(self) -> AsyncIterator[str]:
        generation = self._generation
        try:
            for chunk in generation.opening_chunks():
                yield _event(chunk)
            async for update in self._stream:
                generation.latest[update.index] = update
                for chunk in generation.chunks(update):
                    yield _event(chunk)
            if generation.include_usage:
                yield _event(generation.usage_chunk())
            self._outcome = _outcome(generation)
        except (RequestFailed, EngineUnavailable) as exc:
            self._outcome = "error"
            # The status line went out with the first event; the error travels in the stream, as in vLLM.
            kind = "service_unavailable" if isinstance(exc, EngineUnavailable) else "internal_server_error"
            yield _event(ErrorResponse(error=ErrorInfo(message=str(exc), type=kind)))
        yield "data: [DONE]\n\n"


def _event(payload: BaseModel) -> str:
    return f"data: {payload.model_dump_json()}\n\n"


def _outcome(generation: Generation) -> str:
    reasons = [u.output.finish_reason for u in generation.latest.values()]
    return "aborted" if "abort" in reasons else "completed"


async def _collect_unless_disconnected(
    generation: Generation, stream: RequestStream, request: Request
) -> bool:
    """Record every update of `stream`; False when the client disconnects first."""

    async def collect() -> None:
        async for update in stream:
            generation.latest[update.index] = update

    collector = asyncio.ensure_future(collect())
    watcher = asyncio.ensure_future(_until_disconnected(request))
    try:
        done, _ = await asyncio.wait({collector, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        collector.cancel()
        watcher.cancel()
    if collector in done:
        collector.result()  # raises RequestFailed
        return True
    return False


async def _unless_disconnected(work: Awaitable[T], request: Request) -> T | None:
    """`work`'s result, or None once the client disconnects first (`work` is then cancelled)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task.cancelled():
        return None
    return task.result()


async def _until_disconnected(request: Request) -> None:
    # The body has been read, so the next ASGI message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass
