"""Rotary position embeddings (rotate-half pairing), with frequencies computed from a HF config.

The inverse frequencies are computed here, from `rope_parameters` and the head dim the layer really has,
with transformers' formulas (`modeling_rope_utils.py`, the same from 5.10 to 5.24). We do not call its
initialisers: what they read changes between the releases we allow (on 5.10 Gemma 4's full-attention
layers need `head_dim_key="global_head_dim"`, later releases a per-layer config view), and a call that
misses it silently rotates with the wrong frequencies. tests/test_rotary.py checks each rope_type.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from specserve.layers import kernels

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from specserve.layers.attention import KVCache


def _powers(theta: float, dim: int, denominator: int | None = None) -> torch.Tensor:
    """theta^(2j / denominator) for j < dim / 2 (float32, as transformers computes it)."""
    return theta ** (torch.arange(0, dim, 2, dtype=torch.float) / (denominator or dim))


def _rotary_dim(params: dict, head_dim: int) -> int:
    return int(head_dim * params.get("partial_rotary_factor", 1.0))


def _default(config, params: dict, head_dim: int) -> tuple[torch.Tensor, float]:
    return 1.0 / _powers(params["rope_theta"], _rotary_dim(params, head_dim)), 1.0


def _linear(config, params: dict, head_dim: int) -> tuple[torch.Tensor, float]:
    # Scaling positions by 1 / factor is scaling the frequencies (Gemma 3's global layers).
    return _default(config, params, head_dim)[0] / params["factor"], 1.0


def _proportional(config, params: dict, head_dim: int) -> tuple[torch.Tensor, float]:
    # Gemma 4: the exponent's denominator is the whole head dim, the first partial_rotary_factor of the
    # frequencies rotate and the rest are 0 (identity), so the rotate-half pairs span the whole head.
    angles = int(params.get("partial_rotary_factor", 1.0) * head_dim // 2)
    rotated = 1.0 / _powers(params["rope_theta"], 2 * angles, head_dim)
    inv_freq = torch.cat((rotated, torch.zeros(head_dim // 2 - angles)))
    return inv_freq / params.get("factor", 1.0), 1.0


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(config, params: dict, head_dim: int) -> tuple[torch.Tensor, float]:
    theta, dim = params["rope_theta"], _rotary_dim(params, head_dim)
    original = params["original_max_position_embeddings"]
    factor = params.get("factor") or config.max_position_embeddings / original
    attention = params.get("attention_factor")
    if attention is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention = _yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:  # the dim that turns `rotations` times over `original`
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(params.get("beta_fast") or 32), correction_dim(params.get("beta_slow") or 1)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # high frequencies keep their value, low ones are interpolated by `factor`
    powers = _powers(theta, dim)
    inv_freq = 1.0 / (factor * powers) * (1 - extrapolation) + 1.0 / powers * extrapolation
    return inv_freq, float(attention)


_ROPE_TYPES: dict[str, Callable[..., tuple[torch.Tensor, float]]] = {
    "default": _default,
    "linear": _linear,
    "proportional": _proportional,
    "yarn": _yarn,  # Qwen2.5 / Qwen3 long-context configs
}


def inverse_frequencies(
    config: PretrainedConfig, head_dim: int, layer_type: str | None = None
) -> tuple[torch.Tensor, float]:
    """(inv_freq [rotary_dim / 2], attention scaling) for one layer type of a HF text config.

    `head_dim` is the layer's own (Gemma 4: global_head_dim on full-attention layers); the config's
    `head_dim` attribute is not read.
    """
    params = config.rope_parameters[layer_type] if layer_type else config.rope_parameters
    rope_type = params.get("rope_type", "default")
    if rope_type == "dynamic":
        raise NotImplementedError("dynamic NTK RoPE depends on the sequence length; not supported")
    if rope_type not in _ROPE_TYPES:
        raise NotImplementedError(
            f"rope_type {rope_type!r} is not supported (the supported families use {', '.join(_ROPE_TYPES)})"
        )
    # Models are built under `torch.device("meta")`; these tables must hold real values.
    with torch.device("cpu"):
        return _ROPE_TYPES[rope_type](config, params, head_dim)


class RotaryEmbedding(nn.Module):
    """Rotates the first 2 * len(inv_freq) channels of each head; the rest pass through."""

    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float = 1.0):
        super().__init__()
        # A plain attribute, not a buffer: models are built on the meta device and must keep these values.
        self.inv_freq = inv_freq.float().cpu()
        self.attention_scaling = attention_scaling
        self._cached: tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]] | None = None
        self.on_kernel = kernels.ops() is not None  # fp32 rows then take rows.cpp's rotate_and_cache

    def _apply(self, fn, recurse=True):
        """The table follows the module's device (`model.to("cuda")`), never its dtype: it stays fp32."""
        self.inv_freq = self.inv_freq.to(fn(self.inv_freq).device)
        return super()._apply(fn, recurse)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [N, rot] with sin's first half negated: x rotated is x * cos + roll(x) * sin, and
        -x2 * s equals x2 * -s bitwise, so this is HF's rotate_half formula in three ops instead of six."""
        # Every layer of a forward passes the same positions tensor: compute the table once per forward.
        if self._cached is not None and self._cached[0] is positions:
            return self._cached[1]
        freqs = positions[:, None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling
        half = freqs.shape[-1]
        table = (cos, torch.cat((-sin[:, :half], sin[:, half:]), dim=-1))
        self._cached = (positions, table)
        return table

    def rotate_and_cache(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: KVCache,
        slot_mapping: torch.Tensor,
    ) -> torch.Tensor:
        """q rotated, with k rotated and written to the cache beside v (q, k, v [N, heads, dim]). On the
        kernel, q and k are rotated in place, bitwise as `forward` rotates them."""
        if (
            self.on_kernel
            and kernels.rows_take(q, k, v, cache.k, cache.v)
            and q.dim() == k.dim() == v.dim() == 3
        ):
            cos, sin = self.cos_sin(positions)
            torch.ops.specserve.rotate_and_cache(q, k, v, cos, sin, cache.k, cache.v, slot_mapping)
            return q
        q, k = self(positions, q, k)
        cache.write(slot_mapping, k, v)
        return q

    def forward(self, positions: torch.Tensor, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Each x is [N, heads, head_dim]; positions is [N]."""
        cos, sin = (t[:, None, :] for t in self.cos_sin(positions))
        rot = cos.shape[-1]
        out = []
        for x in xs:
            x_rot = x[..., :rot].float()
            y = (x_rot * cos + x_rot.roll(rot // 2, dims=-1) * sin).to(x.dtype)
            out.append(torch.cat((y, x[..., rot:]), dim=-1) if x.shape[-1] > rot else y)
        return tuple(out)
