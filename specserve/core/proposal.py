"""A drafter's proposal for one request: the draft tokens, the distributions they were drawn from, and the
drafter's belief that each survives verification."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DraftProposal:
    """Draft tokens d1..dk for one request and the distributions they were drawn from.

    `probs` is [k, V] (the exact q rows, after the request's sampling transforms) for model drafters, or
    None for deterministic drafters (a point mass on each drafted token). `confidences` [k] estimates
    P(d_i accepted | d_1..d_{i-1} accepted): a confidence head's, else a model drafter's peak probability.
    """

    token_ids: list[int]
    probs: torch.Tensor | None = None
    confidences: torch.Tensor | None = None

    def truncate(self, k: int) -> DraftProposal:
        """The first k drafts: whether a draft is verified may depend only on what came before it."""
        if k >= len(self.token_ids):
            return self  # immutable: no copy needed
        return DraftProposal(
            self.token_ids[:k],
            None if self.probs is None else self.probs[:k],
            None if self.confidences is None else self.confidences[:k],
        )

    def slot_confidences(self) -> torch.Tensor:
        """Per-draft survival estimates for verify policies: `confidences` (a confidence head's, or a model
        drafter's peak probability), else 1 (a deterministic lookup has no belief to offer). Never the
        drafted token's own probability: a policy that verifies d_j because q(d_j) is high keeps only the
        drafts rejection sampling would favour, and the output is no longer the target's (Appendix A)."""
        if self.confidences is not None:
            return self.confidences
        return torch.ones(len(self.token_ids))


# The drafts so far per sequence -> which sequences draft one more token (the verify planner decides).
KeepDrafting = Callable[[list[DraftProposal]], list[bool]]
