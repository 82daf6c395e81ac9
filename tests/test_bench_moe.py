"""`python -m specserve.bench.moe` end to end on one layer, without llama.cpp: the figures it reports are
there and consistent (timings for both modes, reads growing with the rows' distinct experts)."""

from __future__ import annotations

import dataclasses
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


@pytest.fixture
def few_experts(monkeypatch):
    """Qwen3.6-35B-A3B's shapes with 16 experts instead of 256 (its layers made in seconds)."""
    shape = moe.SHAPES["qwen3.6-35b-a3b"]
    fields = {**shape.fields, "num_experts": 16}
    monkeypatch.setitem(moe.SHAPES, "qwen3.6-35b-a3b", dataclasses.replace(shape, fields=fields))


def test_the_hybrid_shapes_are_timed_with_their_recurrent_state(tmp_path, few_experts):
    """Three Gated DeltaNet layers to one full-attention layer; q > 1 rows verify with checkpoints."""
    out = tmp_path / "results.json"
    args = ["--model", "qwen3.6-35b-a3b", "--layers", "4", "--context", "8", "--rounds", "1", "--no-llama"]
    moe.main([*args, "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["model"] == "qwen3.6-35b-a3b" and result["layers"] == 4
    assert all(result["t_ms"]["grouped"][str(q)] > 0 for q in moe.Q_VALUES)
    with pytest.raises(SystemExit, match="one full-attention layer in 4"):
        moe.shaped_config(6, "qwen3.6-35b-a3b")


def test_the_hybrid_gguf_is_llama_cpps_qwen35moe(tmp_path, few_experts):
    """The GGUF llama.cpp is timed on: tensors all known to specserve's reader, the config the shaped one."""
    from gguf import GGUFReader

    from specserve.models import gguf as sgguf
    from specserve.models.gguf_tensors import plan_tensors

    config = moe.shaped_config(4, "qwen3.6-35b-a3b")
    path = tmp_path / "shaped.gguf"
    moe.write_gguf(config, str(path))
    reader = GGUFReader(str(path))
    read = sgguf.build_hf_config(reader)
    for field in ("layer_types", "num_experts", "shared_expert_intermediate_size", "linear_num_value_heads"):
        assert getattr(read, field) == getattr(config, field), field
    assert read.rope_parameters["partial_rotary_factor"] == 0.25
    names = {p.hf_name for p in plan_tensors(reader)}
    assert "model.layers.3.self_attn.q_proj.weight" in names
    assert {"model.layers.0.linear_attn.A_log", "model.layers.0.mlp.shared_expert_gate.weight"} <= names
