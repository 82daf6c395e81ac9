"""Servers for the server tests: the app in-process (uvicorn on a free port, in a thread) or a real
`specserve serve` process, metric scraping, and a small SSE reader."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from specserve import LLM
from specserve.engine.engine import LLMEngine
from specserve.local_port import free_local_port
from specserve.server import AsyncEngine, build_app
from specserve.server.launch import DrainingServer, uvicorn_config
from specserve.server.limits import ServerLimits

MODEL_NAME = "tiny"
REPO_ROOT = Path(__file__).resolve().parents[1]


def make_client(url: str, api_key: str = "unused") -> openai.OpenAI:
    """The official openai client of a server at `url`, without retries (a test sees the first answer)."""
    return openai.OpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0)


def chat_server_fixtures(build_model: Callable[[Path], Path], max_model_len: int):
    """The module-scoped fixtures of the server tests, for a module to bind at its top level:
    `model_dir` (`build_model` into a fresh directory), `server` (running on it), `client` (the openai
    client of that server) and `llm` (the same model without a server, for reference outputs)."""

    @pytest.fixture(scope="module", name="model_dir")
    def model_dir_fixture(tmp_path_factory):
        return build_model(tmp_path_factory.mktemp("model"))

    @pytest.fixture(scope="module", name="server")
    def server_fixture(model_dir):
        with running_server(model_dir, max_model_len=max_model_len) as srv:
            yield srv

    @pytest.fixture(scope="module", name="client")
    def client_fixture(server):
        return make_client(server.url)

    @pytest.fixture(scope="module", name="llm")
    def llm_fixture(model_dir):
        return LLM(str(model_dir), max_model_len=max_model_len, kv_cache_memory="16MiB")

    return model_dir_fixture, server_fixture, client_fixture, llm_fixture


@dataclass
class RunningServer:
    url: str
    engine: LLMEngine
    async_engine: AsyncEngine
    server: uvicorn.Server

    def metrics(self) -> dict[tuple[str, tuple], float]:
        return scrape(self.url)

    def metric(self, name: str, **labels: str) -> float:
        return self.metrics()[(name, tuple(sorted(labels.items())))]


@contextmanager
def running_server(
    model_dir,
    *,
    api_key: str | None = None,
    max_waiting: int = 256,
    speculative_config=None,
    limits: ServerLimits | None = None,
    max_pending_tokenization: int = 256,
    drain_timeout_s: float | None = None,
    per_request_spec_decode_metrics: bool = False,
    **engine_args,
) -> Iterator[RunningServer]:
    """The app for a fresh engine on `model_dir`, served on 127.0.0.1 until the block exits; with
    `drain_timeout_s`, by `specserve serve`'s DrainingServer (`srv.server.handle_exit` then drains)."""
    engine_args.setdefault("kv_cache_memory", "16MiB")
    limits = limits or ServerLimits()
    engine = LLMEngine.from_args(str(model_dir), speculative_config, **engine_args)
    async_engine = AsyncEngine(
        engine,
        max_waiting=max_waiting,
        max_pending_tokenization=max_pending_tokenization,
        per_request_spec_decode_metrics=per_request_spec_decode_metrics,
    )
    app = build_app(async_engine, MODEL_NAME, api_key=api_key, limits=limits)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn_config(app, limits, log_level="warning")
    if drain_timeout_s is None:
        server = uvicorn.Server(config)
    else:
        server = DrainingServer(config, async_engine, drain_timeout_s)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield RunningServer(f"http://127.0.0.1:{sock.getsockname()[1]}", engine, async_engine, server)
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """/metrics as {(sample name, sorted label items): value}."""
    text = httpx.get(f"{url}/metrics").text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def wait_until(condition, timeout_s: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def sse_payloads(lines: Iterator[str]) -> Iterator[dict | str]:
    """The `data:` payloads of a server-sent event stream: parsed JSON, or the string "[DONE]"."""
    for line in lines:
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            yield data if data == "[DONE]" else json.loads(data)


@contextmanager
def serve_process(model_dir, log_path: Path, *flags: str) -> Iterator[tuple[subprocess.Popen, str]]:
    """(process, url) of `specserve serve model_dir *flags` launched as users launch it, once it answers
    /health; its output goes to `log_path`. Killed after the block if still running."""
    port = free_local_port()
    command = [sys.executable, "-m", "specserve.cli", "serve", str(model_dir), "--port", str(port), *flags]
    with open(log_path, "w") as log:
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
        server = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        assert server.poll() is None, log_path.read_text()
        try:
            return httpx.get(f"{url}/health").status_code == 200
        except httpx.TransportError:
            # Not listening yet: refused, or reset (seen once while a tensor-parallel server loaded). The
            # server's own failures show in poll() above and in the timeout.
            return False

    try:
        wait_until(healthy, timeout_s=120, what="the server to start")
        yield server, url
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
