"""Speculative-decoding and prefix-cache statistics of one run, from the server's Prometheus counters read
before and after.

The counters are cumulative over the server's life, so a run's share is the difference of two scrapes; that
is exact as long as nothing else sends requests meanwhile (the benchmark assumes it has the server alone).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

PREFIX = "specserve:"
COUNTERS = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")
PREFIX_CACHE_COUNTERS = ("prefix_cache_queries", "prefix_cache_hits")


@dataclass
class ServerCounters:
    spec_decode_num_drafts: float = 0.0
    spec_decode_num_draft_tokens: float = 0.0
    spec_decode_num_accepted_tokens: float = 0.0
    accepted_per_position: dict[int, float] = field(default_factory=dict)
    prefix_cache_queries: float = 0.0  # prompt tokens looked up, and found
    prefix_cache_hits: float = 0.0

    @classmethod
    def parse(cls, exposition: str) -> ServerCounters | None:
        """The counters in a /metrics text; None when the server exports none (not a specserve server)."""
        counters = cls()
        found = False
        for family in text_string_to_metric_families(exposition):
            for sample in family.samples:
                if not sample.name.startswith(PREFIX) or not sample.name.endswith("_total"):
                    continue
                name = sample.name.removeprefix(PREFIX).removesuffix("_total")
                if name == "spec_decode_num_accepted_tokens_per_pos":
                    counters.accepted_per_position[int(sample.labels["position"])] = sample.value
                elif name in COUNTERS + PREFIX_CACHE_COUNTERS:
                    setattr(counters, name, sample.value)
                else:
                    continue
                found = True
        return counters if found else None


def spec_summary(before: ServerCounters | None, after: ServerCounters | None) -> dict | None:
    """tau (tokens per verification round, bonus token included: 1 + accepted / drafts), the acceptance
    rate of draft tokens, and per position the share of rounds that accepted the draft token there.
    None when the server has no counters or verified no drafts during the run (no speculation)."""
    if before is None or after is None:
        return None
    drafts = after.spec_decode_num_drafts - before.spec_decode_num_drafts
    if drafts <= 0:
        return None
    draft_tokens = after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
    accepted = after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    positions = range(max(after.accepted_per_position, default=-1) + 1)
    per_position = [
        (after.accepted_per_position.get(p, 0.0) - before.accepted_per_position.get(p, 0.0)) / drafts
        for p in positions
    ]
    return {
        "num_drafts": int(drafts),
        "num_draft_tokens": int(draft_tokens),
        "num_accepted_tokens": int(accepted),
        "tau": 1.0 + accepted / drafts,
        "acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
        "acceptance_per_position": per_position,
    }


def prefix_cache_summary(before: ServerCounters | None, after: ServerCounters | None) -> dict | None:
    """Prompt tokens looked up in the prefix cache during the run, found there, and the hit rate; None
    when the server has no counters or looked nothing up (prefix caching off)."""
    if before is None or after is None:
        return None
    queried = after.prefix_cache_queries - before.prefix_cache_queries
    if queried <= 0:
        return None
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    return {"queried_tokens": int(queried), "hit_tokens": int(hits), "hit_rate": hits / queried}
