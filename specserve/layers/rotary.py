"""Rotary position embeddings (rotate-half pairing), with frequencies taken from a HF config.

transformers' RoPE initialisers are the reference for every scaling variant (linear, yarn, llama3,
proportional...), so we ask them for the inverse frequencies and apply the rotation ourselves.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS


def inverse_frequencies(config, head_dim: int, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """(inv_freq [rotary_dim / 2], attention scaling) for one layer type of a HF text config."""
    params = config.rope_parameters[layer_type] if layer_type else config.rope_parameters
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
        theta = params["rope_theta"]
        return 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float, device="cpu") / dim), 1.0
    if rope_type == "dynamic":
        raise NotImplementedError("dynamic NTK RoPE depends on the sequence length; not supported")
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise NotImplementedError(f"unknown rope_type {rope_type!r}")
    kwargs = {"layer_type": layer_type} if layer_type else {}
    # Models are built under `torch.device("meta")`; the initialisers create tensors without a device.
    with torch.device("cpu"):
        return ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", **kwargs)


class RotaryEmbedding(nn.Module):
    """Rotates the first 2 * len(inv_freq) channels of each head; the rest pass through."""

    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float = 1.0):
        super().__init__()
        # A plain attribute, not a buffer: models are built on the meta device and must keep these values.
        self.inv_freq = inv_freq.float().cpu()
        self.attention_scaling = attention_scaling
        self._cached: tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]] | None = None

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Every layer of a forward passes the same positions tensor: compute the table once per forward.
        if self._cached is not None and self._cached[0] is positions:
            return self._cached[1]
        freqs = positions[:, None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        table = (
            (emb.cos() * self.attention_scaling)[:, None, :],
            (emb.sin() * self.attention_scaling)[:, None, :],
        )
        self._cached = (positions, table)
        return table

    def forward(self, positions: torch.Tensor, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Each x is [N, heads, head_dim]; positions is [N]."""
        cos, sin = self.cos_sin(positions)
        rot = cos.shape[-1]
        out = []
        for x in xs:
            x_rot, x_pass = x[..., :rot], x[..., rot:]
            half = rot // 2
            rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
            y = (x_rot.float() * cos + rotated.float() * sin).to(x.dtype)
            out.append(torch.cat((y, x_pass), dim=-1) if x_pass.shape[-1] else y)
        return tuple(out)
