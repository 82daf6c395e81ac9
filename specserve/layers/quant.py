"""Weight-only int8 / int4 linear layers on PyTorch's own int4 CPU kernel, and `quantize_model`.

Formats (w is the fp32 weight, [out N, in K]; activations stay fp32 outside the kernel call):
- int4: asymmetric, one scale and zero per group of G = 32 inputs (the kernel also takes 64, 128, 256):
  w ~ (q - 8) * s + z, q in [0, 15]. Kernel: `aten._weight_int4pack_mm_for_cpu` on the weight packed by
  `aten._convert_weight_to_int4pack_for_cpu`, scales and zeros interleaved as [K / G, N, 2].
- int8: 8 bits per weight as two int4 planes of the same kernel: a coarse int4 plane and a plane for its
  residual (G = 32), y = x W1^T + x W2^T. The residual spans one coarse step, so its plane's step is 1/15
  of that: range / 225 per group of 32, about an 8-bit grid per group.

Why not torch's int8 kernel (`aten._weight_int8pack_mm`): it has one scale per output channel, and rows
with outlier weights lose most of their resolution. Relative weight error over Qwen2.5-Coder-1.5B's linear
layers (median / worst layer): per-channel int8 1.2% / 4.8%, two int4 planes 0.21% / 0.67%, int4 4.4% /
11%. Greedy agreement with fp32 over 64 tokens of 10 chat prompts (share of tokens before the first
divergence): per-channel int8 76%, two planes 93%, two planes with the LM head left fp32 100%. Speed at
M = 1 is about the same (table below), so int8 uses the planes.

Why bf16 activations inside the kernel: on x86 it is vectorized (AVX-512 / AVX2) only for bf16 inputs;
its fp32 instantiation is the scalar reference loop (7x slower than the fp32 oneDNN linear at M = 1, 1536
-> 8960; torch's int8 kernel likewise, 3.4x slower). It still dequantizes to fp32 and accumulates in fp32;
only the layer's input and output are rounded to bf16 (2^-8 relative at most), and scales and zeros are
stored in bf16 because it reads them in the activation dtype. Everything outside the linear layers (norms,
attention, residual stream, softmax) stays fp32. The rounding of the output matters at one place, the LM
head: logits of ~20 move by up to ~0.06, enough to reorder near ties (the 93% vs 100% above), so int8
leaves the head in fp32 (`QUANTIZE_HEAD`); int4 quantizes it, for speed (it is 15% of the weights).

Kernel speed on this machine (`python -m specserve.bench.quant kernels`: 2 threads, AVX-512, medians of 7
interleaved rounds, weights cycled past the 32 MiB L3), relative to the fp32 oneDNN packed linear (> 1 is
faster), at M rows per call:

    layer (K -> N)            M:  1     2     4     8    16  |  64   256
    gate/up 1536 -> 8960  int4   3.37  2.79  1.90  1.32  0.92 | 0.78  0.74   (0.83 ms at M = 1)
                          int8   1.67  1.38  0.95  0.65  0.46 | 0.39  0.37
           torch int8 (per-ch.)  1.79  1.60  1.25  0.88  0.63 | 0.55  0.62
    down 8960 -> 1536     int4   3.45  2.85  1.89  1.39  0.94 | 0.77  0.75
                          int8   1.70  1.40  0.94  0.68  0.47 | 0.40  0.38
    q/o 1536 -> 1536      int4   3.22  2.79  1.96  1.40  0.99 | 0.81  0.75
    lm head 1536 -> 151936 int4  3.19  2.56  1.87  1.29  0.91
                          int8   1.58  1.28  0.94  0.64  0.45
    int4 with G = 128 instead of 32: 4-9% faster; G = 32 is kept (it is GGUF Q4_0 / Q4_K's group).

Neither path reaches the memory roofline at M = 1: int4 reads its 0.63 B/weight at ~10 GB/s, against ~20
GB/s for fp32 oneDNN. The kernel is bound by dequantization work on 2 cores (a table lookup and two FMAs
per weight, per block of 4 rows: its cost grows with M faster than oneDNN's GEMM). A kernel that keeps the
weights in int4 and multiplies in integers (llama.cpp quantizes activations to 8 bits and uses VNNI dot
products) is what would close the gap; torch has none for x86. Each path was chosen by these numbers: int4
is faster than fp32 up to M = 8, about even at 16, 0.75-0.8x at prefill sizes, so it serves every M;
int8 is faster up to M ~ 3 and is the accurate option.

Both are batch invariant: a row's output is bitwise the same whatever other rows share the call, so
greedy speculation stays exact. By construction: the kernel runs tiles of 4 rows x 64 columns (32 on
AVX2), in parallel over tiles only; each output element has its own fp32 accumulator, summed over K in
order with the same dequantized weights whatever the tile's row count (1-4 rows only changes how many
rows share one dequantization). That holds for its AVX-512, AVX2 and scalar instantiations alike; int8
adds its two planes elementwise. The layers left fp32 (int8's head, MoE routers, weights the kernel cannot
take) rely on `pack_linears` packing them, however small: `F.linear` is not invariant (linear.py). The
input's rounding to bf16 hides most last-bit differences from the layers before, and turns the rest into
2^-8 ones: everything around these layers must be batch invariant as well.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from specserve.config import QUANTIZATION_MODES, SpecserveError
from specserve.layers.linear import PackedLinear

GROUP_SIZES = (32, 64, 128, 256)  # what the int4 kernel accepts
DEFAULT_GROUP_SIZE = 32
N_MULTIPLE = 16  # the int4 packing works on blocks of 16 output channels
COMPUTE_DTYPE = torch.bfloat16  # the kernel's vectorized instantiation on x86 (see the module docstring)
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


def quantize_int4(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q uint8 [N, K] in 0..15, scales bf16 [N, K / G], zeros bf16 [N, K / G]) with w ~ (q - 8) * s + z.

    Scale and zero come from the group's min and max, rounded to bf16 before q is chosen, so that q fits
    the values the kernel will really use."""
    n, k = weight.shape
    groups = weight.detach().float().reshape(n, k // group_size, group_size)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scales = ((high - low) / 15).clamp_min(1e-12).to(COMPUTE_DTYPE)
    zeros = (low + 8 * scales.float()).to(COMPUTE_DTYPE)
    q = torch.round((groups - zeros.float()[..., None]) / scales.float()[..., None]) + 8
    return q.clamp_(0, 15).to(torch.uint8).reshape(n, k), scales, zeros


def dequantize_int4(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """fp32 [N, K] from `quantize_int4`'s format, computed as the kernel computes it."""
    n, k = q.shape
    groups = scales.shape[1]
    centred = q.float().view(n, groups, k // groups) - 8
    return (centred * scales.float()[..., None] + zeros.float()[..., None]).view(n, k)


Int4Plane = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (q, scales, zeros) as quantize_int4 returns


def quantize_int8(weight: torch.Tensor, group_size: int) -> tuple[Int4Plane, Int4Plane]:
    """8 bits per weight as two int4 planes: a coarse one, and one for what the coarse plane misses.

    The residual of an int4 group spans about one coarse step, so the residual plane's step is 1/15 of
    it, range / 225 per group: about the resolution of an 8-bit grid on each group (range / 255)."""
    coarse = quantize_int4(weight, group_size)
    residual = weight.detach().float() - dequantize_int4(*coarse)
    return coarse, quantize_int4(residual, group_size)


def int8_from_q8_0(q: torch.Tensor, scales: torch.Tensor) -> tuple[Int4Plane, Int4Plane]:
    """GGUF Q8_0 (w = d * q, q in [-127, 127], one d per 32 weights) as two int4 planes that keep its codes.

    With c = q + 128 = 16 a + b: d * q = (a - 8) * 16 d + (b - 8) * d + 8 d. Only d is rounded (to bf16;
    16 d and 8 d round alike), so the weight is bf16(d) * q: within 2^-8 (relative) of Q8_0's own value."""
    codes = q.to(torch.int16) + 128
    d = scales.to(COMPUTE_DTYPE)
    high, low = (codes >> 4).to(torch.uint8), (codes & 15).to(torch.uint8)
    return (high, 16 * d, torch.zeros_like(d)), (low, d, 8 * d)


# ------------------------------------------------------------------------------------------------ modules


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    """[..., K] -> contiguous bf16 [rows, K], as the kernel requires."""
    return x.reshape(-1, x.shape[-1]).to(COMPUTE_DTYPE).contiguous()


def _finish(y: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = y.to(x.dtype).reshape(*x.shape[:-1], y.shape[-1])
    return y if bias is None else y + bias.to(x.dtype)


class Int4Linear(nn.Module):
    """Inference-only linear layer with a group-wise int4 weight in the kernel's packed layout.

    `weight` reads the dequantized fp32 weight: the packed layout depends on the CPU's vector width, so the
    codes are read back through the kernel itself (identity input, unit scales; slow, for inspection)."""

    def __init__(
        self, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bias: torch.Tensor | None = None
    ):
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.group_size = self.in_features // scales.shape[1]
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
        self.register_buffer("packed", packed)
        scales_and_zeros = torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous()
        self.register_buffer("scales_and_zeros", scales_and_zeros.to(COMPUTE_DTYPE))
        self.bias = bias

    def codes(self) -> torch.Tensor:
        """q as uint8 [N, K] in 0..15."""
        eye = torch.eye(self.in_features, dtype=COMPUTE_DTYPE)
        unit = torch.zeros_like(self.scales_and_zeros)
        unit[..., 0] = 1
        centred = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.packed, self.group_size, unit)
        return (centred.t().float() + 8).to(torch.uint8)

    @property
    def weight(self) -> torch.Tensor:
        scales, zeros = self.scales_and_zeros.transpose(0, 1).unbind(-1)
        return dequantize_int4(self.codes(), scales, zeros)

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        """bf16 [M, K] (contiguous) -> bf16 [M, N], without the bias."""
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            rows, self.packed, self.group_size, self.scales_and_zeros
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _finish(self.matmul(_as_rows(x)), x, self.bias)

    def extra_repr(self) -> str:
        bias = self.bias is not None
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"group_size={self.group_size}, bias={bias}"
        )


class Int8Linear(nn.Module):
    """Inference-only linear layer with an 8-bit weight held as two int4 planes (`quantize_int8`): two calls
    of the int4 kernel, their outputs added in fp32. `weight` reads the dequantized fp32 weight."""

    def __init__(self, coarse: Int4Plane, residual: Int4Plane, bias: torch.Tensor | None = None):
        super().__init__()
        self.coarse, self.residual = Int4Linear(*coarse), Int4Linear(*residual)
        self.out_features, self.in_features = self.coarse.out_features, self.coarse.in_features
        self.bias = bias

    @property
    def weight(self) -> torch.Tensor:
        return self.coarse.weight + self.residual.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = _as_rows(x)
        y = self.coarse.matmul(rows).float()
        y += self.residual.matmul(rows)
        return _finish(y, x, self.bias)

    def extra_repr(self) -> str:
        bias = self.bias is not None
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"group_size={self.coarse.group_size}, bias={bias}"
        )


QuantizedLinear = Int8Linear | Int4Linear


def group_size_for(in_features: int, out_features: int, wanted: int = DEFAULT_GROUP_SIZE) -> int | None:
    """The largest kernel group size <= `wanted` that divides K, or None when the kernel cannot take the
    weight (it packs output channels in blocks of 16)."""
    if out_features % N_MULTIPLE:
        return None
    fits = [g for g in GROUP_SIZES if g <= wanted and in_features % g == 0]
    return max(fits) if fits else None


def quantize_linear(
    weight: torch.Tensor, bias: torch.Tensor | None, mode: str, group_size: int = DEFAULT_GROUP_SIZE
) -> QuantizedLinear:
    """The quantized layer for a dense fp32 weight (the caller checked `group_size_for`)."""
    group_size = group_size_for(weight.shape[1], weight.shape[0], group_size)
    if check_mode(mode) == "int8":
        return Int8Linear(*quantize_int8(weight, group_size), bias)
    return Int4Linear(*quantize_int4(weight, group_size), bias)


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
        on_cpu = isinstance(module, PackedLinear) or module.weight.device.type == "cpu"
        if on_cpu and group_size_for(module.in_features, module.out_features) is not None:
            names_of.setdefault(id(module), []).append(qualname)
    yield from names_of.values()


def replace_module(model: nn.Module, names: list[str], new: nn.Module) -> None:
    for qualname in names:
        parent_name, _, name = qualname.rpartition(".")
        setattr(model.get_submodule(parent_name), name, new)


def quantize_model(
    model: nn.Module, mode: str, group_size: int = DEFAULT_GROUP_SIZE, lm_head: bool | None = None
) -> int:
    """Replace, in place, every linear layer the kernel can take by its quantized version (weights already
    loaded; works before or after `pack_linears`); returns how many were replaced.

    MoE routers stay fp32, and so does any weight the kernel cannot take (N % 16 != 0, or no group size
    dividing K). `lm_head=None` follows `QUANTIZE_HEAD` (int4: quantized; int8: fp32). A head tied to the
    embedding gets its own quantized copy; the embedding itself stays fp32 (a lookup reads one row per
    token). Usable on a draft model on its own, independently of the target.
    """
    count = 0
    for names in list(quantizable_linears(model, mode, lm_head)):
        linear = model.get_submodule(names[0])
        with torch.no_grad():
            new = quantize_linear(linear.weight, linear.bias, mode, group_size)
        replace_module(model, names, new)
        count += 1
    return count
