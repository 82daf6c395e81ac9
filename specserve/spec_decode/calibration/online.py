"""Online calibration: what the engine learns from its own verification rounds while it serves. A live
monitor of predicted survival against realised acceptance per position (ECE, for metrics), and the
correction the scheduled verify policies apply to raw confidences.

Both take a step's verified rounds at once (`record_rounds`): a few tensor ops a step instead of a few per
draft, which at a thousand requests a step was a fifth of the engine's time."""

from __future__ import annotations

import torch

from specserve.spec_decode.calibration.offline import NUM_BINS


def _cells(values: list[torch.Tensor], lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(position, value) of the first `lengths[r]` entries of each round r, flattened."""
    flat = torch.cat([v[:n] for v, n in zip(values, lengths)])
    return torch.tensor([j for n in lengths for j in range(n)], dtype=torch.long), flat


def _grown(table: torch.Tensor, positions: int) -> torch.Tensor:
    """`table` [position, bin] with rows of zeros up to `positions` rows."""
    if positions <= len(table):
        return table
    return torch.cat([table, table.new_zeros(positions - len(table), table.shape[1])])


class LiveCalibration:
    """Binned predicted survival vs realised prefix acceptance, per position, from the engine's rounds."""

    def __init__(self, num_bins: int = NUM_BINS):
        self.num_bins = num_bins
        self.count = torch.zeros(0, num_bins, dtype=torch.double)  # [position, bin]
        self.sum_pred = torch.zeros(0, num_bins, dtype=torch.double)
        self.sum_label = torch.zeros(0, num_bins, dtype=torch.double)

    def record(self, survival: torch.Tensor, num_accepted: int) -> None:
        """`survival` [verified length]: predicted P_j of the verified drafts of one round."""
        self.record_rounds([survival], [num_accepted])

    def record_rounds(self, survivals: list[torch.Tensor], num_accepted: list[int]) -> None:
        lengths = [len(s) for s in survivals]
        if not sum(lengths):
            return
        positions, predicted = _cells([s.double() for s in survivals], lengths)
        bins = (predicted * self.num_bins).long().clamp(0, self.num_bins - 1)
        accepted = torch.tensor([a for a, n in zip(num_accepted, lengths) for _ in range(n)])
        cells = (positions, bins)
        depth = max(lengths)
        self.count, self.sum_pred, self.sum_label = (
            _grown(t, depth) for t in (self.count, self.sum_pred, self.sum_label)
        )
        self.count.index_put_(cells, torch.ones_like(predicted), accumulate=True)
        self.sum_pred.index_put_(cells, predicted, accumulate=True)
        self.sum_label.index_put_(cells, (accepted > positions).double(), accumulate=True)

    def ece_per_position(self) -> list[float]:
        return [
            float((sp - sl).abs().sum() / c.sum()) if c.sum() else float("nan")
            for c, sp, sl in zip(self.count, self.sum_pred, self.sum_label)
        ]

    def samples_per_position(self) -> list[int]:
        return [int(c.sum()) for c in self.count]


class Recalibration:
    """Per-draft confidences corrected by the engine's own verification outcomes, for the scheduled
    verify policies. Per position j and bin of the raw confidence c_j it counts the rounds that verified
    draft j after accepting drafts 1..j-1, and how many of them accepted d_j; the corrected confidence is
    that realised rate, shrunk towards c_j while the cell has few rounds (PRIOR_ROUNDS pseudo-rounds at
    c_j). A drafter without a confidence head (a draft model's peak probability, n-gram's constant 1) thereby
    gets the survival it actually has on this workload, and a calibrated head follows workload shifts.

    Lossless: the table only changes after a verification, so a step's decisions read past outcomes and
    this step's raw confidences (each known before its draft was sampled), never a draft being decided.
    """

    PRIOR_ROUNDS = 8.0

    def __init__(self, num_bins: int = NUM_BINS):
        self.num_bins = num_bins
        self.rounds = torch.zeros(0, num_bins, dtype=torch.double)  # [position, bin]
        self.accepted = torch.zeros(0, num_bins, dtype=torch.double)

    def _bins(self, confidences: torch.Tensor) -> torch.Tensor:
        # In float32 whatever the dtype: 0.9 must land in one bin whether recorded or corrected in double.
        return (confidences.float() * self.num_bins).long().clamp(0, self.num_bins - 1)

    def record(self, confidences: torch.Tensor, num_accepted: int) -> None:
        """One verified proposal: `confidences` [verified drafts] raw, `num_accepted` of them accepted."""
        self.record_rounds([confidences], [num_accepted])

    def record_rounds(self, confidences: list[torch.Tensor], num_accepted: list[int]) -> None:
        # Drafts past the first rejection were not tried (their position's rate is conditional).
        tried = [min(a + 1, len(c)) for c, a in zip(confidences, num_accepted)]
        if not sum(tried):
            return
        positions, raw = _cells([c.float() for c in confidences], tried)
        bins = self._bins(raw)
        accepted = positions < torch.tensor([a for a, n in zip(num_accepted, tried) for _ in range(n)])
        self.rounds, self.accepted = _grown(self.rounds, max(tried)), _grown(self.accepted, max(tried))
        ones = torch.ones(len(bins), dtype=torch.double)
        self.rounds.index_put_((positions, bins), ones, accumulate=True)
        self.accepted.index_put_((positions[accepted], bins[accepted]), ones[accepted], accumulate=True)

    def first_draft_rate(self) -> float:
        """How often a first draft was accepted, before its confidence is known: over every past round,
        shrunk towards 1 (so that a drafter with no record yet is tried)."""
        if not len(self.rounds):
            return 1.0
        return float(
            (self.accepted[0].sum() + self.PRIOR_ROUNDS) / (self.rounds[0].sum() + self.PRIOR_ROUNDS)
        )

    def correct(self, confidences: torch.Tensor) -> torch.Tensor:
        """Corrected per-draft confidences [k] (raw ones past the positions seen so far)."""
        raw = confidences.double()
        seen = min(len(raw), len(self.rounds))
        rounds, accepted = torch.zeros_like(raw), torch.zeros_like(raw)
        if seen:
            cells = (torch.arange(seen), self._bins(raw[:seen]))
            rounds[:seen], accepted[:seen] = self.rounds[cells], self.accepted[cells]
        return (accepted + self.PRIOR_ROUNDS * raw) / (rounds + self.PRIOR_ROUNDS)
