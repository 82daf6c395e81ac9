"""The drafter interface: proposals for the decoding requests of a step."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.engine.sequence import Sequence


@dataclass
class DraftProposal:
    """Draft tokens d1..dk for one request and the distributions they were drawn from.

    `probs` is [k, V] (the exact q rows, after the request's sampling transforms) for model drafters, or
    None for deterministic drafters (a point mass on each drafted token).
    """

    token_ids: list[int]
    probs: torch.Tensor | None = None

    def truncate(self, k: int) -> DraftProposal:
        """The first k drafts: whether a draft is verified may depend only on what came before it."""
        return DraftProposal(self.token_ids[:k], None if self.probs is None else self.probs[:k])


class Drafter:
    """Proposes tokens for sequences whose next step is a decode step.

    The drafter owns its state (KV cache, lookup tables). It learns what the target accepted from the
    sequences themselves: their token lists only ever grow by verified tokens, so whatever the drafter
    computed for tokens that are not a prefix of the sequence any more is rolled back.
    """

    def propose(self, seqs: list[Sequence], num_tokens: int) -> list[DraftProposal]:
        raise NotImplementedError

    def release(self, seq: Sequence) -> None:
        """The sequence finished or was preempted: drop whatever the drafter holds for it."""
