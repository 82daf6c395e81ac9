"""Sweep results as the DSpark figure and tables: the Pareto plot of throughput per device against tokens/s
per user (one line per configuration), the throughput each configuration reaches at per-user speed anchors,
its per-user speed at matched throughput, and a table of every run.

An operating point is one run: x = median over requests of per-user tokens/s (1 / TPOT), y = the server's
output tokens/s (one server is one device). Readings between measured points are linear along each
configuration's Pareto frontier: running a share of the time at each of two neighbouring points reaches
every point of the segment between them.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

Point = tuple[float, float]  # (tokens/s per user, output tokens/s per device)


class Reading(NamedTuple):
    value: float
    at_least: bool = False  # the anchor lies beyond the measured points on the easy side: a lower bound


@dataclass
class Anchors:
    """Per-user speeds and throughputs to read the frontiers at; None: the baseline's measured points."""

    user_tokens_per_s: list[float] | None = None
    throughput: list[float] | None = None


def labels_in_order(runs: list[dict]) -> list[str]:
    return list(dict.fromkeys(run["label"] for run in runs))


def operating_points(runs: list[dict], label: str) -> list[tuple[int, Point]]:
    """(concurrency, point) of each complete run of `label`, by concurrency."""
    points = [
        (run["concurrency"], (run["user_tokens_per_s"]["p50"], run["output_throughput"]))
        for run in runs
        if run["label"] == label and not run["error"] and run["user_tokens_per_s"]
    ]
    return sorted(points)


def pareto_frontier(points: list[Point]) -> list[Point]:
    """The points no other point beats on both axes, by increasing per-user speed (so falling throughput)."""
    frontier: list[Point] = []
    best_y = float("-inf")
    for x, y in sorted(points, key=lambda p: (-p[0], -p[1])):
        if y > best_y:
            frontier.append((x, y))
            best_y = y
    return frontier[::-1]


def throughput_at(frontier: list[Point], user_speed: float) -> Reading | None:
    """Throughput with every user at `user_speed` or faster; None when no point is that fast."""
    if not frontier or user_speed > frontier[-1][0]:
        return None
    if user_speed <= frontier[0][0]:
        return Reading(frontier[0][1], at_least=user_speed < frontier[0][0])
    return Reading(_along(frontier, user_speed, axis=0))


def user_speed_at(frontier: list[Point], throughput: float) -> Reading | None:
    """Per-user speed at `throughput` or more; None when no point reaches that throughput."""
    if not frontier or throughput > frontier[0][1]:
        return None
    if throughput <= frontier[-1][1]:
        return Reading(frontier[-1][0], at_least=throughput < frontier[-1][1])
    return Reading(_along(frontier, throughput, axis=1))


def _along(frontier: list[Point], value: float, axis: int) -> float:
    """The other coordinate where the frontier's polyline crosses `value` on `axis` (inside its range)."""
    other = 1 - axis
    for a, b in zip(frontier, frontier[1:]):
        low, high = sorted((a[axis], b[axis]))
        if low <= value <= high:
            if high == low:
                return max(a[other], b[other])
            share = (value - a[axis]) / (b[axis] - a[axis])
            return a[other] + share * (b[other] - a[other])
    raise ValueError(f"{value} is outside the frontier")


def plot_pareto(runs: list[dict], path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5))
    marked: list[tuple[int, tuple[float, float]]] = []
    for label in labels_in_order(runs):
        points = operating_points(runs, label)
        if not points:
            continue
        xs, ys = zip(*(point for _, point in points))
        ax.plot(xs, ys, marker="o", label=label)
        marked += points
    _label_concurrency(ax, marked)
    ax.set_xlabel("tokens/s per user (median of 1 / TPOT)")
    ax.set_ylabel("output tokens/s per device")
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(title="configuration (points: concurrency)", fontsize=8, title_fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)
    return path


LABEL_CROWD_PX = 24  # points of one concurrency closer than this (on the figure) share one label


def _label_concurrency(ax, points: list[tuple[int, tuple[float, float]]]) -> None:
    """Each point's concurrency beside it, once where points of the same concurrency crowd together: a label
    each wrote "64 64" over one another where configurations coincide."""
    ax.autoscale_view()  # the final limits, so that distances on the figure are known
    shown: list[tuple[int, float, float]] = []
    for concurrency, (x, y) in sorted(points, key=lambda p: (-p[1][1], -p[1][0])):  # the top point labels
        px, py = ax.transData.transform((x, y))
        if any(c == concurrency and math.hypot(px - sx, py - sy) < LABEL_CROWD_PX for c, sx, sy in shown):
            continue
        shown.append((concurrency, px, py))
        ax.annotate(str(concurrency), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)


def markdown_report(runs: list[dict], anchors: Anchors, title: str) -> str:
    """The anchor tables (the first configuration is the baseline of the ratios) and the run table."""
    labels = labels_in_order(runs)
    frontiers = {label: pareto_frontier([p for _, p in operating_points(runs, label)]) for label in labels}
    baseline = frontiers[labels[0]] if labels else []
    user_anchors = anchors.user_tokens_per_s or _round_all(x for x, _ in baseline)
    throughput_anchors = anchors.throughput or _round_all(y for _, y in baseline)
    settings = runs[0] if runs else {}
    sla = ", ".join(
        f"{k.removesuffix('_ms').upper()} <= {v:g} ms" for k, v in settings.get("sla", {}).items()
    )
    lines = [
        f"# {title}",
        "",
        f"{settings.get('dataset', '?')} prompts, {settings.get('input_len', '?')} input / "
        f"{settings.get('output_len', '?')} output tokens, temperature {settings.get('temperature', '?')}"
        f"{'; SLA ' + sla if sla else ''}. Per-user speed: median over requests of 1 / TPOT. Throughput: "
        "output tokens/s of one server (one device). Readings are linear along each configuration's Pareto "
        "frontier; >= marks a lower bound (the anchor is easier than every measured point), - a level "
        f"not reached. Ratios are against `{labels[0] if labels else '?'}`.",
        "",
        "## Throughput at per-user speed anchors (output tokens/s per device)",
        "",
        *_anchor_table(labels, frontiers, user_anchors, throughput_at, "tok/s/user"),
        "",
        "## Per-user speed at matched throughput (tokens/s per user)",
        "",
        *_anchor_table(labels, frontiers, throughput_anchors, user_speed_at, "tok/s"),
        "",
        "## Runs",
        "",
        *_run_table(runs),
    ]
    return "\n".join(lines) + "\n"


def _anchor_table(labels, frontiers, anchors, read, unit) -> list[str]:
    rows = [
        "| configuration | " + " | ".join(f"at {a:g} {unit}" for a in anchors) + " |",
        "|---|" + "---:|" * len(anchors),
    ]
    base = [read(frontiers[labels[0]], a) for a in anchors] if labels else []
    for label in labels:
        cells = []
        for anchor, reference in zip(anchors, base):
            reading = read(frontiers[label], anchor)
            cells.append(_format_reading(reading, reference if label != labels[0] else None))
        rows.append(f"| {label} | " + " | ".join(cells) + " |")
    return rows


def _format_reading(reading: Reading | None, reference: Reading | None) -> str:
    if reading is None:
        return "-"
    text = f"{'>=' if reading.at_least else ''}{_num(reading.value)}"
    if reference is not None and reference.value > 0 and not reference.at_least:
        text += f" ({'>=' if reading.at_least else ''}{reading.value / reference.value:.2f}x)"
    return text


def _run_table(runs: list[dict]) -> list[str]:
    rows = [
        "| configuration | concurrency | ok / failed | output tok/s | per-user tok/s p50 | TTFT p50 / p99 ms "
        "| TPOT p50 / p99 ms | ITL p50 ms | goodput req/s | tau | acceptance by position | prefix cache hits "
        "| note |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---|",
    ]
    for run in runs:
        spec = run["spec"]
        tau = f"{spec['tau']:.2f}" if spec else "-"
        acceptance = " / ".join(f"{a:.2f}" for a in spec["acceptance_per_position"]) if spec else "-"
        cache = run.get("prefix_cache")  # absent in results written before the counters existed
        hits = f"{100 * cache['hit_rate']:.0f}%" if cache else "-"
        note = f"partial: {run['error']}" if run["error"] else ""
        rows.append(
            f"| {run['label']} | {run['concurrency']} | {run['completed']} / {run['failed']} "
            f"| {_num(run['output_throughput'])} | {_stat(run, 'user_tokens_per_s', 'p50')} "
            f"| {_stat(run, 'ttft_ms', 'p50')} / {_stat(run, 'ttft_ms', 'p99')} "
            f"| {_stat(run, 'tpot_ms', 'p50')} / {_stat(run, 'tpot_ms', 'p99')} "
            f"| {_stat(run, 'itl_ms', 'p50')} | {_num(run['goodput'])} "
            f"| {tau} | {acceptance} | {hits} | {note} |"
        )
    return rows


def _stat(run: dict, key: str, which: str) -> str:
    stats = run[key]
    return _num(stats[which]) if stats else "-"


def _num(value: float) -> str:
    """Three significant figures, without the exponent notation that `.3g` gives from 1000 on."""
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:.3g}"


def _round_all(values) -> list[float]:
    """Sorted, deduplicated, to 2 significant figures: readable column headers."""
    return sorted({float(f"{v:.2g}") for v in values if v > 0})


def write_report(runs: list[dict], directory: Path, anchors: Anchors, title: str) -> list[Path]:
    """pareto.png, report.md and results.json (every run) in `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    raw = directory / "results.json"
    raw.write_text(json.dumps(runs, indent=1) + "\n")
    table = directory / "report.md"
    table.write_text(markdown_report(runs, anchors, title))
    return [plot_pareto(runs, directory / "pareto.png", title), table, raw]
