"""The int4 and int8 linears of layers/quant.py on CUDA (and, under TRITON_INTERPRET=1, on CPU tensors: how
the suite tests them), one Triton kernel reading the layers' buffers in specserve's kernel layout as they
are: the same weights, fused projections and stacked experts as on the CPU, no second format.

The functions take the arguments of the CPU ops (`torch.ops.specserve.int4_linear` and the rest) and any
float activations ([..., K], bf16 on CUDA), which they keep: each weight tile is dequantized in fp32 (exactly
the CPU's weight, w = q * d * s_g + dmin * m_g for int4, q * s for int8), rounded to the activations' dtype
and multiplied on the tensor cores with fp32 sums (w4a16 / w8a16, as Marlin or GPTQ's kernels compute). The
CPU kernel quantizes activations to int8 as well; this one does not, so the two agree to a few activation
roundings, not bitwise.

One program computes BLOCK_M rows x BLOCK_N outputs over K in order; a dense call with too few programs to
fill the GPU (a small layer at decode) splits K into slices of programs of their own, whose fp32 sums are
added afterwards in a fixed order (`k_splits`: so the sums' order depends on the call's size, as cuBLAS's
does). Grouped calls (a mixture of experts' routed rows, sorted by expert) give each expert as many programs
as a dense call of all the rows would; those past its rows return at once, so the launch depends on the row
count alone (a CUDA graph replays it) and reads no count on the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.layers.triton_dots import INTERPRETED, cast, dot

TILE = 16  # output channels per tile of the kernel layout (quant.N_MULTIPLE)
LINE = 64  # bytes per line of a tile: 4 inputs x 16 channels (int4: two lines, low and high nibbles)
GROUPS_PER_SUPER = 8  # int4 groups sharing one d and dmin (quant.GROUPS_PER_SUPER)
BLOCK_N = 64  # outputs a program
MIN_PROGRAMS = 256  # a launch's programs, K split where it has fewer: about two for each SM of an H100 (132)
MAX_SPLITS = 8


def int4_linear(x, packed, scales, supers, bias=None) -> torch.Tensor:
    return _launch(x, None, bias, packed, scales, supers)


def int8_linear(x, packed, scales, bias=None) -> torch.Tensor:
    return _launch(x, None, bias, packed, scales, None)


def int4_grouped_linear(x, counts, packed, scales, supers) -> torch.Tensor:
    return _launch(x, counts, None, packed, scales, supers)


def int8_grouped_linear(x, counts, packed, scales) -> torch.Tensor:
    return _launch(x, counts, None, packed, scales, None)


def _launch(x, counts, bias, packed, scales, supers) -> torch.Tensor:
    """x [..., K] through one layer (counts None) or through E stacked layers (rows sorted by layer, counts
    [E]); packed, scales, supers [N / 16, ...] (stacked: [E, N / 16, ...])."""
    grouped = counts is not None
    layers = packed.shape[0] if grouped else 1
    int4 = supers is not None
    K = x.shape[-1]
    N = packed.shape[-3] * TILE
    group_size = K // scales.shape[-2]
    rows = x.reshape(-1, K)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    M = rows.shape[0]
    if M == 0:
        return rows.new_empty(*x.shape[:-1], N)
    block_m, block_k = (16 if M <= 64 else 64), min(group_size, 64)
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(torch.int32) if grouped else None
    tiles_per_layer = triton.cdiv(M, block_m)
    grid = (layers * tiles_per_layer, triton.cdiv(N, BLOCK_N))
    splits = 1 if grouped else k_splits(grid[0] * grid[1], K // block_k)
    # split: fp32 partial sums a split, added below in a fixed order (then the bias, then the rounding)
    out = rows.new_empty(M, N) if splits == 1 else rows.new_empty(splits, M, N, dtype=torch.float32)
    layer_strides = [t.stride(0) if grouped else 0 for t in (packed, scales, supers if int4 else scales)]
    _quantized_linear_kernel[(*grid, splits)](
        rows, out, bias, offsets, packed, scales, supers if int4 else scales,
        M, N, K, K // splits, tiles_per_layer, rows.stride(0), out.stride(-2), M * N, *layer_strides,
        INT4=int4, GROUPED=grouped, HAS_BIAS=bias is not None and splits == 1, GROUP=group_size,
        SUPERS=triton.cdiv(K // group_size, GROUPS_PER_SUPER),
        BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=block_k, WIDEN=INTERPRETED,
    )  # fmt: skip
    if splits > 1:
        out = out.sum(0)
        out = (out if bias is None else out + bias.float()).to(x.dtype)
    return out.reshape(*x.shape[:-1], N)


def k_splits(programs: int, k_steps: int) -> int:
    """Into how many slices of K a launch of `programs` programs splits its sums (a power of two dividing
    its `k_steps` steps, at most MAX_SPLITS): enough for MIN_PROGRAMS programs. A small layer at decode
    (Qwen3-0.6B's o_proj, 1024 outputs: 16 programs) would leave most of a GPU's SMs idle."""
    splits = 1
    while programs * splits < MIN_PROGRAMS and splits < MAX_SPLITS and k_steps % (2 * splits) == 0:
        splits *= 2
    return splits


@triton.jit
def _int4_tile(packed, groups, supers, k, group, tile, channel, live, K,
               GROUP: tl.constexpr, SUPERS: tl.constexpr):  # fmt: skip
    """Dequantized int4 weights [BLOCK_K, BLOCK_N] (inputs k, outputs 16 * tile + channel) in fp32."""
    pair = (tile[None, :] * (K // 8) + k[:, None] // 8) * 64 + 4 * channel[None, :] + k[:, None] % 4
    byte = tl.load(packed + pair, mask=live[None, :], other=0)
    code = (byte >> (k[:, None] // 4 % 2 * 4)) & 15
    at = (tile * (K // GROUP) + group) * 32 + channel
    sub_scale = tl.load(groups + at, mask=live, other=0).to(tl.float32)
    sub_min = tl.load(groups + at + 16, mask=live, other=0).to(tl.int32)
    sub_min = tl.where(sub_min > 127, sub_min - 256, sub_min).to(tl.float32)  # the byte is an int8
    at = (tile * SUPERS + group // 8) * 32 + channel
    d = tl.load(supers + at, mask=live, other=0).to(tl.float32)
    dmin = tl.load(supers + at + 16, mask=live, other=0).to(tl.float32)
    return code.to(tl.float32) * (d * sub_scale)[None, :] + (dmin * sub_min)[None, :]


@triton.jit
def _int8_tile(packed, scales, k, group, tile, channel, live, K, GROUP: tl.constexpr):
    """Dequantized int8 weights [BLOCK_K, BLOCK_N] in fp32."""
    line = (tile[None, :] * (K // 4) + k[:, None] // 4) * 64 + 4 * channel[None, :] + k[:, None] % 4
    q = tl.load(packed + line, mask=live[None, :], other=0)
    scale = tl.load(scales + (tile * (K // GROUP) + group) * 16 + channel, mask=live, other=0)
    return q.to(tl.float32) * scale.to(tl.float32)[None, :]


@triton.jit
def _quantized_linear_kernel(
    x, out, bias, offsets, packed, groups, supers,
    M, N, K, k_per_split, tiles_per_layer, x_stride, out_stride, out_split_stride,
    packed_layer_stride, groups_layer_stride, supers_layer_stride,
    INT4: tl.constexpr, GROUPED: tl.constexpr, HAS_BIAS: tl.constexpr, GROUP: tl.constexpr,
    SUPERS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    WIDEN: tl.constexpr,
):  # fmt: skip
    program = tl.program_id(0)
    layer = program // tiles_per_layer
    if GROUPED:  # the layer's rows: offsets[layer] up to offsets[layer + 1]
        first = tl.load(offsets + layer) + program % tiles_per_layer * BLOCK_M
        end = tl.load(offsets + layer + 1)
    else:
        first = program * BLOCK_M
        end = M
    if first < end:
        packed += layer.to(tl.int64) * packed_layer_stride
        groups += layer.to(tl.int64) * groups_layer_stride
        supers += layer.to(tl.int64) * supers_layer_stride
        row = first + tl.arange(0, BLOCK_M)
        row_live = row < end
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        live = n < N
        tile, channel = n // 16, n % 16
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        k_first = tl.program_id(2) * k_per_split  # this program's slice of K (`k_splits`)
        for k_start in range(k_first, k_first + k_per_split, BLOCK_K):  # a step lies in one group
            k = k_start + tl.arange(0, BLOCK_K)
            x_at = row[:, None].to(tl.int64) * x_stride + k[None, :]
            x_tile = tl.load(x + x_at, mask=row_live[:, None], other=0.0)
            group = k_start // GROUP
            if INT4:
                w = _int4_tile(packed, groups, supers, k, group, tile, channel, live, K, GROUP, SUPERS)
            else:
                w = _int8_tile(packed, groups, k, group, tile, channel, live, K, GROUP)
            acc = dot(x_tile, cast(w, x_tile.dtype, WIDEN), acc, WIDEN)
        if HAS_BIAS:
            acc += tl.load(bias + n, mask=live, other=0).to(tl.float32)[None, :]
        out_at = tl.program_id(2).to(tl.int64) * out_split_stride + row[:, None].to(tl.int64) * out_stride
        out_at += n[None, :]
        tl.store(out + out_at, cast(acc, out.dtype.element_ty, WIDEN), mask=row_live[:, None] & live[None, :])
