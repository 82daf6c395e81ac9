"""`python -m specserve.bench.moe` end to end on one layer, without llama.cpp: the figures it reports are
there and consistent (timings for both modes, reads growing with the rows' distinct experts)."""

from __future__ import annotations

import json

import pytest

from specserve.bench import moe
from specserve.layers import kernels

pytestmark = pytest.mark.skipif(
    kernels.ops() is None, reason="the bench groups experts on specserve's kernels"
)


def test_the_moe_bench_times_both_modes_and_writes_its_results(tmp_path):
    out = tmp_path / "results.json"
    moe.main(["--layers", "1", "--rounds", "1", "--no-llama", "--out", str(out)])
    result = json.loads(out.read_text())
    assert set(result["t_ms"]) == {"grouped", "loop"}
    for mode in ("grouped", "loop"):
        assert all(result["t_ms"][mode][str(q)] > 0 for q in moe.Q_VALUES)
    reads = [result["read_bytes"][str(q)] for q in moe.Q_VALUES]
    assert reads == sorted(reads) and reads[-1] > reads[0]  # more rows, more distinct experts read
    assert result["roofline_tokens_per_s"] > 0 and result["layers"] == 1
