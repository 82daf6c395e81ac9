"""models/prepare.py: a quantized model's prepared form is cached once, and a cached load computes exactly
what a fresh one does without reading the source weights."""

from __future__ import annotations

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.layers import kernels
from specserve.models import loader, prepare, weight_files
from specserve.models.base import CausalLM
from specserve.models.prepare import PreparedWeights

ARCHS = ["qwen2", "qwen3_moe", "gemma3", "qwen3_5"]  # tied heads (qwen2, gemma3), experts, a hybrid


def greedy(model_dir, quantization: str) -> tuple[list[int], list[float]]:
    llm = LLM(model=str(model_dir), quantization=quantization, kv_cache_memory="16MiB", max_num_seqs=4)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)
    out = llm.generate([{"prompt_token_ids": [5, 17, 33, 64, 100, 7]}], params)[0].outputs[0]
    return out.token_ids, [step[token] for step, token in zip(out.logprobs, out.token_ids)]


def cache_for(model_dir, quantization: str) -> PreparedWeights:
    return PreparedWeights(weight_files.safetensors_files(model_dir), quantization, torch.float32)


@pytest.mark.parametrize("quantization", ["int4", "int8"])
@pytest.mark.parametrize("arch", ARCHS)
def test_a_cached_load_computes_what_a_fresh_one_does(
    arch, quantization, tiny_model_dir, tmp_path, monkeypatch
):
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path))
    monkeypatch.setenv("SPECSERVE_AUTO_DTYPE", "float32")
    monkeypatch.setattr(prepare, "MIN_CACHED_BYTES", 0)  # the tiny models are cached too
    model_dir = tiny_model_dir(arch)
    fresh = greedy(model_dir, quantization)
    cache = cache_for(model_dir, quantization)
    if kernels.ops() is None:  # torch's int4 kernel: its layers are rebuilt from the weights every time
        assert not cache.exists()
        return
    assert cache.exists()

    def no_source_reads(*args, **kwargs):
        raise AssertionError("a cached load read the source weights")

    monkeypatch.setattr(CausalLM, "load_weights", no_source_reads)
    assert greedy(model_dir, quantization) == fresh


def test_weights_cached_for_the_kernels_are_not_read_without_them(tiny_model_dir, tmp_path, monkeypatch):
    """A cache entry holds the kernels' layout: a process without them (SPECSERVE_NO_KERNELS=1, a machine
    that cannot build them) loads from the source instead, and computes what torch's int4 layers compute."""
    if kernels.ops() is None:
        pytest.skip("specserve's kernels are not built here")
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path))
    monkeypatch.setenv("SPECSERVE_AUTO_DTYPE", "float32")
    monkeypatch.setattr(prepare, "MIN_CACHED_BYTES", 0)
    model_dir = tiny_model_dir("qwen2")
    greedy(model_dir, "int4")
    assert cache_for(model_dir, "int4").exists()
    monkeypatch.setenv(kernels.ENV_VAR, "1")
    without_kernels = greedy(model_dir, "int4")
    monkeypatch.setattr(prepare, "MIN_CACHED_BYTES", 1 << 60)  # no cache at all: the reference
    assert greedy(model_dir, "int4") == without_kernels


def test_the_key_follows_the_source_and_the_settings(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path))
    model_dir = tiny_model_dir("qwen3")
    int4 = cache_for(model_dir, "int4").directory
    assert cache_for(model_dir, "int4").directory == int4
    assert cache_for(model_dir, "int8").directory != int4
    assert (
        PreparedWeights(weight_files.safetensors_files(model_dir), "int4", torch.bfloat16).directory != int4
    )
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in model_dir.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    assert cache_for(copy, "int4").directory != int4  # other files (path, size or time) are another source


def test_small_models_are_not_cached(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path))
    model_dir = tiny_model_dir("qwen3")
    assert (
        PreparedWeights.for_source(weight_files.safetensors_files(model_dir), "int4", torch.float32) is None
    )
    loader.load_model(str(model_dir), quantization="int4")
    assert not (tmp_path / "prepared").exists()
