"""Gated feed-forward block: down(act(gate(x)) * up(x))."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specserve.layers import kernels
from specserve.layers.fusion import project

_ACTIVATIONS = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}
KERNEL_ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1}  # rows.cpp's gated_activation


def activation(name: str):
    if name not in _ACTIVATIONS:
        raise NotImplementedError(f"activation {name!r} is not supported; supported: {sorted(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


class GatedMLP(nn.Module):
    FUSED_PROJECTIONS = (("gate_proj", "up_proj"),)

    def __init__(self, hidden_size: int, intermediate_size: int, act: str = "silu", bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.act = activation(act)
        self.kernel_act = KERNEL_ACTIVATIONS.get(act) if kernels.ops() is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.activate(*project(x, self.gate_proj, self.up_proj)))

    def activate(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """act(gate) * up, row by row (rows.cpp's kernel where it takes them)."""
        if self.kernel_act is not None and gate.dim() == 2 and kernels.rows_take(gate, up):
            return torch.ops.specserve.gated_activation(gate, up, self.kernel_act)
        return self.act(gate) * up
