"""`specserve bench serve`: benchmark one running server at each concurrency level in turn, appending one JSON
line per level to the results file as soon as it is measured, so an interrupted benchmark keeps what it did.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from specserve.bench.serve.client import (
    RunRecords,
    ServerDied,
    open_client,
    run_at_concurrency,
    server_counters,
    server_info,
    stream_completion,
)
from specserve.bench.serve.datasets import BenchRequest, Vocabulary, build_requests
from specserve.bench.serve.metrics import Sla, summarize
from specserve.bench.serve.server_counters import prefix_cache_summary, spec_summary
from specserve.config import SpecserveError

# Random prompts of fixed lengths: the seed's figure (8K in / 1K out) and one sized for a 2-core CPU.
PRESETS = {
    "seed-8k1k": {"dataset": "random", "input_len": 8192, "output_len": 1024},
    "cpu-small": {"dataset": "random", "input_len": 512, "output_len": 64},
}
WARMUP_PROMPT_LEN = 8
WARMUP_OUTPUT_LEN = 4


@dataclass
class BenchSettings:
    dataset: str = "random"
    input_len: int = 512  # random prompts only: file datasets keep their prompts' lengths
    output_len: int = 64
    concurrency: list[int] = field(default_factory=lambda: [1])
    num_prompts: int | None = None  # per concurrency level; None: max(8, waves x concurrency)
    waves: int = 4  # full batches per level when num_prompts is None
    sla: Sla = field(default_factory=Sla)
    temperature: float = 0.0
    seed: int = 0
    request_timeout_s: float = 3600.0

    def __post_init__(self) -> None:
        if not self.concurrency or any(c < 1 for c in self.concurrency):
            raise SpecserveError(f"concurrency levels must be >= 1, got {self.concurrency}")
        if self.input_len < 1 or self.output_len < 1:
            raise SpecserveError("input and output lengths must be >= 1")
        if self.num_prompts is not None and self.num_prompts < 1:
            raise SpecserveError(f"num_prompts must be >= 1, got {self.num_prompts}")
        if self.waves < 1:
            raise SpecserveError(f"waves must be >= 1, got {self.waves}")

    @classmethod
    def from_options(cls, preset: str | None = None, **options) -> BenchSettings:
        """Defaults, then the preset's values, then every option that is not None."""
        if preset is not None and preset not in PRESETS:
            raise SpecserveError(f"unknown preset {preset!r}; presets: {', '.join(PRESETS)}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - names)
        if unknown:
            raise SpecserveError(f"unknown benchmark settings {unknown}; known: {sorted(names)}")
        given = {k: v for k, v in options.items() if v is not None}
        return cls(**{**PRESETS.get(preset, {}), **given})

    def prompts_at(self, concurrency: int) -> int:
        # A few waves per level, so the batch stays full for most of the run.
        return self.num_prompts or max(8, self.waves * concurrency)

    def describe(self) -> dict:
        return {
            "dataset": self.dataset,
            "input_len": self.input_len,
            "output_len": self.output_len,
            "temperature": self.temperature,
            "sla": self.sla.as_ms(),
        }


async def benchmark_server(
    base_url: str,
    settings: BenchSettings,
    output: Path,
    *,
    label: str,
    api_key: str | None = None,
    tokenizer: str | None = None,
    extra: dict | None = None,
) -> list[dict]:
    """Run every concurrency level against the server at `base_url`; one result dict per level, each
    appended to `output` (JSON lines) as it is done. `extra` goes into every result (e.g. the server's
    configuration). Raises ServerUnreachable before anything runs, ServerDied (after writing the partial
    level) when the server goes away mid-run."""
    async with open_client(base_url, api_key, settings.request_timeout_s) as client:
        info = await server_info(client)
        try:
            vocabulary = Vocabulary(tokenizer or info.model)
        except SpecserveError as exc:
            raise SpecserveError(f"no tokenizer for the prompts: {exc}; pass --tokenizer MODEL") from None
        _check_lengths(settings, info.max_model_len)
        warmup = BenchRequest(vocabulary.random_ids[:WARMUP_PROMPT_LEN], WARMUP_OUTPUT_LEN)
        record = await stream_completion(client, info.model, warmup, settings.temperature)
        if record.error:
            raise SpecserveError(f"the warm-up request to {base_url} failed: {record.error}")
        results = []
        for concurrency in settings.concurrency:
            requests = build_requests(
                settings.dataset,
                settings.prompts_at(concurrency),
                vocabulary,
                settings.input_len,
                settings.output_len,
                settings.seed,
            )
            before = await server_counters(client)
            run = await _run_with_progress(client, info.model, requests, concurrency, settings, label)
            result = {
                "label": label,
                **(extra or {}),
                "base_url": base_url,
                "model": info.model,
                **settings.describe(),
                "concurrency": concurrency,
                "num_prompts": len(requests),
                "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                **summarize(run.records, run.duration_s, settings.sla),
                "spec": spec_summary(before, after := await server_counters(client)),
                "prefix_cache": prefix_cache_summary(before, after),
                "error": run.server_error,
            }
            append_jsonl(output, result)
            print(format_result(result), flush=True)
            results.append(result)
            if run.server_error:
                raise ServerDied(
                    f"the server at {base_url} stopped answering during the run at concurrency "
                    f"{concurrency} ({result['completed']} of {len(requests)} requests completed; "
                    f"last error: {run.server_error}); the partial results are in {output}"
                )
        return results


async def _run_with_progress(client, model, requests, concurrency, settings, label) -> RunRecords:
    start = time.perf_counter()
    tokens = 0
    with tqdm(total=len(requests), desc=f"{label} concurrency {concurrency}", unit="req", leave=False) as bar:

        def on_record(record) -> None:
            nonlocal tokens
            tokens += record.output_tokens if record.ok else 0
            bar.set_postfix_str(f"{tokens / (time.perf_counter() - start):.1f} output tok/s", refresh=False)
            bar.update()

        return await run_at_concurrency(client, model, requests, concurrency, settings.temperature, on_record)


def _check_lengths(settings: BenchSettings, max_model_len: int | None) -> None:
    if settings.dataset == "random" and max_model_len is not None:
        if settings.input_len + settings.output_len > max_model_len:
            raise SpecserveError(
                f"input_len {settings.input_len} + output_len {settings.output_len} exceeds the server's "
                f"context length {max_model_len} (serve with a larger --max-model-len)"
            )


def append_jsonl(path: Path, result: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(result) + "\n")


def format_result(result: dict) -> str:
    """One line per level for the terminal."""

    def p50(key: str, unit: str) -> str:
        stats = result[key]
        return f"{stats['p50']:.1f}{unit}" if stats else "-"

    spec = result["spec"]
    clauses = [
        f"{result['completed']}/{result['num_prompts']} ok",
        f"{result['output_throughput']:.1f} output tok/s",
        f"per user p50 {p50('user_tokens_per_s', ' tok/s')}",
        f"TTFT p50 {p50('ttft_ms', ' ms')}",
        f"TPOT p50 {p50('tpot_ms', ' ms')}",
        f"goodput {result['goodput']:.2f} req/s",
    ]
    if result.get("ttft_ms_by_turn"):
        by_turn = " / ".join(f"{stats['p50']:.0f}" for stats in result["ttft_ms_by_turn"].values())
        clauses.append(f"TTFT p50 by turn {by_turn} ms")
    if spec:
        clauses.append(f"tau {spec['tau']:.2f}")
    if result.get("prefix_cache"):
        clauses.append(f"prefix cache hits {100 * result['prefix_cache']['hit_rate']:.0f}%")
    if result["error"]:
        clauses.append(f"STOPPED: {result['error']}")
    return f"{result['label']} concurrency {result['concurrency']}: " + ", ".join(clauses)
