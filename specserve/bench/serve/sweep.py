"""`specserve bench sweep --config sweep.yaml`: for each server configuration, start `specserve serve`, run
the concurrency sweep against it, stop it; then write the Pareto plot, the tables and the raw results.

A configuration whose server fails to start or dies mid-run is reported and skipped; its partial results stay
in results.jsonl and the report covers everything measured. benchmarks/sweep-cpu-small.yaml shows the
format.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from specserve.bench.serve.benchmark import BenchSettings, benchmark_server
from specserve.bench.serve.client import ServerDied
from specserve.bench.serve.metrics import Sla
from specserve.bench.serve.report import Anchors, write_report
from specserve.config import SpecserveError
from specserve.jsonl import read_jsonl
from specserve.local_port import free_local_port

STOP_TIMEOUT_S = 60.0  # SIGTERM drains live requests (none are left after a run), then we kill
LOG_TAIL_LINES = 15


@dataclass
class ServerConfig:
    name: str
    speculative_config: dict | str | None = None
    server_args: dict = field(default_factory=dict)  # on top of the sweep's own


@dataclass
class SweepConfig:
    model: str
    output_dir: Path
    settings: BenchSettings
    configurations: list[ServerConfig]
    server_args: dict = field(default_factory=dict)
    anchors: Anchors = field(default_factory=Anchors)
    title: str | None = None
    startup_timeout_s: float = 900.0

    @property
    def heading(self) -> str:
        s = self.settings
        return self.title or f"{self.model}: {s.dataset} prompts, {s.input_len} in / {s.output_len} out"


def load_sweep_config(path: Path, output_dir: Path | None = None) -> SweepConfig:
    """Read and check a sweep YAML file; every mistake is a SpecserveError naming the key."""
    import yaml

    try:
        raw = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise SpecserveError(f"cannot read the sweep config {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise SpecserveError(f"{path} is not valid YAML: {exc}") from None
    raw = _mapping(raw, str(path))
    _known_keys(raw, str(path), required={"model", "configurations"}, optional=set(_TOP_LEVEL))
    bench = _mapping(raw.get("benchmark", {}), "benchmark")
    sla = _mapping(bench.pop("sla", {}), "benchmark.sla")
    _known_keys(sla, "benchmark.sla", optional={"ttft_ms", "tpot_ms"})
    if not all(isinstance(v, int | float) and v > 0 for v in sla.values()):
        raise SpecserveError(f"benchmark.sla: bounds are positive milliseconds, got {sla}")
    settings = BenchSettings.from_options(
        sla=Sla(**{f"{k.removesuffix('_ms')}_s": v / 1000 for k, v in sla.items()}), **bench
    )
    anchors = _mapping(raw.get("anchors", {}), "anchors")
    _known_keys(anchors, "anchors", optional={"user_tokens_per_s", "throughput"})
    configurations = []
    for i, item in enumerate(raw["configurations"] or []):
        item = _mapping(item, f"configurations[{i}]")
        _known_keys(
            item, f"configurations[{i}]", required={"name"}, optional={"speculative_config", "server_args"}
        )
        configurations.append(
            ServerConfig(str(item["name"]), item.get("speculative_config"), item.get("server_args") or {})
        )
    startup_timeout_s = raw.get("startup_timeout_s", 900.0)
    if not isinstance(startup_timeout_s, int | float) or startup_timeout_s <= 0:
        raise SpecserveError(
            f"startup_timeout_s must be a positive number of seconds, got {startup_timeout_s!r}"
        )
    names = [c.name for c in configurations]
    if not names or len(set(names)) != len(names):
        raise SpecserveError(f"{path}: configurations need distinct names, got {names}")
    return SweepConfig(
        model=str(raw["model"]),
        output_dir=Path(output_dir or raw.get("output_dir") or "bench-results"),
        settings=settings,
        configurations=configurations,
        server_args=_mapping(raw.get("server_args", {}), "server_args"),
        anchors=Anchors(**anchors),
        title=raw.get("title"),
        startup_timeout_s=float(startup_timeout_s),
    )


_TOP_LEVEL = (
    "model",
    "configurations",
    "output_dir",
    "benchmark",
    "server_args",
    "anchors",
    "title",
    "startup_timeout_s",
)


def _mapping(value, where: str) -> dict:
    if not isinstance(value, dict):
        raise SpecserveError(f"{where} must be a mapping, got {type(value).__name__}")
    return dict(value)


def _known_keys(
    mapping: dict, where: str, required: set[str] = frozenset(), optional: set[str] = frozenset()
) -> None:
    missing = sorted(required - set(mapping))
    unknown = sorted(set(mapping) - required - optional)
    if missing:
        raise SpecserveError(f"{where}: missing {missing}")
    if unknown:
        raise SpecserveError(f"{where}: unknown keys {unknown}; known: {sorted(required | optional)}")


def run_sweep(config: SweepConfig, report_only: bool = False) -> int:
    """Benchmark every configuration (unless `report_only`), then write the report; 2 if any failed."""
    # A terminated sweep unwinds like Ctrl-C, through launch_server's cleanup: without this its server
    # outlived it, holding the model's memory (the next sweep's servers were killed for lack of it).
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        return _run_sweep(config, report_only)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _interrupt(signum, frame) -> None:
    # Ctrl-C's own path: inside the benchmark's event loop, asyncio.run cancels its task and raises
    # KeyboardInterrupt once that has unwound (raised here, in the middle of an await, it broke anyio's
    # cancel scopes in httpx: a traceback instead of exit 130); outside it, Python raises it at once. Where
    # SIGINT is ignored (a background job of a shell) there is no such path: raised here.
    if signal.getsignal(signal.SIGINT) in (signal.SIG_IGN, signal.SIG_DFL, None):
        raise KeyboardInterrupt
    signal.raise_signal(signal.SIGINT)


def _run_sweep(config: SweepConfig, report_only: bool) -> int:
    out = config.output_dir
    results = out / "results.jsonl"
    failures = []
    if not report_only:
        if results.exists():  # keep an earlier sweep's results rather than mixing them into this one
            results.rename(out / f"results-{time.strftime('%Y%m%d-%H%M%S')}.jsonl")
        for server in config.configurations:
            try:
                _benchmark_configuration(config, server, results)
            except SpecserveError as exc:
                failures.append(server.name)
                print(f"error: configuration {server.name}: {exc}", file=sys.stderr)
    if not results.exists():
        raise SpecserveError(f"no results to report: {results} does not exist")
    for path in write_report(read_jsonl(results), out, config.anchors, config.heading):
        print(f"wrote {path}")
    if failures:
        print(f"error: configurations that did not finish: {', '.join(failures)}", file=sys.stderr)
        return 2
    return 0


def _benchmark_configuration(config: SweepConfig, server: ServerConfig, results: Path) -> None:
    log = config.output_dir / f"server-{re.sub(r'[^A-Za-z0-9_.-]+', '_', server.name)}.log"
    args = {**config.server_args, **server.server_args}
    print(f"== {server.name}: starting the server (log: {log})", flush=True)
    with launch_server(
        config.model, server.speculative_config, args, log, config.startup_timeout_s
    ) as launched:
        try:
            asyncio.run(
                benchmark_server(
                    launched.url,
                    config.settings,
                    results,
                    label=server.name,
                    tokenizer=config.model,
                    extra={"speculative_config": server.speculative_config, "server_args": args},
                )
            )
        except ServerDied as exc:
            raise ServerDied(f"{exc}; {launched.status()}") from None


@dataclass
class LaunchedServer:
    url: str
    process: subprocess.Popen
    log: Path

    def status(self) -> str:
        code = self.process.poll()
        state = "is still running" if code is None else f"exited with status {code}"
        return f"the server process {state} (log: {self.log})"


@contextmanager
def launch_server(
    model: str, speculative_config: dict | str | None, server_args: dict, log: Path, startup_timeout_s: float
) -> Iterator[LaunchedServer]:
    """`specserve serve` in a child process on a free local port, healthy on entry, stopped on exit."""
    port = free_local_port()
    command = [
        sys.executable,
        "-m",
        "specserve.cli",
        "serve",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    if speculative_config is not None:
        spec = speculative_config if isinstance(speculative_config, str) else json.dumps(speculative_config)
        command += ["--speculative-config", spec]
    command += _flags(server_args)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as log_file:
        process = subprocess.Popen(
            command, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
    launched = LaunchedServer(f"http://127.0.0.1:{port}", process, log)
    try:
        _wait_until_healthy(launched, startup_timeout_s)
        yield launched
    finally:
        _stop(process)


def _flags(server_args: dict) -> list[str]:
    """{'max_model_len': 1024, 'some_switch': True} -> ['--max-model-len', '1024', '--some-switch']."""
    flags = []
    for key, value in server_args.items():
        flag = "--" + str(key).replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is not False and value is not None:
            flags += [flag, str(value)]
    return flags


def _wait_until_healthy(launched: LaunchedServer, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if launched.process.poll() is not None:
            raise SpecserveError(f"the server did not start: {launched.status()}\n{_tail(launched.log)}")
        try:
            if httpx.get(f"{launched.url}/health", timeout=2.0, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass  # still loading the model
        time.sleep(0.5)
    raise SpecserveError(f"the server was not healthy after {timeout_s:.0f}s: {launched.status()}")


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _tail(log: Path) -> str:
    lines = log.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
    return "\n".join(f"  | {line}" for line in lines)
