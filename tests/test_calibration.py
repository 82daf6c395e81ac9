"""Confidence calibration: metrics, Sequential Temperature Scaling on synthetic over-confident data, and the
engine's live per-position statistics and the online correction the scheduled policies read."""

from __future__ import annotations

import pytest
import torch

from specserve.spec_decode.calibration.offline import (
    VerificationRecords,
    auc,
    calibration_report,
    ece,
    fit_sts,
    load_temperatures,
    position_data,
    save_temperatures,
)
from specserve.spec_decode.calibration.online import LiveCalibration, Recalibration

pytestmark = pytest.mark.kernel_agnostic


def overconfident_rounds(n: int = 4000, k: int = 4, true_temperature: float = 3.0, seed: int = 0):
    """Rounds whose drafts survive with probability sigmoid(l / 3) while the head claims sigmoid(l)."""
    g = torch.Generator().manual_seed(seed)
    records = VerificationRecords()
    for _ in range(n):
        logits = torch.randn(k, generator=g, dtype=torch.double) + 1.5
        survive = torch.rand(k, generator=g, dtype=torch.double) < torch.sigmoid(logits / true_temperature)
        accepted = int(torch.cumprod(survive.long(), 0).sum())
        records.add(logits, accepted)
    return records.arrays()


def test_metrics_on_known_cases():
    pred = torch.tensor([0.1, 0.1, 0.9, 0.9])
    assert abs(ece(pred, torch.tensor([0.0, 0.0, 1.0, 1.0])) - 0.1) < 1e-6
    assert auc(pred, torch.tensor([0.0, 0.0, 1.0, 1.0])) == 1.0
    assert auc(pred, torch.tensor([0.0, 1.0, 0.0, 1.0])) == 0.5


def test_sts_lowers_ece_and_keeps_the_order_within_a_position(tmp_path):
    logits, lengths, accepted = overconfident_rounds()
    temperatures = fit_sts(logits, lengths, accepted)
    assert all(t > 1.5 for t in temperatures)  # over-confident: every position is cooled
    report = calibration_report(logits, lengths, accepted, temperatures)
    for row in report:
        assert row["ece_sts"] < row["ece_raw"] and row["ece_sts"] < 0.03
    # Per-slot confidence is a monotone function of the logit at every position: the order is kept.
    for j, t in enumerate(temperatures):
        raw_order = torch.argsort(logits[:, j])
        assert torch.equal(torch.argsort(torch.sigmoid(logits[:, j] / t)), raw_order)
    assert load_temperatures(save_temperatures(temperatures, tmp_path).parent) == temperatures


def test_live_calibration_matches_the_offline_ece():
    logits, lengths, accepted = overconfident_rounds(n=1000)
    live = LiveCalibration()
    for row, n, a in zip(logits, lengths, accepted):
        live.record(torch.cumprod(torch.sigmoid(row[:n]), 0), int(a))
    ones = [1.0] * logits.shape[1]
    offline = [ece(*position_data(logits, lengths, accepted, ones, j)) for j in range(logits.shape[1])]
    assert all(abs(a - b) < 1e-9 for a, b in zip(live.ece_per_position(), offline, strict=True))
    assert live.samples_per_position() == [int((lengths > j).sum()) for j in range(logits.shape[1])]


def test_calibrate_command_writes_temperatures_the_engine_applies(tiny_model_dir, tmp_path):
    from specserve import LLM, SamplingParams
    from specserve.train.calibrate import calibrate
    from tests.tiny_models import save_tiny_drafter

    target = str(tiny_model_dir("qwen3"))
    drafter_dir = save_tiny_drafter(target, tmp_path / "drafter", std=0.2)
    spec = {"method": "dspark", "model": str(drafter_dir)}
    llm = LLM(target, max_model_len=128, speculative_config=spec)
    prompts = [[5 + i, 6, 7 + i, 8] for i in range(12)]
    report = calibrate(llm, prompts, SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=0))
    assert [r["position"] for r in report] == [1, 2, 3, 4] and report[0]["samples"] > 50
    for name in ("sts_temperatures.json", "calibration_report.json", "reliability_diagram.png"):
        assert (drafter_dir / name).is_file()
    temperatures = load_temperatures(drafter_dir)
    fresh = LLM(target, max_model_len=128, speculative_config=spec)
    assert fresh.engine.speculator.drafter.temperatures == temperatures


def test_recalibration_shrinks_towards_the_raw_confidence_until_rounds_accumulate():
    recal = Recalibration()
    raw = torch.tensor([0.9, 0.9])
    assert torch.equal(recal.correct(raw), raw.double())  # nothing seen yet
    recal.record(raw, 0)  # draft 1 rejected, draft 2 never tried
    prior = Recalibration.PRIOR_ROUNDS
    assert torch.allclose(recal.correct(raw), torch.tensor([prior * 0.9 / (1 + prior), 0.9]).double())


def test_recalibration_learns_the_realised_acceptance_by_position_and_confidence():
    """Two kinds of draft, both over-confident: each gets its own realised conditional acceptance per
    position, and positions never tried keep the raw confidence."""
    g = torch.Generator().manual_seed(0)
    realised = {0.95: [0.8, 0.5, 0.5], 0.55: [0.5, 0.3, 0.2]}
    recal = Recalibration()
    for i in range(6000):
        claimed = (0.95, 0.55)[i % 2]
        accepted = 0
        while accepted < 3 and float(torch.rand(1, generator=g)) < realised[claimed][accepted]:
            accepted += 1
        recal.record(torch.full((3,), claimed), accepted)
    for claimed, rates in realised.items():
        expected = torch.tensor([*rates, claimed], dtype=torch.double)
        assert torch.allclose(recal.correct(torch.full((4,), claimed)), expected, atol=0.06)


def test_the_report_says_auc_is_undefined_where_every_round_ended_alike():
    """Greedy calibration of a weak drafter: no round got past the first draft, so positions 2 and 3 have
    one class only and no AUC; the report says so (null in JSON, '-' in the table), not nan."""
    import json

    from specserve.train.calibrate import format_report

    logits = torch.tensor([[0.5, -1.0, 0.2], [-0.3, 0.1, 0.4], [-2.0, 0.0, -2.0], [0.2, 0.3, 0.1]])
    lengths, accepted = torch.tensor([3, 3, 3, 3]), torch.tensor([1, 0, 0, 1])
    report = calibration_report(logits.double(), lengths, accepted, [1.0, 1.0, 1.0])
    assert report[0]["auc"] == 1.0 and [r["auc"] for r in report[1:]] == [None, None]
    json.dumps(report, allow_nan=False)  # valid JSON
    table = format_report(report).splitlines()
    assert "nan" not in "\n".join(table) and table[2].split()[5] == "-"
