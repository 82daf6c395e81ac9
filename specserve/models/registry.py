"""Maps a HF `architectures` / `model_type` to our implementation."""

from __future__ import annotations

import importlib

import torch

from specserve.layers.meta_device import on_meta
from specserve.models.base import CausalLM

# model_type -> (module, class). Multimodal wrappers resolve to their text config first (see text_config_of).
_MODELS: dict[str, tuple[str, str]] = {
    "qwen2": ("specserve.models.qwen", "QwenForCausalLM"),
    "qwen3": ("specserve.models.qwen", "QwenForCausalLM"),
    "qwen3_moe": ("specserve.models.qwen", "QwenForCausalLM"),
    "qwen3_next": ("specserve.models.qwen3_next", "HybridQwenForCausalLM"),
    "qwen3_5_text": ("specserve.models.qwen3_next", "HybridQwenForCausalLM"),
    "qwen3_5_moe_text": ("specserve.models.qwen3_next", "HybridQwenForCausalLM"),
    "gemma3_text": ("specserve.models.gemma", "GemmaForCausalLM"),
    "gemma4_text": ("specserve.models.gemma", "GemmaForCausalLM"),
}


def supported_model_types() -> list[str]:
    return sorted(_MODELS)


def text_config_of(config):
    """The language-model part of a HF config (Gemma 3/4 and Qwen3.5 multimodal configs nest it)."""
    return getattr(config, "text_config", None) or config


def model_class(config) -> type[CausalLM]:
    """Our implementation of a (text) config's model_type."""
    model_type = getattr(config, "model_type", None)
    if model_type not in _MODELS:
        raise ValueError(
            f"model_type {model_type!r} is not supported; supported: {', '.join(supported_model_types())}"
        )
    module, cls = _MODELS[model_type]
    return getattr(importlib.import_module(module), cls)


def model_skeleton(config) -> CausalLM:
    """The model for `config` on the meta device: its modules, shapes and cache specs, and no memory (what
    the checks before loading read)."""
    config = text_config_of(config)
    model_cls = model_class(config)
    with on_meta():
        return model_cls(config)


def build_model(config, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> CausalLM:
    """An uninitialised model for `config` on `device` (weights are loaded afterwards)."""
    return model_skeleton(config).to(dtype).to_empty(device=device)
