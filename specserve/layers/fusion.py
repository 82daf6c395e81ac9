"""Projections that read the same input (q/k/v, gate/up), run as one quantized layer.

A module names such groups in `FUSED_PROJECTIONS` and computes them with `project`. Once a model is
quantized, `quant.fuse_projections` puts each group whose layers all run on specserve's kernel side by
side in one layer: the group then costs one kernel call, one activation quantization and one parallel
region instead of one per projection, which at batch 1 is a fixed cost per call paid ~200 times a token.
The outputs are bitwise those of the separate layers (the kernel computes each output column on its own),
and each layer still works alone (its buffers are views of the fused layer's).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(eq=False)
class Fusion:
    """The layer that computes `members` side by side; a plain attribute of each member (not a submodule:
    it holds no weights of its own, only views shared with them)."""

    layer: nn.Module
    members: tuple[nn.Module, ...]
    sizes: list[int]  # each member's out_features


def project(x: torch.Tensor, *layers: nn.Module) -> tuple[torch.Tensor, ...]:
    """(layer(x) for each layer): in one call when they are, in this order, the members of one fusion."""
    fusion = getattr(layers[0], "fusion", None)
    if fusion is not None and layers == fusion.members:  # nn.Module compares by identity
        return fusion.layer(x).split_with_sizes(fusion.sizes, dim=-1)  # not split: its Python wrapper costs
    return tuple(layer(x) for layer in layers)
