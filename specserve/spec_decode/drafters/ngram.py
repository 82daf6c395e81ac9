"""Prompt lookup: propose the tokens that followed the latest earlier occurrence of the current suffix."""

from __future__ import annotations

import numpy as np

from specserve.config import SpeculativeConfig
from specserve.core.proposal import DraftProposal
from specserve.core.sequence import Sequence
from specserve.spec_decode.context import TargetContext
from specserve.spec_decode.drafters.base import Drafter


def lookup(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to k tokens that followed the latest earlier match of the longest suffix n-gram, n in [min, max]."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        # windows[i] = tokens[i : i + n]; the suffix itself (i = length - n) is not a match.
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if len(hits):
            start = hits[-1] + n
            return tokens[start : start + k].tolist()
    return []


class NgramDrafter(Drafter):
    samples_drafts = False

    def __init__(self, min_n: int, max_n: int):
        self.min_n = min_n
        self.max_n = max_n

    @classmethod
    def from_config(cls, config: SpeculativeConfig, target: TargetContext) -> NgramDrafter:
        return cls(config.prompt_lookup_min, config.prompt_lookup_max)

    def propose(self, seqs: list[Sequence], num_tokens: int, keep_drafting=None) -> list[DraftProposal]:
        return [
            DraftProposal(lookup(np.asarray(s.all_token_ids), self.min_n, self.max_n, num_tokens))
            for s in seqs
        ]
