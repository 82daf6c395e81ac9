"""Offline calibration of draft confidences: metrics (ECE, AUC, Brier), Sequential Temperature Scaling
(STS) fitted on recorded verification rounds, the temperatures file beside a drafter, reliability diagrams.

The quantity calibrated is the predicted prefix survival P_j = c_1 ... c_j against the realised event
Y_j = "drafts 1..j were all accepted" (DeepSpec's accept_rate@j, the planners' a_rj). STS (DSpark paper,
§3.2) fits one temperature per position, left to right: c_j = sigmoid(l_j / T_j), T_j chosen on a grid to
minimise the ECE of P_j with T_1..T_{j-1} already fixed. Dividing by T_j > 0 keeps the order within a
position.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

NUM_BINS = 20  # DeepSpec's CONFIDENCE_NUM_BINS
STS_GRID = torch.exp(torch.linspace(-2.5, 2.5, 101)).tolist()  # temperatures e^-2.5 .. e^2.5
STS_FILE = "sts_temperatures.json"


def ece(pred: torch.Tensor, label: torch.Tensor, num_bins: int = NUM_BINS) -> float:
    """Expected calibration error with equal-width bins: sum_b n_b / N |mean pred_b - mean label_b|."""
    if pred.numel() == 0:
        return float("nan")
    pred, label = pred.double().clamp(1e-8, 1 - 1e-8), label.double()
    bins = (pred * num_bins).long().clamp(max=num_bins - 1)
    count = torch.bincount(bins, minlength=num_bins).double()
    gap = torch.bincount(bins, pred, minlength=num_bins) - torch.bincount(bins, label, minlength=num_bins)
    return float(gap.abs().sum() / count.sum())


def auc(pred: torch.Tensor, label: torch.Tensor) -> float | None:
    """Area under the ROC curve (Mann-Whitney, ties counted one half); None (undefined) with one class
    only, as when every round ended alike at a position (e.g. greedy drafts that never get that far)."""
    pos, neg = pred[label > 0.5].double(), pred[label <= 0.5].double()
    if len(pos) == 0 or len(neg) == 0:
        return None
    greater = (pos[:, None] > neg[None, :]).double().mean()
    ties = (pos[:, None] == neg[None, :]).double().mean()
    return float(greater + 0.5 * ties)


def brier(pred: torch.Tensor, label: torch.Tensor) -> float:
    return float(((pred.double() - label.double()) ** 2).mean()) if pred.numel() else float("nan")


@dataclass
class VerificationRecords:
    """Per verification round: the confidence logits of the verified drafts (nan past the verified
    length) and how many of them were accepted."""

    logits: list[torch.Tensor] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)

    def add(self, logits: torch.Tensor, num_accepted: int) -> None:
        self.logits.append(logits.detach().double().cpu())
        self.accepted.append(num_accepted)

    def arrays(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(logits [N, k] nan-padded, verified length [N], accepted [N])."""
        k = max((len(x) for x in self.logits), default=0)
        logits = torch.full((len(self.logits), k), float("nan"), dtype=torch.double)
        for i, row in enumerate(self.logits):
            logits[i, : len(row)] = row
        lengths = torch.tensor([len(x) for x in self.logits])
        return logits, lengths, torch.tensor(self.accepted)


def prefix_survival(logits: torch.Tensor, temperatures: list[float]) -> torch.Tensor:
    """P_j = prod_{i<=j} sigmoid(l_i / T_i) for every row and position j < len(temperatures)."""
    k = len(temperatures)
    return torch.cumprod(torch.sigmoid(logits[:, :k] / torch.tensor(temperatures, dtype=logits.dtype)), dim=1)


def position_data(
    logits: torch.Tensor, lengths: torch.Tensor, accepted: torch.Tensor, temperatures: list[float], j: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Predicted survival and realised prefix acceptance at position j over the rounds that verified j."""
    rows = lengths > j
    pred = prefix_survival(logits[rows], temperatures[: j + 1])[:, j]
    return pred, (accepted[rows] > j).double()


def fit_sts(
    logits: torch.Tensor, lengths: torch.Tensor, accepted: torch.Tensor, grid: list[float] = STS_GRID
) -> list[float]:
    """One temperature per position, left to right, each minimising that position's prefix-survival ECE."""
    temperatures: list[float] = []
    for j in range(logits.shape[1]):
        if int((lengths > j).sum()) == 0:
            temperatures.append(1.0)
            continue
        best = min(grid, key=lambda t: ece(*position_data(logits, lengths, accepted, [*temperatures, t], j)))
        temperatures.append(best)
    return temperatures


def calibration_report(
    logits: torch.Tensor, lengths: torch.Tensor, accepted: torch.Tensor, temperatures: list[float]
) -> list[dict]:
    """Per position: samples, ECE / AUC / Brier before (T = 1) and after STS."""
    ones = [1.0] * len(temperatures)
    report = []
    for j in range(len(temperatures)):
        raw = position_data(logits, lengths, accepted, ones, j)
        fitted = position_data(logits, lengths, accepted, temperatures, j)
        report.append(
            {
                "position": j + 1,
                "samples": int(len(raw[0])),
                "temperature": temperatures[j],
                "ece_raw": ece(*raw),
                "ece_sts": ece(*fitted),
                "auc": auc(*fitted),
                "brier_raw": brier(*raw),
                "brier_sts": brier(*fitted),
            }
        )
    return report


def save_temperatures(temperatures: list[float], directory: str | Path) -> Path:
    path = Path(directory) / STS_FILE
    path.write_text(json.dumps({"temperatures": temperatures}, indent=2))
    return path


def load_temperatures(directory: str | Path) -> list[float] | None:
    path = Path(directory) / STS_FILE
    if not path.is_file():
        return None
    temperatures = json.loads(path.read_text())["temperatures"]
    if not all(isinstance(t, int | float) and t > 0 for t in temperatures):
        raise ValueError(f"{path}: temperatures must be positive numbers")
    return [float(t) for t in temperatures]


def reliability_diagram(
    report_data: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]], path
) -> Path:
    """One panel per position: mean realised acceptance against mean predicted survival, per bin, before
    and after STS. `report_data`: per position (pred_raw, label, pred_sts, label)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(report_data)
    fig, axes = plt.subplots(1, n, figsize=(3.2 * n, 3.2), squeeze=False)
    for j, (ax, (raw, label, fitted, _)) in enumerate(zip(axes[0], report_data)):
        ax.plot([0, 1], [0, 1], color="gray", linestyle=":")
        for pred, name in ((raw, "raw"), (fitted, "STS")):
            bins = (pred * NUM_BINS).long().clamp(max=NUM_BINS - 1)
            count = torch.bincount(bins, minlength=NUM_BINS).double()
            keep = count > 0
            mean_p = torch.bincount(bins, pred.double(), minlength=NUM_BINS)[keep] / count[keep]
            mean_y = torch.bincount(bins, label.double(), minlength=NUM_BINS)[keep] / count[keep]
            ax.plot(mean_p, mean_y, marker="o", label=name)
        ax.set(title=f"position {j + 1}", xlabel="predicted survival", xlim=(0, 1), ylim=(0, 1))
        if j == 0:
            ax.set_ylabel("realised acceptance")
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)
