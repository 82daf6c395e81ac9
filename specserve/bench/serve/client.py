"""The benchmark's HTTP side: streamed /v1/completions requests timed chunk by chunk, sent with a fixed number
in flight, and the server checks around them (reachable, alive, its /metrics).

Requests ask for `ignore_eos` (vLLM's extension, which specserve accepts) so every output has the requested
length, and for the usage chunk (`stream_options.include_usage`), whose token counts are exact where
counting chunks is not.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import httpx

from specserve.bench.serve.datasets import BenchRequest
from specserve.bench.serve.metrics import RequestRecord
from specserve.bench.serve.server_counters import ServerCounters
from specserve.config import SpecserveError

CONNECT_TIMEOUT_S = 10.0
PROBE_TIMEOUT_S = 5.0


class ServerUnreachable(SpecserveError):
    """Nothing answers at the base URL."""


class ServerDied(SpecserveError):
    """The server stopped answering during a run."""


@dataclass
class ServerInfo:
    model: str
    max_model_len: int | None


@dataclass
class RunRecords:
    records: list[RequestRecord]
    duration_s: float
    server_error: str | None = None  # set when the run stopped because the server went away


def open_client(base_url: str, api_key: str | None, request_timeout_s: float) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.AsyncClient(
        base_url=base_url.rstrip("/"),
        headers=headers,
        # The read timeout bounds the gap between two chunks: a queued request's TTFT can be long.
        timeout=httpx.Timeout(request_timeout_s, connect=CONNECT_TIMEOUT_S),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
        trust_env=False,  # a proxy between client and server would distort every timing
    )


async def server_info(client: httpx.AsyncClient) -> ServerInfo:
    """The served model's name and context length from /v1/models; ServerUnreachable when nobody answers."""
    try:
        response = await client.get("/v1/models", timeout=PROBE_TIMEOUT_S)
    except httpx.TransportError as exc:
        raise ServerUnreachable(
            f"cannot reach a server at {client.base_url} ({_describe(exc)}); start one with "
            "`specserve serve MODEL` or check --base-url"
        ) from None
    if response.status_code != 200:
        raise SpecserveError(f"GET {client.base_url}/v1/models answered {_http_error(response)}")
    card = response.json()["data"][0]
    return ServerInfo(model=card["id"], max_model_len=card.get("max_model_len"))


async def is_alive(client: httpx.AsyncClient) -> bool:
    """Whether the server still serves: /health answers below 500 (a draining or dead engine answers 503)."""
    try:
        response = await client.get("/health", timeout=PROBE_TIMEOUT_S)
    except httpx.HTTPError:
        return False
    return response.status_code < 500


async def server_counters(client: httpx.AsyncClient) -> ServerCounters | None:
    """The speculative counters on /metrics; None when the server exports none or does not answer."""
    try:
        response = await client.get("/metrics", timeout=PROBE_TIMEOUT_S)
    except httpx.HTTPError:
        return None
    return ServerCounters.parse(response.text) if response.status_code == 200 else None


async def stream_completion(
    client: httpx.AsyncClient, model: str, request: BenchRequest, temperature: float
) -> RequestRecord:
    """Send one streamed completion and time it; failures end up in the record's `error`, never raised."""
    body = {
        "model": model,
        "prompt": request.prompt_token_ids,
        "max_tokens": request.output_len,
        "temperature": temperature,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    record = RequestRecord(start=time.perf_counter(), turn=request.turn)
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                record.error = _http_error(response)
            else:
                await _read_events(response, record)
    except httpx.HTTPError as exc:
        record.error = _describe(exc)
    record.end = time.perf_counter()
    return record


async def _read_events(response: httpx.Response, record: RequestRecord) -> None:
    finished = False
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line.removeprefix("data:").strip()
        if data == "[DONE]":
            finished = True
            break
        try:
            chunk = json.loads(data)
        except json.JSONDecodeError:
            record.error = f"a stream event is not JSON: {data[:80]!r}"
            return
        if "error" in chunk:
            record.error = f"error event: {chunk['error'].get('message')}"
        choices = chunk.get("choices") or []
        if choices:
            # Every chunk counts, text or not, as in vLLM's client: a detokenizer can hold a whole short
            # output back until the final chunk, and that chunk is still when the tokens arrived.
            record.chunk_times.append(time.perf_counter())
        if any(choice.get("finish_reason") == "abort" for choice in choices):
            record.error = "the server aborted the request"
        if chunk.get("usage"):
            record.prompt_tokens = chunk["usage"]["prompt_tokens"]
            record.output_tokens = chunk["usage"]["completion_tokens"]
    if record.error:
        return
    if not finished:
        record.error = "the stream ended without [DONE]"
    elif not record.output_tokens:
        record.error = "the stream carried no usage (the server must support stream_options.include_usage)"
    elif not record.chunk_times:
        record.error = "the stream carried no choices"


async def run_at_concurrency(
    client: httpx.AsyncClient,
    model: str,
    requests: Iterable[BenchRequest],
    concurrency: int,
    temperature: float,
    on_record: Callable[[RequestRecord], None] = lambda record: None,
) -> RunRecords:
    """Send `requests` with `concurrency` in flight until all are done; the turns of one chat go to one
    worker, in order. A failed request that leaves the server unhealthy stops the run
    (RunRecords.server_error says why); the records so far are kept."""
    pending = chats(requests)  # shared by the workers: each chat goes to exactly one
    records: list[RequestRecord] = []

    async def worker() -> None:
        for chat in pending:
            for request in chat:
                record = await stream_completion(client, model, request, temperature)
                records.append(record)
                on_record(record)
                if record.error and not await is_alive(client):
                    raise _ServerGone(record.error)

    start = time.perf_counter()
    server_error = None
    try:
        async with asyncio.TaskGroup() as group:
            for _ in range(concurrency):
                group.create_task(worker())
    except* _ServerGone as gone:
        server_error = str(gone.exceptions[0])
    return RunRecords(records, time.perf_counter() - start, server_error)


def chats(requests: Iterable[BenchRequest]) -> Iterator[list[BenchRequest]]:
    """Consecutive requests of one conversation as one list; a request of none stands alone."""
    solo = itertools.count()
    key = lambda r: ("chat", r.conversation) if r.conversation is not None else ("solo", next(solo))
    for _, group in itertools.groupby(requests, key=key):
        yield list(group)


class _ServerGone(Exception):
    pass


def _http_error(response: httpx.Response) -> str:
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = response.text[:200]
    return f"HTTP {response.status_code}: {message}"


def _describe(exc: httpx.HTTPError) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
