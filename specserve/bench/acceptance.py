"""`specserve eval`: acceptance of drafters on evaluation sets, DeepSpec's protocol (DSPARK.md §4.4-4.6):
the first turn of each row through the chat template, temperature 1 by default; per dataset tau (bonus
token included), draft tokens per round, prefix survival and conditional acceptance per position, and, for
drafters with a confidence head, calibration (ECE / AUC per position). JSON, a table, and a PNG with
one line per drafter.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from specserve.config import SamplingParams
from specserve.core.spec_stats import SpecStats
from specserve.spec_decode.calibration.offline import VerificationRecords, auc, ece, position_data


@dataclass
class AcceptanceResult:
    drafter: str
    dataset: str
    prompts: int
    tau: float
    drafts_per_round: float
    prefix_survival: list[float]
    conditional_acceptance: list[float]
    ece: list[float] = field(default_factory=list)
    auc: list[float | None] = field(default_factory=list)  # None: one class only at that position


def evaluate(llm, drafter: str, dataset: str, prompts: list[str], params: SamplingParams) -> AcceptanceResult:
    speculator = llm.engine.speculator
    speculator.stats = SpecStats()
    records = VerificationRecords()
    speculator.verification_records = records
    try:
        llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=True)
    finally:
        speculator.verification_records = None
    stats = speculator.stats
    result = AcceptanceResult(
        drafter=drafter,
        dataset=dataset,
        prompts=len(prompts),
        tau=stats.mean_acceptance_length,
        drafts_per_round=stats.num_draft_tokens / stats.num_drafts if stats.num_drafts else 0.0,
        prefix_survival=stats.prefix_survival(),
        conditional_acceptance=stats.conditional_acceptance(),
    )
    if records.logits:  # the drafter has a confidence head: calibration of the survival it predicted
        logits, lengths, accepted = records.arrays()
        ones = [1.0] * logits.shape[1]
        for j in range(logits.shape[1]):
            pred, label = position_data(logits, lengths, accepted, ones, j)
            result.ece.append(ece(pred, label))
            result.auc.append(auc(pred, label))
    return result


def format_table(results: list[AcceptanceResult]) -> str:
    datasets = sorted({r.dataset for r in results})
    drafters = list(dict.fromkeys(r.drafter for r in results))
    by_key = {(r.drafter, r.dataset): r for r in results}
    lines = [f"{'tau':<20}" + "".join(f"{d:>12}" for d in datasets)]
    for name in drafters:
        cells = [by_key.get((name, d)) for d in datasets]
        lines.append(f"{name:<20}" + "".join(f"{c.tau:>12.2f}" if c else f"{'-':>12}" for c in cells))
    return "\n".join(lines)


def plot_acceptance(results: list[AcceptanceResult], path: str | Path) -> Path:
    """Prefix survival per position, one panel per dataset, one line per drafter."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    datasets = sorted({r.dataset for r in results})
    fig, axes = plt.subplots(1, len(datasets), figsize=(4 * len(datasets), 3.5), squeeze=False)
    for ax, dataset in zip(axes[0], datasets):
        for r in (r for r in results if r.dataset == dataset):
            positions = range(1, len(r.prefix_survival) + 1)
            ax.plot(positions, r.prefix_survival, marker="o", label=f"{r.drafter} (tau {r.tau:.2f})")
        ax.set(title=dataset, xlabel="draft position", ylim=(0, 1))
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("prefix survival (accept_rate@k)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def save_results(results: list[AcceptanceResult], directory: str | Path) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "acceptance.json").write_text(json.dumps([asdict(r) for r in results], indent=2))
    plot_acceptance(results, directory / "acceptance.png")
    return directory
