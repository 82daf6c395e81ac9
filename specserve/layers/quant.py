"""Weight-only int8 / int4 linear layers on PyTorch's own packed CPU kernels, and `quantize_model`.

Formats (w is the fp32 weight, [out N, in K]):
- int8: symmetric, one scale per output channel: w ~ q * s, q in [-127, 127]. Kernel:
  `aten._weight_int8pack_mm(x, q [N, K] int8, s [N])`.
- int4: asymmetric, one scale and zero per group of G inputs (G = 32 by default; the kernel takes 32, 64,
  128, 256): w ~ (q - 8) * s + z, q in [0, 15]. Kernel: `aten._weight_int4pack_mm_for_cpu` on the weight
  packed by `aten._convert_weight_to_int4pack_for_cpu`, scales and zeros interleaved as [K / G, N, 2].

Why bf16 activations inside the kernels: on x86 both kernels are vectorized (AVX-512 / AVX2) only for bf16
inputs; their fp32 instantiations are the scalar reference loops, 4-30x slower than the fp32 oneDNN linear.
The bf16 kernels still dequantize to fp32 and accumulate in fp32; only the layer's input and output are
rounded to bf16 (relative 2^-9), an error well below the weight quantization's own. Everything outside the
linear layers (norms, attention, residual stream, logits softmax) stays fp32. Scales and zeros are stored
in bf16 because the kernels read them in the activation dtype.

Measured on this machine (`python -m specserve.bench.quant kernels`: 2 threads, AVX-512, medians of
interleaved rounds, weights cycled past the 32 MiB L3); speed relative to the fp32 oneDNN packed linear,
>1 is faster:

    shape (K->N)       M:   1     2     4     8    16  |  64   256
    int4 g32  1536->8960  3.9   3.4   2.4   1.5   1.0 | 0.80  0.75
    int4 g128 1536->8960  4.1   3.6   2.5   1.6   1.0 | 0.82  0.77
    int8      1536->8960  1.7   1.8   1.4   1.0   0.7 | 0.54  0.57
    int4 g32  8960->1536  3.9   3.5   2.0   1.9   1.0
    int4 g32  1536->151936 (lm head)  3.4  2.7  1.9  1.3  0.9
    int8      1536->151936 (lm head)  1.7  1.5  1.1  0.8  0.5
    fp32 kernels with fp32 activations (M = 1, 1536->8960): int8 0.28x, int4 0.14x (scalar loops)

Neither kernel reaches the memory roofline at M = 1 (int4 reads 0.5 B/weight, yet runs at ~6-7 GB/s of
weight): both are bound by dequantization work on 2 cores, and the int4 kernel re-dequantizes its weight
tile for every 4 rows, so its cost grows with M faster than oneDNN's fp32 GEMM. Each path was chosen by
these numbers: int4 beats fp32 at every M up to 16 (and costs 0.75-0.8x at prefill sizes), so it is used
for all M; int8 is faster than fp32 only up to M ~ 8 and is offered for its accuracy, not its speed. Both
are batch invariant: a row's output does not depend on the other rows of the call.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from specserve.config import QUANTIZATION_MODES, SpecserveError
from specserve.layers.linear import PackedLinear

INT4_GROUP_SIZES = (32, 64, 128, 256)  # what the int4 kernel accepts
DEFAULT_GROUP_SIZE = 32
COMPUTE_DTYPE = torch.bfloat16  # the kernels' vectorized instantiation on x86 (see the module docstring)
INT8_K_MULTIPLE = 16  # the int8 kernel reads 16 inputs per vector step; other K crash or go wrong
INT4_N_MULTIPLE = 16  # the int4 packing works on blocks of 16 output channels
# MoE routers stay fp32: a rounding error there changes which experts run (llama.cpp keeps them F32 too).
ROUTER_SUFFIXES = ("mlp.gate", "router.proj")


def check_mode(mode: str) -> str:
    if mode not in QUANTIZATION_MODES:
        raise SpecserveError(f"quantization must be one of {', '.join(QUANTIZATION_MODES)}, got {mode!r}")
    return mode


# ------------------------------------------------------------------------------------------------ formats


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [N, K], scales bf16 [N]) with w ~ q * s; |w - q * s| <= s / 2 (s rounded to bf16 first)."""
    w = weight.detach().float()
    scales = (w.abs().amax(dim=1) / 127).clamp_min(1e-12).to(COMPUTE_DTYPE)
    q = torch.round(w / scales.float()[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scales


def requantize_int8_groups(q: torch.Tensor, group_scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel int8 from int8 with one scale per group of K (GGUF Q8_0): w = q * group scale.

    The int8 kernel has one scale per output channel, so each row is rescaled to its largest group scale
    times 127; rows whose groups share one scale come through unchanged."""
    n, k = q.shape
    groups = group_scales.shape[1]
    w = (q.float().view(n, groups, k // groups) * group_scales.float()[..., None]).view(n, k)
    return quantize_int8(w)


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


# ------------------------------------------------------------------------------------------------ modules


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    """[..., K] -> contiguous bf16 [rows, K], as both kernels require."""
    return x.reshape(-1, x.shape[-1]).to(COMPUTE_DTYPE).contiguous()


def _finish(y: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = y.to(x.dtype).reshape(*x.shape[:-1], y.shape[-1])
    return y if bias is None else y + bias.to(x.dtype)


class Int8Linear(nn.Module):
    """Inference-only linear layer with an int8 per-channel weight; `weight` reads the dequantized fp32."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.register_buffer("qweight", qweight.to(torch.int8).contiguous())
        self.register_buffer("scales", scales.to(COMPUTE_DTYPE).contiguous())
        self.bias = bias

    @property
    def weight(self) -> torch.Tensor:
        return self.qweight.float() * self.scales.float()[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int8pack_mm(_as_rows(x), self.qweight, self.scales)
        return _finish(y, x, self.bias)

    def extra_repr(self) -> str:
        bias = self.bias is not None
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={bias}"


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            _as_rows(x), self.packed, self.group_size, self.scales_and_zeros
        )
        return _finish(y, x, self.bias)

    def extra_repr(self) -> str:
        bias = self.bias is not None
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"group_size={self.group_size}, bias={bias}"
        )


QuantizedLinear = Int8Linear | Int4Linear


def int4_group_size(in_features: int, out_features: int, wanted: int = DEFAULT_GROUP_SIZE) -> int | None:
    """The largest kernel group size <= `wanted` that divides K, or None when the kernel cannot take it."""
    if out_features % INT4_N_MULTIPLE:
        return None
    fits = [g for g in INT4_GROUP_SIZES if g <= wanted and in_features % g == 0]
    return max(fits) if fits else None


def supports(mode: str, in_features: int, out_features: int) -> bool:
    """Whether the mode's kernel takes a [out, in] weight."""
    if check_mode(mode) == "int8":
        return in_features % INT8_K_MULTIPLE == 0
    return int4_group_size(in_features, out_features) is not None


def quantize_linear(
    weight: torch.Tensor, bias: torch.Tensor | None, mode: str, group_size: int = DEFAULT_GROUP_SIZE
) -> QuantizedLinear:
    """The quantized layer for a dense fp32 weight (the caller checked `supports`)."""
    if check_mode(mode) == "int8":
        return Int8Linear(*quantize_int8(weight), bias)
    group_size = int4_group_size(weight.shape[1], weight.shape[0], group_size)
    return Int4Linear(*quantize_int4(weight, group_size), bias)


# ---------------------------------------------------------------------------------------------- models


def quantizable_linears(model: nn.Module, mode: str, lm_head: bool = True) -> Iterator[list[str]]:
    """The qualified names of each linear layer `quantize_model` would replace (a module registered under
    several names comes once, with all of them). Plain nn.Linear and oneDNN PackedLinear both count."""
    names_of: dict[int, list[str]] = {}
    for qualname, module in model.named_modules(remove_duplicate=False):
        if not isinstance(module, nn.Linear | PackedLinear) or qualname.endswith(ROUTER_SUFFIXES):
            continue
        if qualname == "lm_head" and not lm_head:
            continue
        on_cpu = isinstance(module, PackedLinear) or module.weight.device.type == "cpu"
        if on_cpu and supports(mode, module.in_features, module.out_features):
            names_of.setdefault(id(module), []).append(qualname)
    yield from names_of.values()


def replace_module(model: nn.Module, names: list[str], new: nn.Module) -> None:
    for qualname in names:
        parent_name, _, name = qualname.rpartition(".")
        setattr(model.get_submodule(parent_name), name, new)


def quantize_model(
    model: nn.Module, mode: str, group_size: int = DEFAULT_GROUP_SIZE, lm_head: bool = True
) -> int:
    """Replace, in place, every linear layer the mode's kernel can take by its quantized version (weights
    already loaded; works before or after `pack_linears`); returns how many were replaced.

    MoE routers stay fp32, and so does anything the kernels cannot take (the int4 kernel needs N % 16 == 0
    and a group size dividing K, the int8 kernel K % 16 == 0). A head tied to the embedding gets its own
    quantized copy; the embedding itself stays fp32 (a lookup reads one row per token). `lm_head=False`
    keeps the LM head in fp32. Usable on a draft model on its own, independently of the target.
    """
    count = 0
    for names in list(quantizable_linears(model, mode, lm_head)):
        linear = model.get_submodule(names[0])
        with torch.no_grad():
            new = quantize_linear(linear.weight, linear.bias, mode, group_size)
        replace_module(model, names, new)
        count += 1
    return count
