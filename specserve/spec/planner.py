"""Verify policies: how many of a request's drafts the target checks this step.

Every policy is non-anticipating (DSpark paper, Appendix A): whether draft i is verified depends only on
what was known before d_i was sampled, so the verified prefix is a stopping time and rejection sampling
stays lossless. `threshold` reads c_i, which the confidence head computes from h_i and d_{i-1} (never d_i).
"""

from __future__ import annotations

from specserve.config import SpeculativeConfig
from specserve.spec.drafters.base import DraftProposal


def verify_length(proposal: DraftProposal, config: SpeculativeConfig) -> int:
    """`fixed`: every draft. `threshold` (DeepSpec): up to the first draft whose own per-slot confidence
    (not the cumulative product) is below the threshold; 0 makes the step a plain decode step."""
    if config.verify_policy == "threshold":
        below = (proposal.slot_confidences() < config.confidence_threshold).nonzero()
        return int(below[0, 0]) if len(below) else len(proposal.token_ids)
    return len(proposal.token_ids)
