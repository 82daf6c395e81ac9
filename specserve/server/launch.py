"""`specserve serve`: load the engine, build the app, run uvicorn, and shut down gracefully on SIGTERM."""

from __future__ import annotations

import logging
import signal
from types import FrameType

import uvicorn

from specserve.config import EngineConfig
from specserve.engine.engine import LLMEngine
from specserve.server.app import build_app
from specserve.server.async_engine import AsyncEngine

logger = logging.getLogger(__name__)

# uvicorn's own graceful-shutdown timeout, past our drain: a backstop that cancels what still hangs on.
UVICORN_SHUTDOWN_MARGIN_S = 5.0


class DrainingServer(uvicorn.Server):
    """On SIGTERM or SIGINT: stop accepting (uvicorn closes the socket), let live requests finish for
    `drain_timeout_s`, then abort the rest, so every stream ends with a finish reason and [DONE].

    uvicorn re-raises a caught SIGTERM once it has shut down, so the process would die of it (status 143);
    a server that drained cleanly exits 0 instead.
    """

    def __init__(self, config: uvicorn.Config, async_engine: AsyncEngine, drain_timeout_s: float):
        super().__init__(config)
        self.async_engine = async_engine
        self.drain_timeout_s = drain_timeout_s

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.async_engine.draining:
            logger.info("signal %d: draining for up to %.0fs", sig, self.drain_timeout_s)
            self.async_engine.begin_drain(self.drain_timeout_s)
        if sig == signal.SIGTERM:
            self.should_exit = True
        else:
            super().handle_exit(sig, frame)


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
    **engine_args,
) -> int:
    """Serve `model` until SIGTERM or Ctrl-C; returns the exit status. `engine_args` go to EngineConfig."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine = LLMEngine(EngineConfig(model=model, **engine_args), speculative_config)
    async_engine = AsyncEngine(engine, max_waiting=max_waiting, log_stats_interval_s=log_stats_interval_s)
    app = build_app(async_engine, served_model_name or model, api_key=api_key)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        access_log=False,  # the app logs one line per request itself, with token counts and timings
        timeout_graceful_shutdown=drain_timeout_s + UVICORN_SHUTDOWN_MARGIN_S,
    )
    DrainingServer(config, async_engine, drain_timeout_s).run()
    return 0
