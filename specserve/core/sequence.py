"""One request as it moves through the engine: what it asked for, its tokens and the scheduler's progress
on them (`Sequence`), and what its users have been given (`OutputState`)."""

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


@dataclass
class OutputState:
    """What the output processor has made of a request's tokens for its users; written by it alone."""

    text: str = ""  # the detokenised output, cut before a stop string
    logprobs: list[dict] = field(default_factory=list)  # per output token (when asked for)
    num_emitted_chars: int = 0  # of `text`, already in an update
    num_emitted_tokens: int = 0
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    error: str | None = None  # why the engine ended it with finish_reason "error"


@dataclass(eq=False)  # identity: the scheduler looks sequences up in its queues
class Sequence:
    """Prompt, generated tokens and how much of them the KV cache holds.

    The cache always holds the first `num_computed_tokens` tokens; the engine feeds the rest. After a
    sampled token is appended the cache lags by one (that token is fed by the next step), which makes
    prefill, decode and recompute-after-preemption the same operation.

    Who writes what: the input processor sets the request's own fields, once; the scheduler its progress
    (status, computed and cached tokens, when it was first scheduled, preemptions); the output processor
    appends tokens and the prompt logprobs a forward scored, finishes it (or the engine, on an abort) and
    keeps `output`; the speculator counts `spec_stats`. The runner's per-request state (cache blocks, state
    slots) is the cache coordinator's.
    """

    # The request
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    prompt: str | None = None
    generator: torch.Generator | None = None
    grammar: RequestGrammar | None = None  # its output constraint (structured outputs)
    # Its tokens and the scheduler's progress on them
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache when it was first scheduled
    # Prompt logprobs scored so far (when asked for): entry p is the step of prompt token p + 1.
    prompt_logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.monotonic()))
    spec_stats: SpecStats = field(default_factory=SpecStats)
    output: OutputState = field(default_factory=OutputState)

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

    def finish(self, reason: str) -> None:
        """Mark the request done ("stop" | "length" | "abort" | "error"); the scheduler frees its blocks."""
        self.finish_reason = reason
        self.metrics.finish_time = time.monotonic()
        self.status = SequenceStatus.FINISHED
