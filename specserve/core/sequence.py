"""One request's state as it moves through the engine: its tokens, how many the KV cache holds."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from specserve.config import SamplingParams
from specserve.core.spec_stats import SpecStats

if TYPE_CHECKING:
    from specserve.structured.grammar import RequestGrammar


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def latency(self) -> float | None:
        return None if self.finish_time is None else self.finish_time - self.arrival_time


@dataclass(eq=False)  # identity: the scheduler looks sequences up in its queues
class Sequence:
    """Prompt, generated tokens and how much of them the KV cache holds.

    The cache always holds the first `num_computed_tokens` tokens; the engine feeds the rest. After a
    sampled token is appended the cache lags by one (that token is fed by the next step), which makes
    prefill, decode and recompute-after-preemption the same operation.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    prompt: str | None = None
    generator: torch.Generator | None = None
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict] = field(default_factory=list)
    # Prompt logprobs scored so far (when asked for): entry p is the step of prompt token p + 1.
    prompt_logprobs: list[dict[int, float]] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache when it was first scheduled
    grammar: RequestGrammar | None = None  # its output constraint (structured outputs)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.monotonic()))
    # Text already emitted and tokens already decoded into it (incremental detokenisation).
    output_text: str = ""
    num_emitted_chars: int = 0
    num_emitted_tokens: int = 0
    spec_stats: SpecStats = field(default_factory=SpecStats)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def finish(self, reason: str, stop_reason: int | str | None = None) -> None:
        """Mark the request done ("stop" | "length" | "abort" | "error"); the scheduler frees its blocks."""
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.metrics.finish_time = time.monotonic()
        self.status = SequenceStatus.FINISHED
