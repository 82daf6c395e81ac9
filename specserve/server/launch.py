"""`specserve serve`: load the engine, build the app, run uvicorn, and shut down gracefully on SIGTERM."""

from __future__ import annotations

import logging
import signal
import socket
import time
from types import FrameType

import uvicorn

from specserve.config import SpecserveError, check
from specserve.engine.engine import LLMEngine
from specserve.llm import loaded_line
from specserve.server.app import build_app
from specserve.server.async_engine import AsyncEngine
from specserve.server.limits import ServerLimits, http_protocol

logger = logging.getLogger(__name__)

# uvicorn's own graceful-shutdown timeout, past our drain: a backstop that cancels what still hangs on.
UVICORN_SHUTDOWN_MARGIN_S = 5.0


class DrainingServer(uvicorn.Server):
    """On SIGTERM or SIGINT: drain. New requests get 503 with Retry-After (the socket stays open, so clients
    and load balancers see it), live ones get `drain_timeout_s` to finish, then the rest are aborted (their
    streams end with a finish reason and [DONE]); once nothing is in flight, uvicorn shuts down. A second
    signal shuts down at once (uvicorn's own handling: a third Ctrl-C stops waiting for connections).

    uvicorn re-raises a caught SIGTERM once it has shut down, so the process would die of it (status 143);
    a server that drained cleanly exits 0 instead.
    """

    def __init__(self, config: uvicorn.Config, async_engine: AsyncEngine, drain_timeout_s: float):
        super().__init__(config)
        self.async_engine = async_engine
        self.drain_timeout_s = drain_timeout_s
        self._drain_deadline: float | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        for sock in sockets or ():  # uvicorn names the address only of the sockets it binds itself
            host, port = sock.getsockname()[:2]
            host = f"[{host}]" if ":" in host else host  # an IPv6 address, as URLs write it
            logger.info("ready: serving on http://%s:%d (Ctrl+C or SIGTERM to stop)", host, port)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.async_engine.draining:
            logger.info("signal %d: draining for up to %.0fs", sig, self.drain_timeout_s)
            self.async_engine.begin_drain(self.drain_timeout_s)
            self._drain_deadline = time.monotonic() + self.drain_timeout_s
        elif sig == signal.SIGTERM:
            self.should_exit = True
        else:
            super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        if await super().on_tick(counter):
            return True
        if self._drain_deadline is None:
            return False
        if self.async_engine.num_in_flight == 0:
            return True
        # A backstop: past the deadline the engine aborts what is left, and its handlers end at once.
        return time.monotonic() > self._drain_deadline + UVICORN_SHUTDOWN_MARGIN_S


def uvicorn_config(app, limits: ServerLimits, **kwargs) -> uvicorn.Config:
    """uvicorn's config for `app` with the limits' timeouts: idle keep-alive, and headers (the body's
    deadline is the app's `RequestBodyLimit`)."""
    return uvicorn.Config(
        app,
        http=http_protocol(limits.request_read_timeout_s),
        timeout_keep_alive=limits.timeout_keep_alive_s,
        access_log=False,  # the app logs one line per request itself, with token counts and timings
        **kwargs,
    )


def bound_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound before the model loads: a taken port or a bad address fails in a moment,
    not after the load. Connections are refused until uvicorn listens on it, once the engine is ready."""
    check(0 <= port <= 65535, f"port must be in 0..65535, got {port}")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise SpecserveError(f"cannot serve on {host}:{port}: {exc.strerror or exc}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: restarts reuse the port
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise SpecserveError(f"cannot serve on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def check_server_args(max_waiting: int, drain_timeout_s: float, log_stats_interval_s: float, workers: int):
    check(max_waiting >= 0, f"max_waiting must be >= 0, got {max_waiting}")
    check(drain_timeout_s >= 0, f"drain_timeout_s must be >= 0, got {drain_timeout_s}")
    check(log_stats_interval_s > 0, f"log_stats_interval_s must be > 0, got {log_stats_interval_s}")
    check(workers >= 1, f"tokenizer_workers must be >= 1, got {workers}")


def serve(
    model: str,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    served_model_name: str | None = None,
    speculative_config: str | dict | None = None,
    max_waiting: int = 256,
    drain_timeout_s: float = 30.0,
    log_stats_interval_s: float = 10.0,
    limits: ServerLimits | None = None,
    tokenizer_workers: int = 2,
    per_request_spec_decode_metrics: bool = False,
    **engine_args,
) -> int:
    """Serve `model` until SIGTERM or Ctrl-C; returns the exit status. `engine_args` go to EngineConfig."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    limits = limits or ServerLimits()
    check_server_args(max_waiting, drain_timeout_s, log_stats_interval_s, tokenizer_workers)
    with bound_socket(host, port) as listening:
        start = time.monotonic()
        logger.info("loading %s ...", model)
        engine = LLMEngine.from_args(model, speculative_config, **engine_args)
        logger.info("%s", loaded_line(engine, time.monotonic() - start))
        async_engine = AsyncEngine(
            engine,
            max_waiting=max_waiting,
            log_stats_interval_s=log_stats_interval_s,
            tokenizer_workers=tokenizer_workers,
            per_request_spec_decode_metrics=per_request_spec_decode_metrics,
        )
        app = build_app(async_engine, served_model_name or model, api_key=api_key, limits=limits)
        config = uvicorn_config(
            app,
            limits,
            host=host,
            port=port,
            timeout_graceful_shutdown=drain_timeout_s + UVICORN_SHUTDOWN_MARGIN_S,
        )
        try:
            DrainingServer(config, async_engine, drain_timeout_s).run(sockets=[listening])
        finally:
            engine.close()  # tensor-parallel workers
    return 0
