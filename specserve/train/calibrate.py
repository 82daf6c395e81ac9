"""`specserve calibrate`: fit STS temperatures for a drafter's confidence head on held-out prompts.

Runs target + drafter (every draft verified, raw confidences) on the prompts, records per round the
confidence logits of the verified drafts and how many were accepted, fits one temperature per position
(`calibration.fit_sts`), writes them beside the drafter (the engine applies them from then on), and reports
ECE / AUC / Brier per position before and after, with a reliability diagram.
"""

from __future__ import annotations

import json
from pathlib import Path

from specserve.config import SamplingParams, SpecserveError
from specserve.spec_decode.calibration.offline import (
    VerificationRecords,
    calibration_report,
    fit_sts,
    position_data,
    reliability_diagram,
    save_temperatures,
)


def calibrate(llm, prompts: list, params: SamplingParams, output_dir: str | Path | None = None) -> list[dict]:
    """Fit and save STS temperatures for `llm`'s drafter; returns the per-position report."""
    speculator = llm.engine.speculator
    drafter = speculator.drafter if speculator is not None else None
    if drafter is None or getattr(getattr(drafter, "model", None), "confidence_head", None) is None:
        raise SpecserveError("calibration needs a drafter with a confidence head (method 'dspark')")
    if speculator.config.verify_policy != "fixed":
        raise SpecserveError("calibrate with verify_policy 'fixed': every draft must be verified")
    drafter.temperatures = None  # record the raw confidences
    speculator.verification_records = records = VerificationRecords()
    try:
        llm.generate(prompts, params, use_tqdm=True)
    finally:
        speculator.verification_records = None
    if not records.logits:
        raise SpecserveError("no verification round recorded: give more prompts or more tokens")
    logits, lengths, accepted = records.arrays()
    temperatures = fit_sts(logits, lengths, accepted)
    report = calibration_report(logits, lengths, accepted, temperatures)
    directory = Path(output_dir or drafter.model.checkpoint_dir)
    directory.mkdir(parents=True, exist_ok=True)
    save_temperatures(temperatures, directory)
    (directory / "calibration_report.json").write_text(json.dumps(report, indent=2))
    ones = [1.0] * len(temperatures)
    panels = [
        (
            *position_data(logits, lengths, accepted, ones, j),
            *position_data(logits, lengths, accepted, temperatures, j),
        )
        for j in range(len(temperatures))
    ]
    reliability_diagram(panels, directory / "reliability_diagram.png")
    drafter.temperatures = temperatures
    return report


def format_report(report: list[dict]) -> str:
    lines = [f"{'pos':>3} {'n':>6} {'T':>6} {'ECE raw':>8} {'ECE STS':>8} {'AUC':>6} {'Brier':>6}"]
    for r in report:
        auc = "-" if r["auc"] is None else f"{r['auc']:.3f}"  # None: every round ended alike there
        lines.append(
            f"{r['position']:>3} {r['samples']:>6} {r['temperature']:>6.2f} {r['ece_raw']:>8.4f} "
            f"{r['ece_sts']:>8.4f} {auc:>6} {r['brier_sts']:>6.3f}"
        )
    return "\n".join(lines)
