"""Online calibration: what the engine learns from its own verification rounds while it serves. A live
monitor of predicted survival against realised acceptance per position (ECE, for metrics), and the
correction the scheduled verify policies apply to raw confidences."""

from __future__ import annotations

import torch

from specserve.spec_decode.calibration.offline import NUM_BINS


class LiveCalibration:
    """Binned predicted survival vs realised prefix acceptance, per position, from the engine's rounds."""

    def __init__(self, num_bins: int = NUM_BINS):
        self.num_bins = num_bins
        self.count: list[torch.Tensor] = []
        self.sum_pred: list[torch.Tensor] = []
        self.sum_label: list[torch.Tensor] = []

    def record(self, survival: torch.Tensor, num_accepted: int) -> None:
        """`survival` [verified length]: predicted P_j of the verified drafts of one round."""
        for j, p in enumerate(survival.tolist()):
            while len(self.count) <= j:
                for acc in (self.count, self.sum_pred, self.sum_label):
                    acc.append(torch.zeros(self.num_bins, dtype=torch.double))
            b = min(int(p * self.num_bins), self.num_bins - 1)
            self.count[j][b] += 1
            self.sum_pred[j][b] += p
            self.sum_label[j][b] += float(num_accepted > j)

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
        """One verified proposal: `confidences` [verified drafts] raw, `num_accepted` of them accepted.
        Drafts past the first rejection were not tried (their position's rate is conditional)."""
        tried = min(num_accepted + 1, len(confidences))
        if tried > len(self.rounds):
            grow = torch.zeros(tried - len(self.rounds), self.num_bins, dtype=torch.double)
            self.rounds, self.accepted = torch.cat([self.rounds, grow]), torch.cat([self.accepted, grow])
        bins = self._bins(confidences[:tried])
        self.rounds[torch.arange(tried), bins] += 1
        self.accepted[torch.arange(num_accepted), bins[:num_accepted]] += 1

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
