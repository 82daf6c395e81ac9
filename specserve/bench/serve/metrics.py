"""Serving metrics from client-side timelines: per request TTFT, TPOT, ITL, E2E latency and per-user speed;
per run throughput, goodput under an SLA, and percentiles. Pure arithmetic, no I/O.

Definitions (those of `vllm bench serve`):
- TTFT: request sent to the first streamed chunk of the completion.
- E2E: request sent to the end of the stream.
- TPOT = (E2E - TTFT) / (output tokens - 1): the mean time per token after the first.
- ITL: gaps between successive chunks. A chunk can carry several tokens (speculation accepts several per
  step; a detokenizer holds back partial characters), so ITL is per chunk, not per token.
- Per-user tokens/s = 1 / TPOT: the decode speed one user sees (the x axis of the Pareto figure).
- Goodput: requests per second that meet every SLA bound, and the output tokens/s of those requests.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from specserve.config import SpecserveError

PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    """What the client saw of one request; times are `time.perf_counter()` seconds."""

    start: float
    end: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk of the completion
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str | None = None
    turn: int = 0  # of its chat (multi-turn datasets)

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.start

    @property
    def e2e(self) -> float:
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        """None for one-token outputs, which have no time between tokens."""
        if self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        times = self.chunk_times
        return [later - earlier for earlier, later in zip(times, times[1:])]

    @property
    def user_tokens_per_s(self) -> float | None:
        tpot = self.tpot
        return 1.0 / tpot if tpot else None


@dataclass(frozen=True)
class Sla:
    """Bounds a request must meet to count as good; None means unbounded."""

    ttft_s: float | None = None
    tpot_s: float | None = None

    @classmethod
    def parse(cls, text: str | None) -> Sla:
        """'tpot:50,ttft:2000' (milliseconds) -> Sla(ttft_s=2.0, tpot_s=0.05)."""
        bounds: dict[str, float] = {}
        for part in filter(None, (p.strip() for p in (text or "").split(","))):
            name, _, value = part.partition(":")
            if name not in ("ttft", "tpot"):
                raise SpecserveError(f"SLA bound {part!r}: the name must be ttft or tpot (e.g. tpot:50)")
            try:
                bounds[f"{name}_s"] = float(value) / 1000
            except ValueError:
                raise SpecserveError(f"SLA bound {part!r}: the value must be milliseconds") from None
        return cls(**bounds)

    def met_by(self, record: RequestRecord) -> bool:
        if not record.ok:
            return False
        if self.ttft_s is not None and record.ttft > self.ttft_s:
            return False
        tpot = record.tpot
        return self.tpot_s is None or tpot is None or tpot <= self.tpot_s

    def as_ms(self) -> dict[str, float]:
        return {
            f"{name}_ms": value * 1000
            for name, value in (("ttft", self.ttft_s), ("tpot", self.tpot_s))
            if value is not None
        }


def distribution(values: list[float], scale: float = 1.0) -> dict[str, float] | None:
    """Mean and percentiles (linear interpolation, as numpy) of `values` times `scale`; None when empty."""
    if not values:
        return None
    scaled = np.asarray(values, dtype=float) * scale
    stats = {"mean": float(scaled.mean())}
    stats.update({f"p{q}": float(np.percentile(scaled, q)) for q in PERCENTILES})
    return stats


def summarize(records: list[RequestRecord], duration_s: float, sla: Sla) -> dict:
    """One run's figures: counts, throughputs, goodput, and distributions (latencies in milliseconds)."""
    done = [r for r in records if r.ok]
    good = [r for r in done if sla.met_by(r)]
    output_tokens = sum(r.output_tokens for r in done)
    input_tokens = sum(r.prompt_tokens for r in done)

    def per_s(amount: float) -> float:
        return amount / duration_s if duration_s > 0 else 0.0

    return {
        "completed": len(done),
        "failed": len(records) - len(done),
        "duration_s": duration_s,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": per_s(len(done)),
        "output_throughput": per_s(output_tokens),
        "total_throughput": per_s(input_tokens + output_tokens),
        "goodput": per_s(len(good)),
        "goodput_output_throughput": per_s(sum(r.output_tokens for r in good)),
        "ttft_ms": distribution([r.ttft for r in done], 1000),
        "tpot_ms": distribution([r.tpot for r in done if r.tpot is not None], 1000),
        "itl_ms": distribution([gap for r in done for gap in r.itls], 1000),
        "e2e_ms": distribution([r.e2e for r in done], 1000),
        "user_tokens_per_s": distribution([r.user_tokens_per_s for r in done if r.user_tokens_per_s]),
        "errors": dict(Counter(r.error for r in records if not r.ok).most_common(5)),
        "ttft_ms_by_turn": _by_turn(done, lambda r: r.ttft, 1000),
    }


def _by_turn(records: list[RequestRecord], value: Callable[[RequestRecord], float], scale: float):
    """A distribution per chat turn (multi-turn datasets); None for single-turn runs."""
    turns = sorted({r.turn for r in records})
    if len(turns) < 2:
        return None
    return {str(t): distribution([value(r) for r in records if r.turn == t], scale) for t in turns}
