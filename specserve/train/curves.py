"""Training curves: each run's cross-entropy and analytic tau (train set) against its optimizer step, read
from the metrics logs `specserve train` writes, smoothed over a window of steps, as a PNG and a summary."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from specserve.config import SpecserveError, check
from specserve.jsonl import read_jsonl

METRICS_FILE = "metrics.jsonl"


@dataclass
class Curve:
    name: str
    steps: list[int]
    ce: list[float]
    tau: list[float]


def moving_average(values: list[float], window: int) -> list[float]:
    """Each value averaged with up to `window - 1` values before it."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def read_curve(name: str, run: str | Path, window: int) -> Curve:
    """A run directory (or its metrics.jsonl), smoothed over `window` steps."""
    path = Path(run)
    if path.is_dir():
        path = path / METRICS_FILE
    if window < 1:
        raise SpecserveError(f"the smoothing window must be >= 1 step, got {window}")
    if not path.is_file():
        raise SpecserveError(f"{path}: no training metrics (a directory `specserve train` wrote?)")
    try:
        rows = sorted(
            ({"step": r["step"], "ce": r["ce"], "tau": r["tau"]} for r in read_jsonl(path)),
            key=lambda r: r["step"],
        )
    except (KeyError, TypeError) as e:
        raise SpecserveError(f"{path}: not a `specserve train` metrics log ({e!r})") from e
    check(bool(rows), f"{path}: no steps logged yet")
    return Curve(
        name,
        [r["step"] for r in rows],
        moving_average([r["ce"] for r in rows], window),
        moving_average([r["tau"] for r in rows], window),
    )


def summary(curves: list[Curve]) -> str:
    lines = [f"{'run':<20} {'steps':>6} {'ce':>7} {'tau':>6}   (train set, mean of the last window)"]
    for c in curves:
        if c.steps:
            lines.append(f"{c.name:<20} {c.steps[-1]:>6} {c.ce[-1]:>7.3f} {c.tau[-1]:>6.3f}")
    return "\n".join(lines)


def plot_curves(curves: list[Curve], output: str | Path, window: int) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for c in curves:
        left.plot(c.steps, c.ce, label=c.name)
        right.plot(c.steps, c.tau, label=c.name)
    left.set(xlabel="optimizer step", ylabel="cross-entropy", title=f"CE (mean of {window} steps)")
    right.set(
        xlabel="optimizer step", ylabel="tau", title=f"analytic tau, train set (mean of {window} steps)"
    )
    right.legend()
    fig.tight_layout()
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=120)
    plt.close(fig)
    return output
