"""Hybrid Qwen text decoders: Qwen3-Next, Qwen3.5 (dense) and Qwen3.5-MoE.

Layers follow `layer_types`: Gated DeltaNet linear attention (`layers/gated_deltanet.py`, per-sequence
recurrent state in slots) or full attention with a sigmoid output gate, zero-centred q/k norms and partial
RoPE (qwen.py's QwenAttention, on the paged KV cache). The feed-forward is a dense MLP (Qwen3.5) or routed
experts plus a gated shared expert (Qwen3-Next, Qwen3.5-MoE: qwen.py's QwenSparseMoe). Residual norms are
zero-centred (scale 1 + w). Qwen3.5's multimodal RoPE sections reduce to plain RoPE on text positions.
transformers' `modeling_qwen3_next.py` / `modeling_qwen3_5*.py` define the math; tests/test_hybrid.py pins it.

Checkpoints: Qwen3.5's are multimodal wrappers (`model.language_model.*`; the vision tower `model.visual.*`
is skipped, with one log line); all ship a multi-token-prediction layer `mtp.*` that the target skips (the
MTP drafter reads it). Qwen3-Next fuses q/k/v/z and b/a per key-head group (`in_proj_qkvz`, `in_proj_ba`);
they are split into Qwen3.5's projections on load.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterable, Iterator, Sequence

import torch
from torch import nn

from specserve.layers.attention import KVCache
from specserve.layers.gated_deltanet import (
    GatedDeltaNet,
    RecurrentLayout,
    RecurrentState,
    RecurrentStateSpec,
)
from specserve.layers.metadata import ForwardMetadata, StateCheckpoints
from specserve.layers.mlp import GatedMLP
from specserve.layers.moe import split_fused_experts
from specserve.layers.norm import RMSNorm
from specserve.layers.rotary import RotaryEmbedding, inverse_frequencies
from specserve.models.base import CausalLM, LayerCacheSpec
from specserve.models.qwen import (
    QwenAttention,
    QwenForCausalLM,
    QwenSparseMoe,
    _head_dim,
    _is_moe_layer,
)

logger = logging.getLogger(__name__)

_LAYER_TYPES = ("linear_attention", "full_attention")
_PREFIXES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)
_VISION = ("model.visual.", "visual.", "model.vision_tower.")


def _zero_centred_norm(config, dim: int) -> RMSNorm:
    return RMSNorm(dim, config.rms_norm_eps, offset=1.0, scale_in_fp32=True)


class HybridDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, rotary: RotaryEmbedding):
        super().__init__()
        linear = config.layer_types[layer_idx] == "linear_attention"
        self.linear_attn = GatedDeltaNet(config, layer_idx) if linear else None
        self.self_attn = (
            None if linear else QwenAttention(config, layer_idx, rotary, output_gate=True, norm_offset=1.0)
        )
        if _is_moe_layer(config, layer_idx):
            self.mlp = QwenSparseMoe(config)
        else:
            self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
        self.input_layernorm = _zero_centred_norm(config, config.hidden_size)
        self.post_attention_layernorm = _zero_centred_norm(config, config.hidden_size)

    def forward(
        self,
        h: torch.Tensor,
        positions: torch.Tensor,
        attn: ForwardMetadata,
        cache: KVCache | RecurrentState,
        layout: RecurrentLayout | None,
    ) -> torch.Tensor:
        x = self.input_layernorm(h)
        if self.linear_attn is not None:
            x = self.linear_attn(x, layout, cache, attn.checkpoints)
        else:
            x = self.self_attn(x, positions, attn, cache)
        h, x = self.post_attention_layernorm.add_forward(x, h)
        return h + self.mlp(x)


class HybridModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.rotary = RotaryEmbedding(*inverse_frequencies(config, _head_dim(config)))
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            HybridDecoderLayer(config, i, self.rotary) for i in range(config.num_hidden_layers)
        )
        self.norm = _zero_centred_norm(config, config.hidden_size)


class HybridQwenForCausalLM(QwenForCausalLM):
    """Qwen3-Next / Qwen3.5 / Qwen3.5-MoE; logits, tying and expert loading are QwenForCausalLM's."""

    def __init__(self, config):
        nn.Module.__init__(self)
        bad = sorted(set(config.layer_types) - set(_LAYER_TYPES))
        if bad:
            raise NotImplementedError(f"layer_types {bad} are not supported (only {_LAYER_TYPES})")
        self.config = config
        self.model = HybridModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.kernel_size = config.linear_conv_kernel_dim

    @property
    def has_recurrent_state(self) -> bool:
        return any(layer.linear_attn is not None for layer in self.model.layers)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: ForwardMetadata,
        kv_caches: Sequence[KVCache | RecurrentState],
        capture_layers: Sequence[int] = (),
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        layout = RecurrentLayout.build(attn, self.kernel_size) if self.has_recurrent_state else None
        h = self.model.embed_tokens(input_ids)
        captured = {-1: h} if -1 in capture_layers else {}
        for i, layer in enumerate(self.model.layers):
            h = layer(h, positions, attn, kv_caches[i], layout)
            if i in capture_layers:
                captured[i] = h
        return self.model.norm(h), captured

    def cache_specs(self) -> list[LayerCacheSpec | RecurrentStateSpec]:
        return [
            layer.linear_attn.state_spec()
            if layer.linear_attn is not None
            else LayerCacheSpec(layer.self_attn.num_kv_heads, layer.self_attn.head_dim)
            for layer in self.model.layers
        ]

    def rollback_states(
        self, checkpoints: StateCheckpoints, caches: Sequence[KVCache | RecurrentState], keep: dict[int, int]
    ) -> None:
        unknown = sorted(set(keep) - set(checkpoints.pieces))
        if unknown:
            raise ValueError(f"pieces {unknown} were not checkpointed; checkpointed: {checkpoints.pieces}")
        for i, layer in enumerate(self.model.layers):
            if layer.linear_attn is not None:
                layer.linear_attn.rollback(checkpoints, caches[i], keep)

    def checkpoint_name_map(self, name: str) -> str | None:
        if name.startswith("mtp.") or name.startswith(_VISION) or "rotary_emb.inv_freq" in name:
            return None
        for old, new in _PREFIXES:
            if name.startswith(old):
                return new + name[len(old) :]
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], adopt: bool = False) -> None:
        vision = 0

        def counted() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal vision
            for name, tensor in weights:
                vision += name.startswith(_VISION)
                yield name, tensor

        super().load_weights(_split_fused_projections(counted(), self.config), adopt)
        if vision:
            logger.info("ignored %d vision-tower tensors: specserve serves the text model", vision)


def no_mtp_layer(model: str) -> str:
    """The refusal of method 'mtp' for a hybrid checkpoint without `mtp.*` tensors."""
    return (
        f"{model}: the checkpoint has no mtp.* tensors (a GGUF converted without its MTP layer has none); "
        "method 'mtp' needs a checkpoint or GGUF that carries it"
    )


class MultiTokenPredictor(CausalLM):
    """The multi-token-prediction layer a Qwen3-Next / Qwen3.5 checkpoint ships (`mtp.*`). Row t: the
    embedding of token t+1 and the target's final hidden state at t, each normed, concatenated (embedding
    first) and projected by `fc`, then one full-attention decoder layer of the target's kind (gated
    attention, the target's MLP or MoE) at RoPE position t, then `norm`; the target's LM head reads the
    result as logits of token t+2, and the result is the hidden input of the next drafting step. The
    embedding and LM head are the target's (not held here)."""

    def __init__(self, config):
        super().__init__()
        mtp_config = copy.copy(config)
        mtp_config.layer_types = ["full_attention"]  # released checkpoints have one MTP layer
        self.config = mtp_config
        self.rotary = RotaryEmbedding(*inverse_frequencies(config, _head_dim(config)))
        hidden = config.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.pre_fc_norm_embedding = _zero_centred_norm(config, hidden)
        self.pre_fc_norm_hidden = _zero_centred_norm(config, hidden)
        self.layers = nn.ModuleList([HybridDecoderLayer(mtp_config, 0, self.rotary)])
        self.norm = _zero_centred_norm(config, hidden)

    def forward(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        attn: ForwardMetadata,
        cache: KVCache,
    ) -> torch.Tensor:
        x = torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], dim=-1)
        return self.norm(self.layers[0](self.fc(x), positions, attn, cache, None))

    def cache_specs(self) -> list[LayerCacheSpec]:
        attention = self.layers[0].self_attn
        return [LayerCacheSpec(attention.num_kv_heads, attention.head_dim)]

    def checkpoint_name_map(self, name: str) -> str | None:
        return name.removeprefix("mtp.") if name.startswith("mtp.") else None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], adopt: bool = False) -> None:
        names = list(weights)
        extra = sorted({n.split(".")[2] for n, _ in names if n.startswith("mtp.layers.")} - {"0"})
        if extra:
            raise NotImplementedError(f"MTP layers {extra} beyond the first are not supported")
        super().load_weights(split_fused_experts(names), adopt)


def _split_fused_projections(
    weights: Iterable[tuple[str, torch.Tensor]], config
) -> Iterator[tuple[str, torch.Tensor]]:
    """Qwen3-Next's in_proj_qkvz [key heads x (q, k, v..., z...)] and in_proj_ba [key heads x (b..., a...)]
    rows -> Qwen3.5's in_proj_qkv (all q, all k, all v), in_proj_z, in_proj_b, in_proj_a."""
    groups, dk = config.linear_num_key_heads, config.linear_key_head_dim
    per_group = config.linear_num_value_heads // groups
    dv = per_group * config.linear_value_head_dim
    for name, tensor in weights:
        prefix, _, leaf = name.rpartition("linear_attn.")
        if leaf == "in_proj_qkvz.weight":
            hidden = tensor.shape[-1]
            q, k, v, z = (
                t.reshape(-1, hidden)
                for t in tensor.reshape(groups, 2 * dk + 2 * dv, hidden).split([dk, dk, dv, dv], dim=1)
            )
            yield f"{prefix}linear_attn.in_proj_qkv.weight", torch.cat([q, k, v])
            yield f"{prefix}linear_attn.in_proj_z.weight", z
        elif leaf == "in_proj_ba.weight":
            hidden = tensor.shape[-1]
            b, a = tensor.reshape(groups, 2 * per_group, hidden).split([per_group, per_group], dim=1)
            yield f"{prefix}linear_attn.in_proj_b.weight", b.reshape(-1, hidden)
            yield f"{prefix}linear_attn.in_proj_a.weight", a.reshape(-1, hidden)
        else:
            yield name, tensor
