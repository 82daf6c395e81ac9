"""Weight-only int8 / int4 linear layers, and `quantize_model`: on specserve's own kernel where it is built
(specserve/layers/kernels), else on PyTorch's int4 CPU kernel. On CUDA the same buffers, in specserve's
kernel layout, run in a Triton kernel (layers/triton_qlinear.py; `use_device_kernels`).

Formats (w is the fp32 weight, [out N, in K]; activations stay fp32 outside the layers):
- int4: asymmetric, w ~ q * s + m with q in [0, 15] and a scale s and minimum m per group of G = 32
  inputs (64, 128, 256 also work), in two levels as GGUF's Q4_K (`Int4Weights`): s = d * s_g and m = dmin *
  m_g with 8-bit s_g, m_g per group and fp16 d, dmin per 8 groups: 4.625 bits a weight at G = 32. The grid
  of each group covers its weights (m rounded down, s up to those steps), q rounds to it: at most half a
  step of error. GGUF Q4_K blocks keep their own codes and scales, exactly (models/gguf_quantized.py).
- int8: symmetric, w ~ q * s, q in [-127, 127], s = max|w| / 127 per group of 32: GGUF Q8_0's format, so
  Q8_0 blocks map in as they are. Weight error: at most half a step, max|w| / 254 per group.

specserve's kernel (qlinear.cpp; chosen over torch.compile's CPU path by the measurements in
docs/quantization.md): activations are quantized to int8 per block of 32 inputs, dynamically (scale
max|x| / 127, as llama.cpp's Q8_0 activations), each block's dot product is exact integer arithmetic
(AVX2 maddubs, AVX-512 VNNI dpbusd, AMX tile multiplies), and the block results are summed in fp32,
which is also the output dtype. Per block, not per row: one outlier input (Qwen's MLP activations have
some hundreds of times the median) then costs resolution only in its own block. That rounding is the
error the kernel adds: at most half an int8 step per input, max|x| / 254 in its block (0.5% rms of the
output on Gaussian data, as much as int8's own weight rounding adds). int8 scales are stored in fp16
(Q8_0's own are exact in it); int4's two levels are exact in fp32 (an fp16 times an 8-bit integer); a
layer whose scales overflow fp16 keeps torch's kernel.
`SPECSERVE_NO_KERNELS=1`, a failed build or a CPU without AVX2 give torch's kernel everywhere.

torch's kernel (`aten._weight_int4pack_mm_for_cpu`, weight packed by `_convert_weight_to_int4pack_for_cpu`,
scales and zeros bf16, [K / G, N, 2]): vectorized on x86 only for bf16 inputs, so the layer's input and
output are rounded to bf16 (2^-8 relative) around it; it dequantizes to fp32 and accumulates in fp32.
int8 runs as two int4 planes of it (`int8_from_q8_0`: c = q + 128 = 16 a + b, two calls added in fp32),
its scale rounded to bf16. torch's own int8 kernel (`_weight_int8pack_mm`) was measured and not used: one
scale per output channel (median / worst relative weight error over Qwen2.5-Coder-1.5B's layers 1.2% /
4.8%, against 0.2% / 0.7% per group), and its fp32 instantiation is a scalar loop. On 2 cores torch's int4
kernel reads its weights at ~10 GB/s, bound by dequantization (a table lookup and two FMAs per weight per
4 rows): specserve's kernel is 1.7-5x faster from M = 1 to 256 here (docs/quantization.md).

The LM head: `QUANTIZE_HEAD`. int8 keeps it fp32 (the accurate mode; near ties between logits of ~20 move
with the rounding of either kernel: bf16 outputs for torch's, int8 inputs for ours); int4 quantizes it,
for speed (15% of the weights).

Both kernels are batch invariant: a row's output is bitwise the same whatever other rows share the call,
so greedy speculation stays exact. specserve's: every output element is one fp32 accumulator that adds
the block terms in order whatever M is; rows are grouped (4 at a time) only to share the unpacking of a
weight tile, and threads split output tiles, never K; its scalar, AVX2 and AVX-512 paths give the same
bits (tests/test_kernels.py). torch's: tiles of 4 rows x 64 columns (32 on AVX2), in parallel over tiles
only, each element accumulated over K in order with the same dequantized weights. The layers left fp32
(int8's head, MoE routers, weights neither kernel takes) rely on `pack_linears` packing them, however
small: `F.linear` is not invariant (linear.py). Everything around these layers must be invariant as well.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from specserve.config import QUANTIZATION_MODES, SpecserveError
from specserve.layers import kernels
from specserve.layers.fusion import Fusion
from specserve.layers.huge_pages import HeapTrimmer, trim_heap
from specserve.layers.linear import PackedLinear

GROUP_SIZES = (32, 64, 128, 256)  # what the int4 kernel accepts
DEFAULT_GROUP_SIZE = 32
N_MULTIPLE = 16  # the int4 packing works on blocks of 16 output channels
COMPUTE_DTYPE = torch.bfloat16  # torch's kernel: its vectorized instantiation on x86 (module docstring)
FP16_MAX = 65504.0  # specserve's kernel stores scales in fp16
ROWS_PER_CHUNK = 4096  # output rows quantized at once (`_by_rows`)
FP16_TINY = 2.0**-14  # fp16's smallest normal number: below it, 2^-24 absolute steps
# The LM head's output is rounded to bf16 by the kernel: logits of ~20 lose ~0.06, enough to reorder near
# ties. int8 keeps the head fp32 for its accuracy (packed by `pack_linears`, batch invariant); int4 quantizes
# it for speed (it is 15% of the weights).
QUANTIZE_HEAD = {"int8": False, "int4": True}
# MoE routers stay fp32: a rounding error there changes which experts run (llama.cpp keeps them F32 too).
ROUTER_SUFFIXES = ("mlp.gate", "router.proj")


def check_mode(mode: str) -> str:
    if mode not in QUANTIZATION_MODES:
        raise SpecserveError(f"quantization must be one of {', '.join(QUANTIZATION_MODES)}, got {mode!r}")
    return mode


# ------------------------------------------------------------------------------------------------ formats


def _by_rows(quantize):
    """Quantize ROWS_PER_CHUNK output rows at a time: each row's codes depend on that row alone, and the
    fp32 temporaries stay a few MB instead of several copies of the weight (a 151936 x 1536 head: 0.9 GB
    each) while a model loads."""

    @functools.wraps(quantize)
    def run(weight: torch.Tensor, group_size: int):
        parts = [quantize(rows, group_size) for rows in weight.detach().split(ROWS_PER_CHUNK)]
        return concatenated(parts)

    return run


def concatenated(parts: Sequence[tuple]) -> tuple:
    """Row blocks of one quantized weight (tuples of per-row tensors) as one, of the parts' own type."""
    tensors = tuple(torch.cat(chunks) for chunks in zip(*parts, strict=True))
    return type(parts[0])(*tensors) if isinstance(parts[0], Int4Weights) else tensors


GROUPS_PER_SUPER = 8  # int4 groups sharing one d and dmin: 256 inputs at G = 32, GGUF Q4_K's super-block


def _per_group(values: torch.Tensor, groups: int) -> torch.Tensor:
    """[N, S] per super-block -> [N, groups]."""
    return values.repeat_interleave(GROUPS_PER_SUPER, dim=1)[:, :groups]


class Int4Weights(NamedTuple):
    """An int4 weight in two levels (GGUF Q4_K's form): w = q * scale + min per group of G inputs, group g's
    scale d * sub_scales[g] and minimum dmin * sub_mins[g], with d and dmin (fp16 values) shared by
    GROUPS_PER_SUPER consecutive groups. Scales and minimums are exact in fp32 (11 by 8 bits)."""

    q: torch.Tensor  # uint8 [N, K], 0..15
    d: torch.Tensor  # float32 [N, S], fp16 values, S = ceil(K / G / GROUPS_PER_SUPER)
    dmin: torch.Tensor  # float32 [N, S], fp16 values
    sub_scales: torch.Tensor  # uint8 [N, K / G]
    sub_mins: torch.Tensor  # int8 [N, K / G]

    @property
    def group_size(self) -> int:
        return self.q.shape[1] // self.sub_scales.shape[1]

    def scales(self) -> torch.Tensor:
        """fp32 [N, K / G]."""
        return _per_group(self.d, self.sub_scales.shape[1]) * self.sub_scales.float()

    def mins(self) -> torch.Tensor:
        return _per_group(self.dmin, self.sub_mins.shape[1]) * self.sub_mins.float()

    def dequantize(self) -> torch.Tensor:
        g = self.group_size
        return self.q.float() * _expand(self.scales(), g) + _expand(self.mins(), g)


def _fp16_at_least(x: torch.Tensor) -> torch.Tensor:
    """The smallest fp16 value >= x (x >= 0, in fp16's range), as float32."""
    h = x.half()
    up = torch.nextafter(h, torch.full_like(h, float("inf")))
    return torch.where(h.float() < x, up, h).float()


def _super_steps(values: torch.Tensor, top: int) -> torch.Tensor:
    """Per super-block, the fp16 step d >= max(values) / top: [N, groups] -> [N, S]."""
    n, groups = values.shape
    padded = torch.zeros(n, -(-groups // GROUPS_PER_SUPER) * GROUPS_PER_SUPER)
    padded[:, :groups] = values
    return _fp16_at_least(padded.view(n, -1, GROUPS_PER_SUPER).amax(-1) / top)


@_by_rows
def quantize_int4(weight: torch.Tensor, group_size: int) -> Int4Weights:
    """Two-level int4 (`Int4Weights`) whose grid covers each group's weights: the group's minimum rounded
    down to a step of dmin (max |min| / 127 in its super-block), its scale up to a step of d (the largest
    scale / 255), both fp16 rounded up; q then rounds to the grid: at most half a step of error."""
    n, k = weight.shape
    groups = weight.float().reshape(n, k // group_size, group_size)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    count = low.shape[1]
    dmin = _super_steps(low.abs(), 127)
    step = _per_group(dmin, count)
    sub_mins = torch.where(step > 0, torch.floor(low / step.clamp_min(1e-30)), 0).clamp_(-128, 127)
    mins = step * sub_mins
    d = _super_steps((high - mins) / 15, 255)
    step = _per_group(d, count)
    sub_scales = torch.where(step > 0, torch.ceil((high - mins) / 15 / step.clamp_min(1e-30)), 0)
    scales = step * sub_scales.clamp_(0, 255)
    q = torch.round((groups - mins[..., None]) / scales.clamp_min(1e-30)[..., None]).clamp_(0, 15)
    return Int4Weights(
        q.to(torch.uint8).reshape(n, k), d, dmin, sub_scales.to(torch.uint8), sub_mins.to(torch.int8)
    )


def dequantize_int4(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """fp32 [N, K] from torch's int4 form, w = (q - 8) * s + z, computed as its kernel computes it."""
    n, k = q.shape
    groups = scales.shape[1]
    centred = q.float().view(n, groups, k // groups) - 8
    return (centred * scales.float()[..., None] + zeros.float()[..., None]).view(n, k)


Int4Plane = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (q, scales, zeros): torch's int4 form


@_by_rows
def quantize_int8(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [N, K] in -127..127, scales float32 [N, K / G]) with w ~ q * s: GGUF Q8_0's format (symmetric,
    s = max|w| / 127 per group). s is rounded to fp16 (what the kernel stores) before q is chosen, except
    below fp16's normal range, where it stays exact."""
    n, k = weight.shape
    groups = weight.float().reshape(n, k // group_size, group_size)
    scales = groups.abs().amax(dim=-1) / 127
    scales = torch.where(scales >= FP16_TINY, scales.half().float(), scales)
    q = torch.round(groups / scales.clamp_min(1e-30)[..., None]).clamp_(-127, 127)
    return q.to(torch.int8).reshape(n, k), scales


def int8_from_q8_0(q: torch.Tensor, scales: torch.Tensor) -> tuple[Int4Plane, Int4Plane]:
    """int8 codes (w = d * q, q in [-127, 127], one d per group) as two int4 planes of torch's kernel that
    keep the codes: the int8 layer's form without specserve's kernel.

    With c = q + 128 = 16 a + b: d * q = (a - 8) * 16 d + (b - 8) * d + 8 d. Only d is rounded (to bf16;
    16 d and 8 d round alike), so the weight is bf16(d) * q: within 2^-8 (relative) of Q8_0's own value."""
    codes = q.to(torch.int16) + 128
    d = scales.to(COMPUTE_DTYPE)
    high, low = (codes >> 4).to(torch.uint8), (codes & 15).to(torch.uint8)
    return (high, 16 * d, torch.zeros_like(d)), (low, d, 8 * d)


# -------------------------------------------------------------------------------- the kernel's layout
# specserve/layers/kernels/qlinear.cpp: output channels in tiles of 16; in a tile, 64-byte lines of 4
# inputs x 16 channels (byte 4c + j: channel c, input j); int4 packs two consecutive lines into the low
# and high nibbles of one. int8 scales fp16, [N / 16, K / G, 16]; int4's groups uint8 [N / 16, K / G, 32]
# (16 sub-scales, then 16 sub-minimums) and super-blocks fp16 [N / 16, S, 32] (16 d, then 16 dmin).


def pack_int4_codes(q: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K] in 0..15 -> uint8 [N / 16, K / 8, 64]."""
    n, k = q.shape
    # A channel's 4 inputs of a line move together, as one int32, not byte by byte; codes below 16 shift
    # into their byte's high nibble without a carry into the next byte.
    # (Written into a byte tensor of its own: a view of the words would keep them, a second holder of its
    # storage, which huge_pages.py would then leave where it is.)
    words = q.contiguous().view(torch.int32).reshape(n // 16, 16, k // 4).permute(0, 2, 1)
    lines = words.reshape(n // 16, k // 8, 2, 16)
    packed = torch.empty(n // 16, k // 8, 64, dtype=torch.uint8, device=q.device)
    torch.bitwise_or(lines[:, :, 0], lines[:, :, 1] << 4, out=packed.view(torch.int32))
    return packed


def unpack_int4_codes(packed: torch.Tensor) -> torch.Tensor:
    tiles, pairs, _ = packed.shape
    lines = torch.stack([packed & 15, packed >> 4], dim=2).reshape(tiles, 2 * pairs, 16, 4)
    return lines.permute(0, 2, 1, 3).reshape(16 * tiles, 8 * pairs)


def pack_int8_codes(q: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] -> int8 [N / 16, K / 4, 64]."""
    n, k = q.shape
    words = q.contiguous().view(torch.int32).reshape(n // 16, 16, k // 4).permute(0, 2, 1)  # as int4's
    packed = torch.empty(n // 16, k // 4, 64, dtype=torch.int8, device=q.device)
    packed.view(torch.int32).copy_(words)
    return packed


def unpack_int8_codes(packed: torch.Tensor) -> torch.Tensor:
    tiles, lines, _ = packed.shape
    return packed.reshape(tiles, lines, 16, 4).permute(0, 2, 1, 3).reshape(16 * tiles, 4 * lines)


def pack_groups(values: torch.Tensor) -> torch.Tensor:
    """fp32 [N, K / G] -> fp16 [N / 16, K / G, 16]."""
    n, groups = values.shape
    return values.reshape(n // 16, 16, groups).transpose(1, 2).half().contiguous()


def unpack_groups(packed: torch.Tensor) -> torch.Tensor:
    tiles, groups, _ = packed.shape
    return packed.float().transpose(1, 2).reshape(16 * tiles, groups)


def _pack_pairs(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[N, X] twice -> [N / 16, X, 32]: per tile and X, a's 16 channels, then b's."""
    n, x = a.shape
    out = torch.empty(n // 16, x, 32, dtype=a.dtype, device=a.device)
    halves = out.view(n // 16, x, 2, 16)  # written in place: no stacked copy to permute
    halves[:, :, 0] = a.reshape(n // 16, 16, x).transpose(1, 2)
    halves[:, :, 1] = b.reshape(n // 16, 16, x).transpose(1, 2)
    return out


def _unpack_pairs(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    tiles, x, _ = packed.shape
    a, b = packed.reshape(tiles, x, 2, 16).permute(2, 0, 3, 1).reshape(2, 16 * tiles, x)
    return a, b


def pack_int4_scales(w: Int4Weights) -> tuple[torch.Tensor, torch.Tensor]:
    """(groups uint8 [N / 16, K / G, 32], supers fp16 [N / 16, S, 32])."""
    groups = _pack_pairs(w.sub_scales, w.sub_mins.view(torch.uint8))
    return groups, _pack_pairs(w.d.half(), w.dmin.half())


def unpack_int4_scales(q: torch.Tensor, groups: torch.Tensor, supers: torch.Tensor) -> Int4Weights:
    sub_scales, sub_mins = _unpack_pairs(groups)
    d, dmin = _unpack_pairs(supers)
    return Int4Weights(q, d.float(), dmin.float(), sub_scales, sub_mins.view(torch.int8))


def _use_kernel(wanted: bool | None, *values: torch.Tensor) -> bool:
    """Whether a layer takes specserve's kernel layout: `wanted` (None: where the CPU kernels are built;
    True: always, for the platform's kernels that read it, CUDA's), and only if its scales fit fp16 (they
    do for any real model; torch's kernel keeps them in bf16's wider range)."""
    if wanted is False or (wanted is None and kernels.ops() is None):
        return False
    return all(bool(v.abs().max() <= FP16_MAX) for v in values if v.numel())


def _expand(values: torch.Tensor, group_size: int) -> torch.Tensor:
    return values.repeat_interleave(group_size, dim=1)


# ------------------------------------------------------------------------------------------------ modules


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    """[..., K] -> contiguous bf16 [rows, K], as torch's kernel requires."""
    return x.reshape(-1, x.shape[-1]).to(COMPUTE_DTYPE).contiguous()


def _finish(y: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = y.to(x.dtype).reshape(*x.shape[:-1], y.shape[-1])
    return y if bias is None else y + bias.to(x.dtype)


def kernel_call(op, x: torch.Tensor, bias: torch.Tensor | None, *weights: torch.Tensor) -> torch.Tensor:
    """specserve's kernel on [..., K] in any float dtype: it takes contiguous fp32 rows, adds the bias."""
    if x.dtype == torch.float32 and x.dim() == 2 and x.is_contiguous():
        # the engine's case, without the conversions (~5 us a call, ~110 calls a decoded token)
        if bias is not None and (bias.dtype != torch.float32 or bias.requires_grad):
            bias = bias.detach().float()
        return op(x, *weights, bias)
    rows = x.reshape(-1, x.shape[-1]).to(torch.float32).contiguous()
    bias = None if bias is None else bias.detach().to(torch.float32).contiguous()
    y = op(rows, *weights, bias)
    return y.to(x.dtype).reshape(*x.shape[:-1], y.shape[-1])


class _QuantizedLinear(nn.Module):
    """What the int4 and int8 layers share: their description, and building one from kernel buffers."""

    KERNEL_BUFFERS: tuple[str, ...]  # the buffers of specserve's kernel layout, each [N / 16, ...]
    # The platform's kernels for those buffers where they are not specserve's CPU ops (`use_device_kernels`):
    # a namespace of functions with the ops' names and arguments (CUDA: layers/triton_qlinear.py).
    device_ops = None
    in_features: int
    out_features: int
    group_size: int
    bias: torch.Tensor | None
    on_kernel: bool

    @classmethod
    def from_kernel_buffers(
        cls, buffers: dict[str, torch.Tensor], in_features: int, group_size: int, bias: torch.Tensor | None
    ):
        """A layer on specserve's kernel holding `buffers` (already in its layout) as they are."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.out_features = buffers["packed"].shape[0] * N_MULTIPLE
        layer.in_features, layer.group_size, layer.bias, layer.on_kernel = in_features, group_size, bias, True
        for name in cls.KERNEL_BUFFERS:
            layer.register_buffer(name, buffers[name])
        return layer

    def extra_repr(self) -> str:
        bias = self.bias is not None
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"group_size={self.group_size}, bias={bias}, kernel={'specserve' if self.on_kernel else 'torch'}"
        )


class TorchInt4(nn.Module):
    """One int4 weight on torch's kernel (`aten._weight_int4pack_mm_for_cpu`): w = (q - 8) * s + z per group,
    s and z bf16. What an int4 layer runs on without specserve's kernel, and int8's two planes there."""

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor):
        super().__init__()
        self.in_features = q.shape[1]
        self.group_size = self.in_features // scales.shape[1]
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
        self.register_buffer("packed", packed)
        scales_and_zeros = torch.stack([scales.float(), zeros.float()], dim=-1).transpose(0, 1).contiguous()
        self.register_buffer("scales_and_zeros", scales_and_zeros.to(COMPUTE_DTYPE))

    def codes(self) -> torch.Tensor:
        """q as uint8 [N, K] in 0..15 (torch's layout depends on the CPU's vector width, so its codes are read
        back through its kernel: identity input, unit scales; slow, for inspection)."""
        eye = torch.eye(self.in_features, dtype=COMPUTE_DTYPE)
        unit = torch.zeros_like(self.scales_and_zeros)
        unit[..., 0] = 1
        centred = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.packed, self.group_size, unit)
        return (centred.t().float() + 8).to(torch.uint8)

    def scales_and_zeros_fp32(self) -> tuple[torch.Tensor, torch.Tensor]:
        scales, zeros = self.scales_and_zeros.float().transpose(0, 1).unbind(-1)
        return scales, zeros

    @property
    def weight(self) -> torch.Tensor:
        return dequantize_int4(self.codes(), *self.scales_and_zeros_fp32())

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        """bf16 [M, K] (contiguous) -> bf16 [M, N], without a bias."""
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            rows, self.packed, self.group_size, self.scales_and_zeros
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _finish(self.matmul(_as_rows(x)), x, None)


class Int4Linear(_QuantizedLinear):
    """Inference-only linear layer with a group-wise int4 weight in two levels (`Int4Weights`).

    On specserve's kernel when it is available (`use_kernel=None`): its buffers hold the weight exactly, in
    the kernel's layout. Else on torch's (`TorchInt4`), whose bf16 scales and zeros round the weight's.
    `weight` reads the dequantized fp32 weight that the layer computes with."""

    KERNEL_BUFFERS = ("packed", "scales", "supers")

    def __init__(
        self, weights: Int4Weights, bias: torch.Tensor | None = None, use_kernel: bool | None = None
    ):
        super().__init__()
        self.out_features, self.in_features = weights.q.shape
        self.group_size = weights.group_size
        self.bias = bias
        self.on_kernel = _use_kernel(use_kernel, weights.d, weights.dmin)
        if self.on_kernel:
            self.register_buffer("packed", pack_int4_codes(weights.q.to(torch.uint8)))
            groups, supers = pack_int4_scales(weights)
            self.register_buffer("scales", groups)
            self.register_buffer("supers", supers)
            return
        scales = weights.scales()
        self.plane = TorchInt4(weights.q, scales, weights.mins() + 8 * scales)

    def int4_weights(self) -> Int4Weights:
        """The two-level weight the kernel computes with (specserve's kernel only; slow, for inspection)."""
        return unpack_int4_scales(unpack_int4_codes(self.packed), self.scales, self.supers)

    def codes(self) -> torch.Tensor:
        """q as uint8 [N, K] in 0..15."""
        return unpack_int4_codes(self.packed) if self.on_kernel else self.plane.codes()

    def scales_and_mins(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(scales, mins) fp32 [N, K / G] as the layer computes with them: w = q * scales + mins."""
        if self.on_kernel:
            w = self.int4_weights()
            return w.scales(), w.mins()
        scales, zeros = self.plane.scales_and_zeros_fp32()
        return scales, zeros - 8 * scales

    @property
    def weight(self) -> torch.Tensor:
        return self.int4_weights().dequantize() if self.on_kernel else self.plane.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.on_kernel:
            b = self._buffers  # a dict lookup: nn.Module's attribute lookup of a buffer costs ~0.5 us
            if self.device_ops is not None:
                return self.device_ops.int4_linear(x, b["packed"], b["scales"], b["supers"], self.bias)
            op = torch.ops.specserve.int4_linear
            return kernel_call(op, x, self.bias, b["packed"], b["scales"], b["supers"])
        return _finish(self.plane.matmul(_as_rows(x)), x, self.bias)


class Int8Linear(_QuantizedLinear):
    """Inference-only linear layer with a group-wise symmetric int8 weight, w = q * scales (Q8_0's format).

    On specserve's kernel when it is available (`use_kernel=None`); else as two int4 planes of torch's
    kernel (`int8_from_q8_0`: two calls, outputs added in fp32). `weight`: the dequantized fp32 weight."""

    KERNEL_BUFFERS = ("packed", "scales")

    def __init__(
        self,
        q: torch.Tensor,
        scales: torch.Tensor,
        bias: torch.Tensor | None = None,
        use_kernel: bool | None = None,
    ):
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.group_size = self.in_features // scales.shape[1]
        self.bias = bias
        self.on_kernel = _use_kernel(use_kernel, scales.float())
        if self.on_kernel:
            self.register_buffer("packed", pack_int8_codes(q.to(torch.int8)))
            self.register_buffer("scales", pack_groups(scales.float()))
        else:
            coarse, residual = int8_from_q8_0(q, scales)
            self.coarse = TorchInt4(*coarse)
            self.residual = TorchInt4(*residual)

    @property
    def weight(self) -> torch.Tensor:
        if not self.on_kernel:
            return self.coarse.weight + self.residual.weight
        codes = unpack_int8_codes(self.packed).float()
        return codes * _expand(unpack_groups(self.scales), self.group_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.on_kernel:
            b = self._buffers
            if self.device_ops is not None:
                return self.device_ops.int8_linear(x, b["packed"], b["scales"], self.bias)
            return kernel_call(torch.ops.specserve.int8_linear, x, self.bias, b["packed"], b["scales"])
        rows = _as_rows(x)
        y = self.coarse.matmul(rows).float()
        y += self.residual.matmul(rows)
        return _finish(y, x, self.bias)


QuantizedLinear = Int8Linear | Int4Linear


def side_by_side(layers: Sequence[QuantizedLinear]) -> QuantizedLinear | None:
    """One layer whose output is the outputs of `layers` (the same input) concatenated, bitwise, or None
    when they differ in kind, input or group size or are not all on specserve's kernel. Its layout is per
    tile of 16 outputs, so their tiles simply follow one another; each layer is re-pointed at its part of
    the new buffers (views), so no memory is added and each still works alone."""
    first = layers[0]
    same = all(
        type(layer) is type(first)
        and layer.on_kernel
        and (layer.in_features, layer.group_size) == (first.in_features, first.group_size)
        for layer in layers
    )
    if not same or not isinstance(first, Int4Linear | Int8Linear):
        return None
    buffers = {name: torch.cat([getattr(layer, name) for layer in layers]) for name in first.KERNEL_BUFFERS}
    bias = None
    if any(layer.bias is not None for layer in layers):
        parts = [torch.zeros(x.out_features) if x.bias is None else x.bias.detach().float() for x in layers]
        bias = nn.Parameter(torch.cat(parts), requires_grad=False)  # a parameter: it moves with the weights
    fused = type(first).from_kernel_buffers(buffers, first.in_features, first.group_size, bias)
    _point_at_parts(layers, buffers)
    return fused


def _point_at_parts(layers: Sequence[QuantizedLinear], buffers: dict[str, torch.Tensor]) -> None:
    """Re-point each of `layers` at its tiles of `buffers`, which hold their buffers side by side."""
    start = 0
    for layer in layers:
        tiles = slice(start, start + layer.out_features // N_MULTIPLE)
        for name in layer.KERNEL_BUFFERS:
            setattr(layer, name, buffers[name][tiles])
        start = tiles.stop


@dataclass(eq=False)
class StackedLinears:
    """E layers of one kind and shape whose kernel buffers are stacked along a new first dimension
    (`stack_layers`). `(x, counts)`: the rows of x sorted by layer, counts[e] (int64 [E]) of them for layer
    e, each through its layer, in one call of the grouped kernel; each row's output is bitwise the one its
    layer gives it alone. A mixture-of-experts layer's routed experts run so (layers/moe.py)."""

    names: tuple[str, ...]  # of the buffers, in the kernel's argument order
    buffers: tuple[torch.Tensor, ...]  # each [E, N / 16, ...]
    int4: bool
    device_ops = None  # as a layer's (`_QuantizedLinear.device_ops`)

    def takes(self, x: torch.Tensor) -> bool:
        """Whether the grouped kernel takes rows x: fp32 rows on the CPU for specserve's CPU op, rows on the
        buffers' device for the platform's."""
        if x.dim() != 2:
            return False
        return kernels.rows_take(x) if self.device_ops is None else x.device == self.buffers[0].device

    def __call__(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        ops = torch.ops.specserve if self.device_ops is None else self.device_ops
        return (ops.int4_grouped_linear if self.int4 else ops.int8_grouped_linear)(x, counts, *self.buffers)


def stackable(layers: Sequence[nn.Module]) -> bool:
    """Whether `stack_layers` takes these layers (or fusions' layers): one kind, shape and group size, all on
    specserve's kernel, without biases (the grouped kernel adds none)."""
    layers = [layer.layer if isinstance(layer, Fusion) else layer for layer in layers]
    first = layers[0]
    return isinstance(first, Int4Linear | Int8Linear) and all(
        type(layer) is type(first)
        and layer.on_kernel
        and layer.bias is None
        and (layer.in_features, layer.out_features, layer.group_size)
        == (first.in_features, first.out_features, first.group_size)
        for layer in layers
    )


def stack_layers(parts: Sequence[QuantizedLinear | Fusion]) -> StackedLinears:
    """Layers (or fusions, whose layer is taken) that are `stackable`, as one `StackedLinears`. Each layer is
    re-pointed at its slice of the stacked buffers (and a fusion's members at theirs): no memory is added
    and each still works alone."""
    layers = [part.layer if isinstance(part, Fusion) else part for part in parts]
    names = layers[0].KERNEL_BUFFERS
    stacked = {name: torch.stack([getattr(layer, name) for layer in layers]) for name in names}
    for e, (part, layer) in enumerate(zip(parts, layers, strict=True)):
        for name in names:
            setattr(layer, name, stacked[name][e])
        if isinstance(part, Fusion):
            _point_at_parts(part.members, {name: getattr(layer, name) for name in names})
    return StackedLinears(names, tuple(stacked[name] for name in names), isinstance(layers[0], Int4Linear))


def use_device_kernels(model: nn.Module, ops) -> None:
    """Run `model`'s quantized layers (fused and stacked ones included) on the platform's kernels `ops`
    (`_QuantizedLinear.device_ops`), which read specserve's kernel layout; a layer in torch's CPU form
    instead is refused."""
    for module in model.modules():
        fusion = getattr(module, "fusion", None)
        for layer in (module,) if fusion is None else (module, fusion.layer):
            if isinstance(layer, _QuantizedLinear):
                if not layer.on_kernel:
                    raise SpecserveError(
                        f"{type(layer).__name__} {layer.extra_repr()} is in torch's CPU int4 form, which "
                        "only the CPU runs (quantized for the CPU, or its scales overflow fp16)"
                    )
                layer.device_ops = ops
        for stack in getattr(module, "stacks", None) or ():
            stack.device_ops = ops


def group_size_for(in_features: int, out_features: int, wanted: int = DEFAULT_GROUP_SIZE) -> int | None:
    """The largest kernel group size <= `wanted` that divides K, or None when the kernel cannot take the
    weight (it packs output channels in blocks of 16)."""
    if out_features % N_MULTIPLE:
        return None
    fits = [g for g in GROUP_SIZES if g <= wanted and in_features % g == 0]
    return max(fits) if fits else None


def quantize_linear(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    mode: str,
    group_size: int = DEFAULT_GROUP_SIZE,
    use_kernel: bool | None = None,
) -> QuantizedLinear:
    """The quantized layer for a dense fp32 weight (the caller checked `group_size_for`)."""
    blocks = weight.detach().split(ROWS_PER_CHUNK)
    return quantize_row_blocks(blocks, tuple(weight.shape), bias, mode, group_size, use_kernel)


def quantize_row_blocks(
    blocks: Iterable[torch.Tensor],
    shape: tuple[int, int],
    bias: torch.Tensor | None,
    mode: str,
    group_size: int = DEFAULT_GROUP_SIZE,
    use_kernel: bool | None = None,
) -> QuantizedLinear:
    """`quantize_linear` of an [N, K] weight given as consecutive blocks of its rows (each row's codes
    depend on that row alone): a loader can dequantize a block, quantize it and drop it, never holding
    the whole weight in fp32."""
    group_size = group_size_for(shape[1], shape[0], group_size)
    quantize = quantize_int8 if check_mode(mode) == "int8" else quantize_int4
    quantized = concatenated([quantize(b, group_size) for b in blocks])
    if mode == "int4":
        return Int4Linear(quantized, bias, use_kernel)
    return Int8Linear(*quantized, bias, use_kernel)


# ---------------------------------------------------------------------------------------------- models


def quantizable_linears(model: nn.Module, mode: str, lm_head: bool | None = None) -> Iterator[list[str]]:
    """The qualified names of each linear layer `quantize_model` would replace (a module registered under
    several names comes once, with all of them). Plain nn.Linear and oneDNN PackedLinear both count."""
    check_mode(mode)
    with_head = QUANTIZE_HEAD[mode] if lm_head is None else lm_head
    names_of: dict[int, list[str]] = {}
    for qualname, module in model.named_modules(remove_duplicate=False):
        if not isinstance(module, nn.Linear | PackedLinear) or qualname.endswith(ROUTER_SUFFIXES):
            continue
        if qualname == "lm_head" and not with_head:
            continue
        # meta: a model skeleton, asked before loading which layers its weights would quantize
        on_cpu = isinstance(module, PackedLinear) or module.weight.device.type in ("cpu", "meta")
        if on_cpu and group_size_for(module.in_features, module.out_features) is not None:
            names_of.setdefault(id(module), []).append(qualname)
    yield from names_of.values()


def quantizable_weights(model: nn.Module, mode: str) -> dict[str, list[str]]:
    """{the weight's name: the layer's qualified names} of each layer `quantize_model` would replace."""
    return {f"{n}.weight": names for names in quantizable_linears(model, mode) for n in names}


class QuantizingLoad:
    """Quantizes each layer `quantize_model` would replace as a checkpoint load reads its weight
    (`CausalLM.load_weights` calls it), so that the dense weight is never written: allocated uninitialised,
    it takes no memory, and a load peaks at the quantized model plus a tensor where it held the whole
    model in fp32 first (a 30B mixture-of-experts model's 114 GB). The layers are those quantizing the
    loaded model would make, bit for bit. Tied weights are left to the tie."""

    def __init__(self, model, mode: str, use_kernel: bool | None = None):
        tied = model.tied_parameter_names()
        self.targets = {k: v for k, v in quantizable_weights(model, mode).items() if k not in tied}
        self.mode, self.use_kernel = mode, use_kernel
        self.trimmer = HeapTrimmer()

    def __call__(self, model: nn.Module, name: str, weight: torch.Tensor, dtype: torch.dtype) -> bool:
        """Replace the layer whose weight `name` is by its quantized `weight` (cast to the parameter's
        `dtype` first, as loading it would); returns whether `name` was one (others are not cast here)."""
        names = self.targets.pop(name, None)
        if names is None:
            return False
        bias = model.get_submodule(names[0]).bias  # the parameter itself: the load may fill it later
        weight, group_size = weight.to(dtype), DEFAULT_GROUP_SIZE
        _quantize_into(model, names, weight, bias, self.mode, group_size, self.use_kernel, self.trimmer)
        return True


def _quantize_into(
    model: nn.Module,
    names: list[str],
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    mode: str,
    group_size: int,
    use_kernel: bool | None,
    trimmer: HeapTrimmer,
) -> None:
    """Replace the layer registered as `names` by `weight` quantized. The quantizer's fp32 temporaries,
    freed between the small layers kept, stay in the heap until it is trimmed (`trimmer`): a 26B model's
    load grew to ~3x its quantized size."""
    with torch.no_grad():
        layer = quantize_linear(weight, bias, mode, group_size, use_kernel)
    replace_module(model, names, layer)
    trimmer.add(weight.numel() * weight.element_size())


def replace_module(model: nn.Module, names: list[str], new: nn.Module) -> None:
    for qualname in names:
        parent_name, _, name = qualname.rpartition(".")
        setattr(model.get_submodule(parent_name), name, new)


def quantize_model(
    model: nn.Module,
    mode: str,
    group_size: int = DEFAULT_GROUP_SIZE,
    lm_head: bool | None = None,
    fuse: bool = True,
    use_kernel: bool | None = None,
) -> int:
    """Replace, in place, every linear layer the kernel can take by its quantized version (weights already
    loaded; works before or after `pack_linears`); returns how many were replaced.

    MoE routers stay fp32, and so does any weight the kernel cannot take (N % 16 != 0, or no group size
    dividing K). Projections of one input are then fused (`fuse_projections`). `lm_head=None` follows
    `QUANTIZE_HEAD` (int4: quantized; int8: fp32). A head tied to the embedding gets its own quantized
    copy; the embedding itself stays fp32 (a lookup reads one row per token). Usable on a draft model on
    its own, independently of the target. `fuse=False` leaves the fusing to the caller (models/prepare.py
    caches the layers unfused first). `use_kernel`: whether the layers take specserve's kernel layout
    (`_use_kernel`; the platform's `quantized_layout`).
    """
    count, trimmer = 0, HeapTrimmer()
    for names in list(quantizable_linears(model, mode, lm_head)):
        linear = model.get_submodule(names[0])
        _quantize_into(model, names, linear.weight, linear.bias, mode, group_size, use_kernel, trimmer)
        count += 1
    trim_heap()
    if fuse:
        fuse_projections(model)
    return count


def fuse_projections(model: nn.Module) -> int:
    """Fuse every group a module names in `FUSED_PROJECTIONS` whose layers `side_by_side` can put in one
    (layers/fusion.py); returns how many groups were fused. Groups fused already are left as they are.
    Then modules that compute several layers of one shape in one grouped call (a mixture-of-experts
    layer's experts: `stack_experts`) stack them, once their own projections are fused; a module before
    its children (`modules()` order), so that a layer can add its shared expert to its experts' stack."""
    count, trimmer = 0, HeapTrimmer()  # the members' own buffers are freed as they are re-pointed
    for module in list(model.modules()):
        for names in getattr(module, "FUSED_PROJECTIONS", ()):
            layers = tuple(getattr(module, name, None) for name in names)
            if not all(isinstance(layer, Int4Linear | Int8Linear) for layer in layers):
                continue
            if any(getattr(layer, "fusion", None) is not None for layer in layers):
                continue
            fused = side_by_side(layers)
            if fused is not None:
                fusion = Fusion(fused, layers, [layer.out_features for layer in layers])
                for layer in layers:
                    layer.fusion = fusion
                count += 1
                trimmer.add(sum(b.numel() * b.element_size() for b in fused.buffers()))
    trim_heap()
    for module in list(model.modules()):
        stack = getattr(module, "stack_experts", None)
        if stack is not None:
            stack()
    return count
