"""The engine loop on its own thread, and one async stream of updates per HTTP request.

`LLMEngine` is not thread-safe, so a single thread owns it: between steps that thread drains a queue of
commands (admit requests, abort them, drain, stop), then runs one `step()` that batches every live request,
and hands each update to the asyncio queue of the HTTP request it belongs to. Handlers only submit, read
their stream and close it. Torch releases the GIL inside a step, so the event loop keeps answering while
the engine computes.

Prompts are rendered (chat template) and tokenized before they reach the engine thread, in a small pool of
tokenizer threads with its own bound, so one huge prompt delays nobody else's tokens: the engine thread
only checks the token ids it is given. The tokenizer is only read there (no padding or truncation is ever
set on it), which its Rust backend allows from several threads. A prompt text certain to exceed the
context is refused there before it is tokenized in full (`PromptBound`).

Output constraints (and the tool schemas a request carries) compile before that, on the grammar
compiler's own workers, within a time limit; a request whose client leaves drops its compiles still
waiting. The tokenizer's grammar view is built by `start()`, before the server serves anything.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TypeVar

from specserve.config import SamplingParams, SpecserveError, StructuredOutputsParams
from specserve.core.sequence import RequestMetrics, Sequence
from specserve.core.spec_stats import SpecStats
from specserve.engine.engine import LLMEngine, PromptType
from specserve.engine.input_processor import check_prompt_fits
from specserve.engine.outputs import CompletionOutput, RequestOutput
from specserve.parallel.group import TensorParallelError
from specserve.server.limits import PromptBound
from specserve.server.protocol import RequestFieldError
from specserve.structured.grammar import ConstraintError, Grammar, RequestGrammar

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RenderedText:
    """A prompt a chat template rendered: it wrote the special tokens itself, so tokenizing adds none."""

    text: str


# A prompt, or a function that builds one; functions run on a tokenizer thread.
PromptSource = PromptType | Callable[[], PromptType | RenderedText]

T = TypeVar("T")

IDLE_WAIT_S = 0.5  # how long an idle engine thread sleeps on its command queue before looking around


class EngineOverloaded(Exception):
    """The queue bound is reached; the client should retry later (HTTP 429)."""


class EngineUnavailable(Exception):
    """The server is shutting down or its engine loop died (HTTP 503)."""


class RequestFailed(Exception):
    """The engine failed while it ran this request (HTTP 500); other requests go on."""


@dataclass
class EngineRequest:
    """One completion to generate: one choice of an HTTP request."""

    prompt: PromptSource
    params: SamplingParams
    # The client set max_tokens itself: a prompt that leaves less room than that is an error, not a clamp.
    strict_max_tokens: bool = False
    constraint_field: str | None = None  # the request field that holds params.structured_outputs
    grammar: RequestGrammar | None = None  # that constraint, compiled (set by AsyncEngine.submit)


@dataclass
class EngineUpdate:
    """What changed in one choice during one engine step."""

    index: int
    output: CompletionOutput
    num_prompt_tokens: int
    num_cached_tokens: int
    metrics: RequestMetrics
    finished: bool
    num_drafts: int  # this choice's verification rounds and accepted draft tokens so far
    num_accepted_tokens: int
    prompt_token_ids: list[int] = dataclasses.field(default_factory=list)
    prompt_logprobs: list[dict[int, float] | None] | None = None  # when asked for (echo with logprobs)
    spec_stats: SpecStats | None = None  # a copy of the choice's, with per-request spec decode metrics


@dataclass(frozen=True)
class EngineSnapshot:
    """Engine gauges and counters as of the end of the latest loop turn (read by /metrics, any thread)."""

    num_running: int = 0
    num_waiting: int = 0
    num_used_blocks: int = 0
    num_blocks: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache, and found there
    prefix_cache_hits: int = 0
    spec: SpecStats = dataclasses.field(default_factory=SpecStats)
    calibration_ece: list[float] = dataclasses.field(default_factory=list)  # live ECE per draft position


class RequestStream:
    """The updates of one HTTP request's choices, in order; iterate it, then `close()` it (always)."""

    def __init__(self, owner: AsyncEngine, request_id: str, num_choices: int):
        self.request_id = request_id
        self.engine_ids = [f"{request_id}-{i}" for i in range(num_choices)]
        self._owner = owner
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[EngineUpdate | Exception] = asyncio.Queue()
        self.admitted: asyncio.Future[None] = self._loop.create_future()
        self._unfinished = set(range(num_choices))
        self._closed = False

    # ---- engine thread side ---------------------------------------------------------------------------
    def push(self, item: EngineUpdate | Exception) -> None:
        self._call_soon(self._queue.put_nowait, item)

    def settle_admission(self, error: Exception | None) -> None:
        self._call_soon(_settle, self.admitted, error)

    def _call_soon(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    # ---- handler side ---------------------------------------------------------------------------------
    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> EngineUpdate:
        if not self._unfinished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, Exception):  # RequestFailed, or EngineUnavailable when the engine stopped
            raise item
        if item.finished:
            self._unfinished.discard(item.index)
        return item

    def close(self) -> None:
        """Abort whatever has not finished (freeing its KV at once) and give back its queue slots."""
        if self._closed:
            return
        self._closed = True
        if self._unfinished:
            self._owner.abort([self.engine_ids[i] for i in self._unfinished])
        self._owner.release(len(self.engine_ids))


def _settle(future: asyncio.Future, error: Exception | None) -> None:
    if future.done():  # the handler gave up waiting (its client went away)
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


@dataclass
class _Live:
    stream: RequestStream
    index: int
    seq: Sequence


@dataclass
class _Submit:
    stream: RequestStream
    requests: list[EngineRequest]


@dataclass
class _Abort:
    engine_ids: list[str]


@dataclass
class _Drain:
    deadline: float


class _Stop:
    pass


class AsyncEngine:
    """Runs `engine` on a background thread and lets async handlers submit requests and stream updates.

    At most `max_num_seqs + max_waiting` choices are in flight; beyond that `submit` raises
    EngineOverloaded. `log_stats_interval_s` spaces the periodic engine-stats log lines.
    `per_request_spec_decode_metrics`: each update carries its choice's speculative counters (for the
    response's usage).
    """

    def __init__(
        self,
        engine: LLMEngine,
        max_waiting: int = 256,
        log_stats_interval_s: float = 10.0,
        tokenizer_workers: int = 2,
        max_pending_tokenization: int = 256,
        per_request_spec_decode_metrics: bool = False,
    ):
        self.engine = engine
        self.prompt_bound = PromptBound(engine.tokenizer, engine.max_model_len)
        self.per_request_spec_decode_metrics = per_request_spec_decode_metrics
        self.capacity = engine.config.max_num_seqs + max_waiting
        # HTTP requests being (or waiting to be) tokenized, at most `max_pending_tokenization`; more get 429.
        self.max_pending_tokenization = max_pending_tokenization
        self._num_tokenizing = 0
        self._tokenizers = concurrent.futures.ThreadPoolExecutor(
            max_workers=tokenizer_workers, thread_name_prefix="specserve-tokenizer"
        )
        self.log_stats_interval_s = log_stats_interval_s
        self.snapshot = EngineSnapshot(num_blocks=engine.block_manager.num_blocks)
        self.draining = False
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="specserve-engine", daemon=True)
        self._num_in_flight = 0  # choices submitted and not yet closed; touched only on the event loop
        # Owned by the engine thread:
        self._live: dict[str, _Live] = {}
        self._stopped = False
        self._drain_deadline: float | None = None
        self._stats_window = _StatsWindow(time.monotonic(), SpecStats())

    # ---- event loop side -------------------------------------------------------------------------------
    def start(self) -> None:
        """Build the grammar compiler's tokenizer view (seconds, holding the GIL: no stream may wait on
        it later) and start the engine thread."""
        self.engine.grammars.prepare()
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    async def submit(
        self,
        request_id: str,
        requests: list[EngineRequest],
        schema_checks: list[tuple[str, StructuredOutputsParams]] = (),
        compile_timeout_s: float = 10.0,
    ) -> RequestStream:
        """Validate and queue every choice of one HTTP request (all or none); SpecserveError when invalid.
        `schema_checks`: (field, constraint) pairs that must compile too (a request's tool schemas); the
        constraints get `compile_timeout_s` to compile."""
        if self.draining or not self.is_alive:
            raise EngineUnavailable("the server is shutting down" if self.draining else "the engine stopped")
        if len(requests) > self.capacity:
            raise SpecserveError(
                f"the request asks for {len(requests)} completions; this server runs at most "
                f"{self.capacity} at once"
            )
        if self._num_in_flight + len(requests) > self.capacity:
            raise EngineOverloaded(f"the server is at its limit of {self.capacity} requests in flight")
        self._check_tokenizing_room()
        self._num_in_flight += len(requests)
        self._num_tokenizing += 1
        try:
            requests = await self._compile(requests, list(schema_checks), compile_timeout_s)
            loop = asyncio.get_running_loop()
            prepared = await loop.run_in_executor(self._tokenizers, self._prepare, requests)
            if self.draining or not self.is_alive:
                raise EngineUnavailable(
                    "the server is shutting down" if self.draining else "the engine stopped"
                )
        except BaseException:  # invalid, or the client left while it waited: give its places back
            self.release(len(requests))
            raise
        finally:
            self._num_tokenizing -= 1
        stream = RequestStream(self, request_id, len(requests))
        self._commands.put(_Submit(stream, prepared))
        try:
            await stream.admitted
        except BaseException:  # rejected, or the client left while waiting: undo whatever was queued
            stream.close()
            raise
        return stream

    async def on_tokenizer(self, job: Callable[[], T]) -> T:
        """`job()` (tokenizing or decoding text) on a tokenizer thread, within the same bound as prompts."""
        self._check_tokenizing_room()
        self._num_tokenizing += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._tokenizers, job)
        finally:
            self._num_tokenizing -= 1

    def _check_tokenizing_room(self) -> None:
        if self._num_tokenizing >= self.max_pending_tokenization:
            raise EngineOverloaded(
                f"the server is at its limit of {self.max_pending_tokenization} requests being tokenized"
            )

    def abort(self, engine_ids: list[str]) -> None:
        self._commands.put(_Abort(engine_ids))

    def release(self, num_choices: int) -> None:
        self._num_in_flight -= num_choices

    @property
    def num_in_flight(self) -> int:
        """Choices submitted (or being tokenized) and not yet closed."""
        return self._num_in_flight

    async def _compile(
        self,
        requests: list[EngineRequest],
        checks: list[tuple[str, StructuredOutputsParams]],
        timeout_s: float,
    ) -> list[EngineRequest]:
        """`requests` with their constraints compiled, and every check compiled, on the grammar workers
        (each distinct constraint once); a RequestFieldError names the field of one that does not compile
        in time. Cancelled (its client left), it drops the compiles still waiting for a worker."""
        jobs: dict[tuple[str, str], concurrent.futures.Future[Grammar]] = {}
        constrained = [r for r in requests if r.params.structured_outputs is not None]
        for field, params in checks + [
            (r.constraint_field, r.params.structured_outputs) for r in constrained
        ]:
            key = (field, repr(params))
            if key not in jobs:
                jobs[key] = self.engine.grammars.submit(params)
        if not jobs:
            return requests
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        grammars: dict[tuple[str, str], Grammar] = {}
        try:
            for (field, params_key), future in jobs.items():
                try:
                    remaining = max(0.0, deadline - loop.time())
                    grammars[field, params_key] = await asyncio.wait_for(
                        asyncio.wrap_future(future), remaining
                    )
                except ConstraintError as exc:
                    raise RequestFieldError(field, exc.reason) from None
                except TimeoutError:
                    raise RequestFieldError(
                        field,
                        f"did not compile within {timeout_s:g} s (--grammar-compile-timeout); simplify it",
                    ) from None
        finally:
            for future in jobs.values():
                future.cancel()  # those no worker took yet
        return [
            dataclasses.replace(
                r, grammar=grammars[r.constraint_field, repr(r.params.structured_outputs)].start()
            )
            if r.params.structured_outputs is not None
            else r
            for r in requests
        ]

    # ---- tokenizer threads ----------------------------------------------------------------------------
    def _prepare(self, requests: list[EngineRequest]) -> list[EngineRequest]:
        """Every choice's prompt as checked token ids (choices of one prompt share its tokenization)."""
        max_len = self.engine.max_model_len
        prepared: list[EngineRequest] = []
        last_source, last_ids = None, None
        for request in requests:
            if last_ids is None or request.prompt is not last_source:
                last_source = request.prompt
                with the_requests_fault("the prompt could not be tokenized", "prompt"):
                    last_ids = self._token_ids(_build(request.prompt))
                check_prompt_fits(len(last_ids), max_len)
            max_tokens = request.params.max_tokens
            if request.strict_max_tokens and max_tokens and len(last_ids) + max_tokens > max_len:
                total = len(last_ids) + max_tokens
                raise SpecserveError(
                    f"max_model_len is {max_len} tokens, but this request asks for {total} ({len(last_ids)} "
                    f"in the prompt, max_tokens {max_tokens}); shorten the prompt or lower max_tokens",
                    "max_tokens",
                )
            prepared.append(dataclasses.replace(request, prompt={"prompt_token_ids": last_ids}))
        return prepared

    def _token_ids(self, prompt: PromptType | RenderedText) -> list[int]:
        """A prompt's token ids; a text certain to exceed the context is refused before it is tokenized
        in full."""
        tokenizer = self.engine.tokenizer
        if isinstance(prompt, RenderedText):
            self.prompt_bound.check(
                prompt.text, lambda text: len(tokenizer(text, add_special_tokens=False).input_ids)
            )
            return tokenizer(prompt.text, add_special_tokens=False).input_ids
        if isinstance(prompt, str) and tokenizer is not None:
            self.prompt_bound.check(prompt, lambda text: len(tokenizer(text).input_ids))
        return self.engine.input_processor.tokenize(prompt)[0]

    def begin_drain(self, timeout_s: float) -> None:
        """Refuse new requests; let live ones finish for `timeout_s`, then abort them.

        Safe to call from a signal handler (it only sets a flag and puts on a SimpleQueue).
        """
        self.draining = True
        self._commands.put(_Drain(time.monotonic() + timeout_s))

    async def stop(self, timeout_s: float = 30.0) -> None:
        """Abort what is left, stop the thread and wait for it (a step in progress finishes first)."""
        if self.is_alive:
            self._commands.put(_Stop())
            await asyncio.to_thread(self._thread.join, timeout_s)
        self._tokenizers.shutdown(wait=False, cancel_futures=True)

    # ---- engine thread ---------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopped:
                self._apply_commands(wait=not self.engine.has_unfinished)
                if self._drain_deadline is not None and time.monotonic() >= self._drain_deadline:
                    self._abort_all()
                outputs = self._step() if self.engine.has_unfinished and not self._stopped else []
                # Publish before delivering, so a client that saw an update sees gauges at least as fresh.
                self._publish_snapshot()
                for output in outputs:
                    self._deliver(output)
                self._log_stats_when_due()
        except BaseException:
            logger.exception("the engine loop crashed; failing every live request")
            self._fail(list(self._live), "the engine loop crashed")
            raise

    def _apply_commands(self, wait: bool) -> None:
        try:
            command = self._commands.get(timeout=IDLE_WAIT_S) if wait else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply(self, command) -> None:
        match command:
            case _Submit(stream, requests):
                self._admit(stream, requests)
            case _Abort(engine_ids):
                for engine_id in engine_ids:
                    if self._live.pop(engine_id, None) is not None:
                        self.engine.abort(engine_id)
            case _Drain(deadline):
                self._drain_deadline = deadline
            case _Stop():
                self._abort_all()
                self._stopped = True

    def _admit(self, stream: RequestStream, requests: list[EngineRequest]) -> None:
        try:
            seqs = [
                self.engine.make_sequence(_build(r.prompt), r.params, engine_id, r.grammar)
                for r, engine_id in zip(requests, stream.engine_ids)
            ]
        except Exception as exc:  # anything wrong with one request is that request's 400, not the server's
            if not isinstance(exc, SpecserveError):
                logger.warning("request %s failed validation", stream.request_id, exc_info=True)
            stream.settle_admission(exc)
            return
        for index, seq in enumerate(seqs):
            self.engine.add_sequence(seq)
            self._live[seq.request_id] = _Live(stream, index, seq)
        stream.settle_admission(None)

    def _step(self) -> list[RequestOutput]:
        try:
            return self.engine.step()
        except TensorParallelError as exc:  # a rank died or hung: this engine cannot step again
            logger.error("the engine stopped: %s", exc)
            self._fail(list(self._live), f"the engine stopped: {exc}", EngineUnavailable)
            self._stopped = True
            return []
        except Exception as exc:
            logger.exception("engine step failed; failing the requests it was running")
            running = [s.request_id for s in self.engine.scheduler.running]
            # A failure outside any running request (say, while scheduling) would repeat forever: fail all.
            self._fail(running or list(self._live), f"the engine failed while running this request: {exc}")
            return []

    def _deliver(self, output: RequestOutput) -> None:
        live = self._live.get(output.request_id)
        if live is None:
            return
        if output.finished:
            del self._live[output.request_id]
        if output.error is not None:  # the engine ended it with finish_reason "error": an HTTP 500
            live.stream.push(RequestFailed(output.error))
            return
        completion = output.outputs[0]
        self._stats_window.generated_tokens += len(completion.delta_token_ids or [])
        # A copy (total of one): this thread goes on counting while the handler reads it.
        spec_stats = SpecStats.total([output.spec_stats]) if self.per_request_spec_decode_metrics else None
        live.stream.push(
            EngineUpdate(
                index=live.index,
                output=completion,
                num_prompt_tokens=len(output.prompt_token_ids),
                num_cached_tokens=output.num_cached_tokens,
                metrics=output.metrics,
                finished=output.finished,
                num_drafts=live.seq.spec_stats.num_drafts,
                num_accepted_tokens=live.seq.spec_stats.num_accepted_tokens,
                prompt_token_ids=output.prompt_token_ids,
                prompt_logprobs=output.prompt_logprobs,
                spec_stats=spec_stats,
            )
        )

    def _abort_all(self) -> None:
        """End every live request now with finish_reason "abort", telling its handler."""
        for engine_id, live in list(self._live.items()):
            self.engine.abort(engine_id)
            self._deliver(self.engine.final_output(live.seq))

    def _fail(self, engine_ids: list[str], message: str, error: type[Exception] = RequestFailed) -> None:
        for engine_id in engine_ids:
            live = self._live.pop(engine_id, None)
            try:
                self.engine.abort(engine_id)  # frees its KV blocks
            except Exception:
                logger.exception("aborting failed request %s", engine_id)
            if live is not None:
                live.stream.push(error(message))

    def _publish_snapshot(self) -> None:
        stats, spec = self.engine.spec_stats, self.engine.speculator
        self.snapshot = EngineSnapshot(
            num_running=len(self.engine.scheduler.running),
            num_waiting=len(self.engine.scheduler.waiting),
            num_used_blocks=self.engine.block_manager.num_used_blocks,
            num_blocks=self.engine.block_manager.num_blocks,
            prefix_cache_queries=self.engine.caches.prefix_queries,
            prefix_cache_hits=self.engine.caches.prefix_hits,
            spec=dataclasses.replace(stats, accepted_per_position=list(stats.accepted_per_position)),
            calibration_ece=spec.calibration.ece_per_position() if spec is not None else [],
        )

    def _log_stats_when_due(self) -> None:
        now = time.monotonic()
        window = self._stats_window
        if now - window.start < self.log_stats_interval_s:
            return
        snap = self.snapshot
        if window.generated_tokens or snap.num_running or snap.num_waiting:
            drafts = snap.spec.num_drafts - window.spec.num_drafts
            accepted = snap.spec.num_accepted_tokens - window.spec.num_accepted_tokens
            tau = f", tau {1 + accepted / drafts:.2f}" if drafts else ""
            logger.info(
                "engine: %d running, %d waiting, KV blocks %d/%d (%.1f%%), %.1f generated tokens/s%s",
                snap.num_running,
                snap.num_waiting,
                snap.num_used_blocks,
                snap.num_blocks,
                100 * snap.num_used_blocks / max(1, snap.num_blocks),
                window.generated_tokens / (now - window.start),
                tau,
            )
        self._stats_window = _StatsWindow(now, snap.spec)


@dataclass
class _StatsWindow:
    """Counters since the last engine-stats log line."""

    start: float
    spec: SpecStats
    generated_tokens: int = 0


@contextmanager
def the_requests_fault(what: str, param: str) -> Iterator[None]:
    """An error of the tokenizer or the chat template on a request's text (its `param`) is that request's
    400 (a SpecserveError saying `what`), not the server's 500."""
    try:
        yield
    except SpecserveError:
        raise
    except Exception as exc:
        raise SpecserveError(f"{what}: {type(exc).__name__}: {exc}", param) from exc


def _build(prompt: PromptSource) -> PromptType | RenderedText:
    return prompt() if callable(prompt) else prompt
