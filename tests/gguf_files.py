"""Helpers for the tests that write GGUF files as llama.cpp's converter does (tests/test_gguf_*.py): tensors
added as the converter stores them, llama.cpp's logits on a file, the converted checkpoint read back,
transformers' greedy tokens."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

PROMPT = [5, 17, 3, 42, 8, 99, 1, 64]


def add_tensor(w: gguf.GGUFWriter, name: str, x: np.ndarray, quantized: QT | None, matrix: bool) -> None:
    """F32, or `quantized` blocks for a matrix whose rows split into whole blocks (as the converter falls back
    to F32 for the others)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if quantized is not None and matrix and x.shape[-1] % gguf.GGML_QUANT_SIZES[quantized][0] == 0:
        w.add_tensor(name, gguf.quants.quantize(x, quantized), raw_dtype=quantized)
    else:
        w.add_tensor(name, x)


def finish(w: gguf.GGUFWriter) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def assert_llama_cpp_reads_as(model, path: Path, ids: list[int] = PROMPT, rtol: float = 2e-3) -> None:
    """llama.cpp's logits on the file are `model`'s (transformers') on the same tokens, within `rtol` of the
    largest; skipped where llama-cpp-python is not installed. Its KV cache is fp32 (fp16 by default), so that
    the layout, not the cache's rounding, decides."""
    llama_cpp = pytest.importorskip("llama_cpp")
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0].numpy()
    f32 = int(gguf.GGMLQuantizationType.F32)
    llm = llama_cpp.Llama(
        str(path), n_ctx=64, logits_all=True, verbose=False, n_threads=2, type_k=f32, type_v=f32
    )
    llm.eval(ids)
    got = np.asarray(llm.scores[: len(ids)])
    np.testing.assert_allclose(got, expected, atol=rtol * np.abs(expected).max())


def checkpoint(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors checkpoint directory."""
    from safetensors.torch import load_file

    return {k: v for f in sorted(Path(model_dir).glob("*.safetensors")) for k, v in load_file(f).items()}


def transformers_greedy(model, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    with torch.no_grad():
        return [
            model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=tokens, min_new_tokens=tokens)[
                0, len(p) :
            ].tolist()
            for p in prompts
        ]


def assert_quantized_loading_is_quantizing_the_conversion(path: Path, mode: str, requantized=()):
    """Loading the (Q8_0) file with `quantization=mode` gives every quantized layer that quantizing its fp32
    conversion gives: int8 keeps the file's codes (d in bf16) but in the layers whose last name is in
    `requantized`, int4 requantizes; the engine then generates from the file. Returns (the model loaded
    quantized, the conversion quantized, the last names of the layers checked)."""
    from torch import nn

    from specserve import LLM, SamplingParams
    from specserve.layers.linear import PackedLinear
    from specserve.layers.quant import Int4Linear, Int8Linear, quantize_model
    from specserve.models.loader import load_model, resolve_model

    model_dir = resolve_model(str(path))
    from_gguf, _, _ = load_model(str(model_dir), quantization=mode)
    dense, _, _ = load_model(str(model_dir))
    linears = nn.Linear | PackedLinear  # packed by oneDNN where specserve's kernels are not built
    fp32 = {name: m.weight.clone() for name, m in dense.named_modules() if isinstance(m, linears)}
    assert quantize_model(dense, mode) > 0
    layers = dict(from_gguf.named_modules())
    checked = set()
    for name, module in dense.named_modules():
        if isinstance(module, Int8Linear | Int4Linear) and not name.endswith((".coarse", ".residual")):
            layer, leaf = layers[name], name.rpartition(".")[2]
            assert type(layer) is type(module), name
            if mode == "int8" and leaf not in requantized:  # the file's codes, d in bf16
                value = fp32[name]
                assert ((layer.weight - value).abs() <= 2**-8 * value.abs()).all(), name
            else:
                assert torch.equal(layer.weight, module.weight), name
            checked.add(leaf)
    llm = LLM(str(path), quantization=mode, max_model_len=64, kv_cache_memory="16MiB")
    out = llm.generate([[1, 5, 9, 2]], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 6
    return from_gguf, dense, checked
