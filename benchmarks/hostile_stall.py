"""How much each hostile request stalls a running stream (issue 56).

Starts `specserve serve MODEL`, then for each hostile request: runs greedy streams (completions of
`--stream-tokens` tokens, one after another until the hostile requests have their answers), fires the
hostile request(s) once the first is under way, and records the streams' gaps between chunks. The same
stream alone, measured before and after in the same run, is the baseline: each row's figure is its
largest gap over the alone median of largest gaps. A server that dies (a hostile grammar can crash one)
is restarted and the row says so.

    .venv/bin/python benchmarks/hostile_stall.py [--model qwen2.5-coder-0.5b] [--code-dir DIR]

`--code-dir` serves another checkout's code (say, main's) with this environment, for a before/after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Server:
    model: str
    port: int
    code_dir: Path
    flags: list[str]
    log: Path
    process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> float:
        """Starts it and waits for /health; returns the seconds it took."""
        begin = time.monotonic()
        env = {**os.environ, "PYTHONPATH": str(self.code_dir), "OMP_WAIT_POLICY": "PASSIVE"}
        command = [sys.executable, "-m", "specserve.cli", "serve", self.model, "--port", str(self.port)]
        with open(self.log, "a") as log:
            self.process = subprocess.Popen(
                command + self.flags, env=env, cwd=self.code_dir, stdout=log, stderr=subprocess.STDOUT
            )
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited at start; see {self.log}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return time.monotonic() - begin
            except httpx.HTTPError:
                pass
            time.sleep(0.2)

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self) -> None:
        if self.alive:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@dataclass
class Answer:
    status: int | str
    seconds: float
    message: str = ""


def post(url: str, path: str, body: dict | bytes, timeout: float = 300) -> Answer:
    begin = time.monotonic()
    try:
        if isinstance(body, bytes):
            headers = {"Content-Type": "application/json"}
            response = httpx.post(f"{url}/v1/{path}", content=body, headers=headers, timeout=timeout)
        else:
            response = httpx.post(f"{url}/v1/{path}", json=body, timeout=timeout)
    except httpx.HTTPError as exc:
        return Answer(type(exc).__name__, time.monotonic() - begin)
    message = ""
    if response.status_code != 200:
        try:
            error = response.json()["error"]
            message = f"param={error.get('param')!r}: {error['message'][:160]}"
        except (ValueError, KeyError):
            message = response.text[:160]
    return Answer(response.status_code, time.monotonic() - begin, message)


def stream_gaps(url: str, tokens: int, started: threading.Event) -> list[float]:
    """Seconds between the chunks of one greedy stream (`started` is set at its 5th chunk); none if the
    server is gone."""
    body = {
        "prompt": "def fibonacci(n):",
        "max_tokens": tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
    times = []
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as response:
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    times.append(time.monotonic())
                    if len(times) == 5:
                        started.set()
    except httpx.HTTPError:
        pass  # the server died under it
    started.set()
    return [b - a for a, b in zip(times[1:], times[2:])]  # from the second chunk: the first waits on prefill


@dataclass
class Row:
    name: str
    what: str
    answers: list[Answer] = field(default_factory=list)
    max_gap: float = 0.0
    median_gap: float = 0.0
    server_died: bool = False


def run_case(server: Server, name: str, what: str, hostile: list[Callable[[], Answer]], tokens: int) -> Row:
    """One stream, then another after it until every hostile request has its answer, so the gaps cover
    all the time they run (each stream's first gap, its prefill, is left out)."""
    started, answered = threading.Event(), threading.Event()
    gaps: list[float] = []

    def stream() -> None:
        first = True
        while first or (not answered.is_set() and server.alive):
            gaps.extend(stream_gaps(server.url, tokens, started))
            first = False

    streamer = threading.Thread(target=stream)
    streamer.start()
    started.wait(300)
    answers: list[Answer | None] = [None] * len(hostile)

    def fire(i: int) -> None:
        answers[i] = hostile[i]()

    firing = [threading.Thread(target=fire, args=(i,)) for i in range(len(hostile))]
    for thread in firing:
        thread.start()
    for thread in firing:
        thread.join()
    answered.set()
    streamer.join()
    row = Row(name, what, [a for a in answers if a is not None])
    row.max_gap = max(gaps, default=float("nan"))
    row.median_gap = statistics.median(gaps) if gaps else float("nan")
    row.server_died = not server.alive
    return row


def hostile_cases() -> list[tuple[str, str, Callable[[str], list[Callable[[], Answer]]]]]:
    chat = [{"role": "user", "content": "Ship it."}]
    choices = [f"option {i}" for i in range(100_000)]
    n = 4000
    deep = "start: a0\n" + "\n".join(f'a{i}:"x"a{i + 1}?' for i in range(n)) + f'\na{n}:"z"'
    shipment = {
        "$defs": {"Addr": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}}},
        "type": "object",
        "properties": {"to": {"$ref": "#/$defs/Addr"}},
        "required": ["to"],
    }
    tool = {"type": "function", "function": {"name": "ship", "parameters": shipment}}
    other_tool = {
        "type": "function",
        "function": {"name": "post", "parameters": shipment},
    }  # not a cached prefix
    huge = "lorem ipsum dolor sit amet " * (10 * 2**20 // 27)

    def c(url, body, path="chat/completions"):
        return lambda: post(url, path, body)

    return [
        (
            "first_constraint",
            "the first constrained request after start (regex [a-z]+)",
            lambda url: [
                c(url, {"messages": chat, "max_tokens": 8, "structured_outputs": {"regex": "[a-z]+"}})
            ],
        ),
        (
            "choice_100k",
            "two requests with a 100,000-entry choice list, and a 1-token request (its latency shown last)",
            lambda url: [
                c(url, {"messages": chat, "max_tokens": 4, "structured_outputs": {"choice": choices}}),
                c(url, {"messages": chat, "max_tokens": 4, "structured_outputs": {"choice": choices}}),
                lambda: (time.sleep(2), post(url, "completions", {"prompt": "hi", "max_tokens": 1}))[1],
            ],
        ),
        (
            "deep_grammar",
            f"a Lark grammar of {n} nested optional rules ({len(deep) // 1024} KiB)",
            lambda url: [
                c(url, {"messages": chat, "max_tokens": 4, "structured_outputs": {"grammar": deep}})
            ],
        ),
        (
            "surrogate_regex",
            "a lone surrogate in structured_outputs.regex",
            lambda url: [
                c(
                    url,
                    b'{"messages": [{"role": "user", "content": "x"}], '
                    b'"structured_outputs": {"regex": "a\\ud800"}}',
                )
            ],
        ),
        (
            "defs_ref_tool",
            "tool_choice required, parameters with $defs / $ref",
            lambda url: [
                c(url, {"messages": chat, "max_tokens": 40, "tools": [tool], "tool_choice": "required"})
            ],
        ),
        (
            "same_tools_unforced",
            "the same kind of tool, tool_choice auto (as long a prompt to prefill, no grammar): the control",
            lambda url: [
                c(url, {"messages": chat, "max_tokens": 40, "tools": [other_tool], "tool_choice": "auto"})
            ],
        ),
        (
            "bare_ref",
            'structured_outputs {"json": {"$ref": "#"}}',
            lambda url: [
                c(url, {"messages": chat, "max_tokens": 8, "structured_outputs": {"json": {"$ref": "#"}}})
            ],
        ),
        (
            "prompt_10mb",
            "two 10 MB prompts",
            lambda url: [c(url, {"prompt": huge, "max_tokens": 1}, "completions")] * 2,
        ),
        ("malformed_json", "a body that is not JSON", lambda url: [c(url, b'{"messages": [}')]),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--code-dir", type=Path, default=ROOT, help="the checkout whose code serves")
    parser.add_argument("--port", type=int, default=8756)
    parser.add_argument("--stream-tokens", type=int, default=48)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--baselines", type=int, default=3, help="streams alone, before the cases and after")
    parser.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = parser.parse_args()
    log = Path(tempfile.mkdtemp()) / "server.log"
    server = Server(args.model, args.port, args.code_dir, ["--max-model-len", str(args.max_model_len)], log)
    print(f"server log: {log}", flush=True)
    startup = server.start()
    print(f"started in {startup:.1f} s", flush=True)
    rows: list[Row] = []
    try:
        cases = hostile_cases()
        # Warm the engine (its first shapes, the chat template) with plain requests; the first constrained
        # request must still be the first one after start, so it goes before the baselines.
        post(
            server.url, "chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        )
        run_case(server, "warm-up", "", [], args.stream_tokens)
        name, what, make = cases[0]
        rows.append(run_case(server, name, what, make(server.url), args.stream_tokens))
        alone = [
            run_case(server, "alone", "the stream alone", [], args.stream_tokens)
            for _ in range(args.baselines)
        ]
        for name, what, make in cases[1:]:
            if not server.alive:
                server.stop()
                server.start()
            rows.append(run_case(server, name, what, make(server.url), args.stream_tokens))
            print(f"{name}: max gap {rows[-1].max_gap:.2f} s", flush=True)
        if not server.alive:
            server.start()
        alone += [
            run_case(server, "alone", "the stream alone", [], args.stream_tokens)
            for _ in range(args.baselines)
        ]
    finally:
        server.stop()
    base_max = statistics.median(r.max_gap for r in alone)
    base_median = statistics.median(r.median_gap for r in alone)
    print(f"\ncode: {args.code_dir}; model {args.model}; stream of {args.stream_tokens} tokens")
    print(
        f"the stream alone ({len(alone)} runs, before and after): median gap {base_median:.3f} s, "
        f"largest gap {base_max:.3f} s (median of runs; spread {min(r.max_gap for r in alone):.3f}-"
        f"{max(r.max_gap for r in alone):.3f})\n"
    )
    print("| hostile request | answers (status, seconds) | largest gap, s | vs alone | median gap, s |")
    print("|---|---|---:|---:|---:|")
    for row in rows:
        answers = "; ".join(f"{a.status} in {a.seconds:.1f} s" for a in row.answers)
        died = " **server died**" if row.server_died else ""
        print(
            f"| {row.what} | {answers}{died} | {row.max_gap:.2f} | {row.max_gap / base_max:.1f}x | "
            f"{row.median_gap:.3f} |"
        )
    print("\nerror messages:")
    for row in rows:
        for answer in row.answers:
            if answer.message:
                print(f"- {row.name}: {answer.status} {answer.message}")
    if args.out is not None:
        payload = {
            "alone": [r.__dict__ | {"answers": []} for r in alone],
            "rows": [r.__dict__ | {"answers": [a.__dict__ for a in r.answers]} for r in rows],
        }
        args.out.write_text(json.dumps(payload, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
