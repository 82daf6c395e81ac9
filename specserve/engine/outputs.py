"""What the engine hands back to users: one RequestOutput per request update."""

from __future__ import annotations

from dataclasses import dataclass, field

from specserve.core.sequence import RequestMetrics
from specserve.core.spec_stats import SpecStats


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" | None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[dict[int, float]] | None = None
    # What is new since the previous update of this request (for streaming).
    delta_text: str = ""
    delta_token_ids: list[int] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    error: str | None = None
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    # With SamplingParams.prompt_logprobs (vLLM's shape): None for the first prompt token, then per prompt
    # token {token id: raw logprob}, the prompt's own token first, then the top k.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # The request's speculative decoding so far (its sequence's own counters, live like `metrics`)
    spec_stats: SpecStats = field(default_factory=SpecStats)
