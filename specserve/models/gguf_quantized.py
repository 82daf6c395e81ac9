"""Quantized loading of a GGUF (`load_quantized`, used when the engine is asked for int8 / int4): the
linear weights are read from the GGUF itself, by the plan of `models/gguf_tensors.py`, rather than from
the fp32 conversion. Q8_0 blocks become int8 (their codes and scales) and Q4_K blocks int4 (group 32,
their own codes and two-level scales, exactly: the kernel's int4 format is Q4_K's) without an fp32 copy
of the tensor; other types (Q4_0 among them) are dequantized in memory, one tensor at a time, and
requantized. Rows put back in order (or picked: Qwen3-Next's ssm_ba) move whole blocks (exact); columns
put back (Qwen3.5's out_proj) cross them, so that weight is requantized.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from specserve.layers.quant import (
    Int4Linear,
    Int4Weights,
    Int8Linear,
    QuantizedLinear,
    quantizable_weights,
    quantize_row_blocks,
    replace_module,
)
from specserve.models.gguf_header import GGUFHeader
from specserve.models.gguf_tensors import PlannedTensor, dequantized_row_blocks, iter_converted, plan_tensors

# ------------------------------------------------------------------------------------- quantized loading
# Block layouts (ggml's ggml-common.h; the tests check them against gguf.quants' own dequantization):
#   Q8_0: 32 weights in 34 bytes: fp16 d, 32 int8 codes; w = d * q.
#   Q4_K: 256 weights in 144 bytes: fp16 d, fp16 dmin, 12 bytes of eight 6-bit (scale, min) pairs, then 4
#         chunks of 32 bytes, chunk c holding sub-block 2c in its low nibbles and 2c + 1 in its high ones;
#         w = d * scale_j * q - dmin * min_j for sub-block j (32 weights).


def _fp16(raw: np.ndarray) -> np.ndarray:
    """[..., 2] bytes -> [...] float32."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def decode_q8_0(data: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 rows [N, row bytes] -> (q int8 [N, K], scales float32 [N, K / 32]) with w = q * scale."""
    blocks = data.reshape(data.shape[0], -1, 34)
    q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(data.shape[0], -1)
    return torch.from_numpy(q), torch.from_numpy(_fp16(blocks[..., :2]))


def _q4_k_scales_and_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 scale bytes of each Q4_K block -> 8 six-bit scales and 8 six-bit mins."""
    low, high, extra = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = np.concatenate([low & 0x3F, (extra & 0x0F) | ((low >> 6) << 4)], axis=-1)
    mins = np.concatenate([high & 0x3F, (extra >> 4) | ((high >> 6) << 4)], axis=-1)
    return scales.astype(np.uint8), mins.astype(np.uint8)


def decode_q4_k(data: np.ndarray) -> Int4Weights:
    """Q4_K rows -> the same weight as `Int4Weights` (group 32, super-blocks of 8 groups): Q4_K's min is
    subtracted, -dmin * m, so the sub-minimums are the negated six-bit mins."""
    rows = data.shape[0]
    blocks = data.reshape(rows, -1, 144)
    d, dmin = _fp16(blocks[..., 0:2]), _fp16(blocks[..., 2:4])
    sub_scales, sub_mins = _q4_k_scales_and_mins(blocks[..., 4:16])
    chunks = blocks[..., 16:].reshape(rows, -1, 4, 1, 32)
    q = np.concatenate([chunks & 0x0F, chunks >> 4], axis=-2).reshape(rows, -1)
    return Int4Weights(
        torch.from_numpy(q),
        torch.from_numpy(d),
        torch.from_numpy(dmin),
        torch.from_numpy(sub_scales.reshape(rows, -1)),
        torch.from_numpy(-sub_mins.reshape(rows, -1).astype(np.int8)),
    )


def quantized_linear_from_gguf(
    tensor, plan: PlannedTensor, mode: str, bias, use_kernel: bool | None = None
) -> QuantizedLinear:
    """The quantized layer for one GGUF linear weight: from its blocks (rows put in order) when the format
    maps onto the mode and no column moves, else dequantized and requantized a block of rows at a time."""
    kind = tensor.ggml_type.name
    raw = tensor.data if plan.expert is None else tensor.data[plan.expert]
    if (rows := plan.row_index(raw.shape[0])) is not None:  # whole rows move: the blocks stay as they are
        raw = raw[rows]
    columns = None
    if plan.v_heads is not None and plan.v_heads.axis == 1:  # columns move across blocks: requantized
        columns = plan.v_heads.index(plan.shape[1])
    if columns is None and mode == "int8" and kind == "Q8_0":
        return Int8Linear(*decode_q8_0(raw), bias, use_kernel)
    if columns is None and mode == "int4" and kind == "Q4_K":
        return Int4Linear(decode_q4_k(raw), bias, use_kernel)
    blocks = (
        torch.from_numpy(block if columns is None else block[:, columns])
        for block in dequantized_row_blocks(raw, tensor.ggml_type)
    )
    return quantize_row_blocks(blocks, plan.shape, bias, mode, use_kernel=use_kernel)


def load_quantized(
    gguf_path: Path, model, mode: str, use_kernel: bool | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Replace every quantizable linear layer of `model` (built, not yet loaded) by its quantized version
    read from the GGUF (`use_kernel`: the layers', as `quantize_model`'s), and return the remaining
    tensors, dequantized, for `model.load_weights`.

    A replaced layer's fp32 weight is never written, so (allocated uninitialised) it never takes memory.
    Layers the file does not hold (a head tied to the embedding) are left for `quantize_model`."""
    from tqdm.auto import tqdm

    reader = GGUFHeader(gguf_path)
    plan = plan_tensors(reader)
    targets = quantizable_weights(model, mode)
    rest = []
    # slow where blocks are requantized (Q6_K, Q5_0: numpy); the result is cached (models/prepare.py)
    for p in tqdm(plan, desc=f"{mode} weights from {gguf_path.name}", unit="tensor", leave=False):
        names = targets.get(p.hf_name)
        if names is None:
            if model.checkpoint_name_map(p.hf_name) is not None:  # not the tensors it skips (`mtp.*`)
                rest.append(p)
            continue
        bias = model.get_submodule(names[0]).bias
        layer = quantized_linear_from_gguf(reader.tensors[p.source], p, mode, bias, use_kernel)
        replace_module(model, names, layer)
        reader.release_pages()
    return _as_tensors(reader, iter_converted(reader, rest))


def _as_tensors(
    reader: GGUFHeader, arrays: Iterator[tuple[PlannedTensor, np.ndarray]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The arrays as tensors for `load_weights`, which adopts those it can: an F32 tensor straight from the
    read-only memory map is copied."""
    for p, arr in arrays:
        yield p.hf_name, torch.from_numpy(arr if arr.flags.writeable else arr.copy())
        reader.release_pages()
