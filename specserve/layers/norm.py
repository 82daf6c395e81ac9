"""RMSNorm in the flavours our model families use, and the gated RMSNorm of Gated DeltaNet."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specserve.layers import kernels
from specserve.layers.mlp import KERNEL_ACTIVATIONS


def _normalized(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) in fp32, row by row: torch's fused op, bitwise the same as the five ops
    it replaces (pow, mean, add, rsqrt, mul) and a third of their time at decode sizes."""
    return F.rms_norm(x.float(), x.shape[-1:], eps=eps)


class RMSNorm(nn.Module):
    """y = x / rms(x) * scale, normalised in fp32.

    `offset=1.0` is Gemma 3's (1 + w) scale (weights stored zero-centred); `scale_in_fp32` multiplies
    before casting back (Gemma), otherwise the normalised x is cast first (Qwen/Llama); `with_scale=False`
    is Gemma 4's parameter-free v_norm.
    """

    def __init__(
        self,
        dim: int,
        eps: float = 1e-6,
        offset: float = 0.0,
        scale_in_fp32: bool = False,
        with_scale: bool = True,
    ):
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.scale_in_fp32 = scale_in_fp32
        self.weight = nn.Parameter(torch.full((dim,), 1.0 - offset)) if with_scale else None
        self.on_kernel = kernels.ops() is not None  # fp32 rows then take rows.cpp's rms_norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.on_kernel and kernels.rows_take(x, self.weight):
            return torch.ops.specserve.rms_norm(x, self.weight, self.eps, self.offset)
        normed = _normalized(x, self.eps)
        if self.weight is None:
            return normed.to(x.dtype)
        if self.scale_in_fp32:
            return (normed * (self.offset + self.weight.float())).to(x.dtype)
        scale = self.weight if self.offset == 0 else self.offset + self.weight
        return scale * normed.to(x.dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + residual, its norm): a layer's residual add and the norm after it, in one kernel call."""
        if (
            self.on_kernel
            and residual.shape == x.shape
            and residual.is_contiguous()
            and kernels.rows_take(x, residual, self.weight)
        ):
            return torch.ops.specserve.add_rms_norm(x, residual, self.weight, self.eps, self.offset)
        h = x + residual
        return h, self(h)


class GatedRMSNorm(nn.Module):
    """y = w * (x / rms(x)) * silu(gate): Gated DeltaNet's output norm (Qwen3-Next, Qwen3.5).

    Normalised in fp32 and cast before the scale w (stored as is, not zero-centred); the gate in fp32.
    fp32 rows take two of rows.cpp's kernels (RMSNorm, then the gated activation) for torch's ~8 ops.
    """

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.on_kernel = kernels.ops() is not None

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        if self.on_kernel and kernels.rows_take(x, gate, self.weight):
            ops, rows = torch.ops.specserve, x.shape[0]  # [rows, heads, dim] flattened to rows of heads x dim
            normed = ops.rms_norm(x, self.weight, self.eps, 0.0).view(rows, -1)
            return ops.gated_activation(gate.reshape(rows, -1), normed, KERNEL_ACTIVATIONS["silu"]).view_as(x)
        normed = _normalized(x, self.eps).to(x.dtype)
        return (self.weight * normed * F.silu(gate.float())).to(x.dtype)
