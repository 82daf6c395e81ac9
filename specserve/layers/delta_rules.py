"""Gated DeltaNet's delta-rule backends by name, and putting one into a model's layers (what the platform
asks for): "torch" (`gated_deltanet.TorchDeltaRule`, every device) or "fla" (`gdn_fla.FlaDeltaRule`,
flash-linear-attention's Triton kernels, for CUDA; fla-core is optional and imported only when chosen)."""

from __future__ import annotations

from torch import nn

from specserve.layers.gated_deltanet import DeltaRule, GatedDeltaNet, TorchDeltaRule

DELTA_RULES = ("torch", "fla")


def delta_rule_backend(name: str) -> DeltaRule:
    """The delta-rule backend called `name`: "torch" (any device) or "fla" (Triton kernels, CUDA)."""
    if name == "torch":
        return TorchDeltaRule()
    if name == "fla":
        from specserve.layers.gdn_fla import FlaDeltaRule  # fla-core is optional: imported when chosen

        return FlaDeltaRule()
    raise ValueError(f"unknown Gated DeltaNet backend {name!r}; known: {', '.join(DELTA_RULES)}")


def use_delta_rule(model: nn.Module, name: str) -> int:
    """Run the delta rule of every GatedDeltaNet layer in `model` on backend `name`; returns how many."""
    backend = delta_rule_backend(name)
    layers = [m for m in model.modules() if isinstance(m, GatedDeltaNet)]
    for layer in layers:
        layer.delta_rule = backend
    return len(layers)
