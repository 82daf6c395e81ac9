"""The Qwen family in one model: Qwen2/2.5 (qkv bias), Qwen3 (per-head q/k RMSNorm), Qwen3-MoE (experts).

The hybrid Qwen3-Next / Qwen3.5 models (`qwen3_next.py`) reuse the attention, the MoE block and the loading.

Parameter names equal the HF checkpoint names, so `load_weights` copies tensors straight in.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn

from specserve.layers.attention import AttentionBackend, KVCache, sdpa_paged_attention
from specserve.layers.fusion import project
from specserve.layers.metadata import ForwardMetadata
from specserve.layers.mlp import GatedMLP
from specserve.layers.moe import Experts, route_topk, split_fused_experts
from specserve.layers.norm import RMSNorm
from specserve.layers.rotary import RotaryEmbedding, inverse_frequencies
from specserve.models.base import CausalLM, LayerCacheSpec


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _sliding_window(config, layer_idx: int) -> int | None:
    """The layer's attention window as HF decides it: only with use_sliding_window, then per layer_types."""
    window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", False) else None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and layer_types[layer_idx] != "sliding_attention":
        return None
    return window


def _is_moe_layer(config, layer_idx: int) -> bool:
    return (
        getattr(config, "num_experts", 0) > 0
        and layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
        and (layer_idx + 1) % getattr(config, "decoder_sparse_step", 1) == 0
    )


class QwenAttention(nn.Module):
    """`output_gate` (Qwen3-Next, Qwen3.5): q_proj also yields, per head, a gate g and the output is
    o * sigmoid(g). `norm_offset=1.0`: zero-centred q/k norms (scale 1 + w, in fp32)."""

    FUSED_PROJECTIONS = (("q_proj", "k_proj", "v_proj"),)

    def __init__(
        self,
        config,
        layer_idx: int,
        rotary: RotaryEmbedding,
        output_gate: bool = False,
        norm_offset: float = 0.0,
    ):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = _head_dim(config)
        self.scale = self.head_dim**-0.5
        self.sliding_window = _sliding_window(config, layer_idx)
        bias = getattr(config, "attention_bias", False)
        qkv_bias = bias or config.model_type == "qwen2"
        hidden, q_size = config.hidden_size, self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        self.output_gate = output_gate
        self.q_proj = nn.Linear(hidden, q_size * (2 if output_gate else 1), bias=qkv_bias)
        self.k_proj = nn.Linear(hidden, kv_size, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden, kv_size, bias=qkv_bias)
        self.o_proj = nn.Linear(q_size, hidden, bias=bias)
        self.qk_norm = config.model_type != "qwen2"
        if self.qk_norm:
            norm = dict(eps=config.rms_norm_eps, offset=norm_offset, scale_in_fp32=norm_offset != 0)
            self.q_norm = RMSNorm(self.head_dim, **norm)
            self.k_norm = RMSNorm(self.head_dim, **norm)
        self.rotary = rotary  # one instance shared by every layer (it holds no parameters)
        self.attention_backend: AttentionBackend = sdpa_paged_attention  # the platform may install another

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, attn: ForwardMetadata, cache: KVCache
    ) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = project(x, self.q_proj, self.k_proj, self.v_proj)
        gate = None
        if self.output_gate:  # per head: [q | gate]
            q, gate = q.view(n, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        else:
            q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = self.rotary.rotate_and_cache(positions, q, k, v, cache, attn.slot_mapping)
        o = self.attention_backend(q, cache, attn, self.scale, self.sliding_window).reshape(n, -1)
        if gate is not None:
            o = o * torch.sigmoid(gate.reshape(n, -1))
        return self.o_proj(o)


class QwenSparseMoe(nn.Module):
    """Qwen MoE feed-forward: a linear router (`gate`) picks top-k experts per token. Qwen3-Next and
    Qwen3.5-MoE add a shared expert that every token takes, scaled by sigmoid(shared_expert_gate(x))."""

    def __init__(self, config):
        super().__init__()
        hidden = config.hidden_size
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = getattr(config, "norm_topk_prob", True)  # Qwen3.5-MoE: no field, always
        self.gate = nn.Linear(hidden, config.num_experts, bias=False)
        self.experts = Experts(config.num_experts, hidden, config.moe_intermediate_size, config.hidden_act)
        shared = getattr(config, "shared_expert_intermediate_size", 0)
        self.shared_expert = GatedMLP(hidden, shared, config.hidden_act) if shared else None
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route_topk(self.gate(x), self.top_k, self.norm_topk_prob)
        if self.shared_expert is None:
            return self.experts(x, weights, ids)
        # fp64 sigmoid: in fp32 an [N, 1] gate rounds differently in a kernel's SIMD body and its scalar tail,
        # which would make a row's value depend on N (batch invariance).
        gate = torch.sigmoid(self.shared_expert_gate(x).double()).to(x.dtype)
        return self.experts(x, weights, ids, shared=(self.shared_expert, gate))

    def stack_experts(self) -> bool:
        """The routed experts' grouped calls, the shared expert in them where it has their shape (the real
        Qwen3-Next and Qwen3.5-MoE configs). `quant.fuse_projections` asks this module before its experts."""
        return self.experts.stack_experts(self.shared_expert)


class QwenDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, rotary: RotaryEmbedding):
        super().__init__()
        self.self_attn = QwenAttention(config, layer_idx, rotary)
        if _is_moe_layer(config, layer_idx):
            self.mlp = QwenSparseMoe(config)
        else:
            self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, h: torch.Tensor, positions: torch.Tensor, attn: ForwardMetadata, cache: KVCache
    ) -> torch.Tensor:
        h, x = self.post_attention_layernorm.add_forward(
            h, self.self_attn(self.input_layernorm(h), positions, attn, cache)
        )
        return h + self.mlp(x)


class QwenModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.rotary = RotaryEmbedding(*inverse_frequencies(config, _head_dim(config)))
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            QwenDecoderLayer(config, i, self.rotary) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class QwenForCausalLM(CausalLM):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = QwenModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: ForwardMetadata,
        kv_caches: Sequence[KVCache],
        capture_layers: Sequence[int] = (),
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        h = self.model.embed_tokens(input_ids)
        captured = {-1: h} if -1 in capture_layers else {}
        for i, layer in enumerate(self.model.layers):
            h = layer(h, positions, attn, kv_caches[i])
            if i in capture_layers:
                captured[i] = h
        return self.model.norm(h), captured

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def cache_specs(self) -> list[LayerCacheSpec]:
        return [
            LayerCacheSpec(
                layer.self_attn.num_kv_heads, layer.self_attn.head_dim, layer.self_attn.sliding_window
            )
            for layer in self.model.layers
        ]

    def checkpoint_name_map(self, name: str) -> str | None:
        return None if "rotary_emb.inv_freq" in name else name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], adopt: bool = False) -> None:
        super().load_weights(split_fused_experts(weights), adopt)

    def tied_parameter_names(self) -> set[str]:
        return {"lm_head.weight"} if getattr(self.config, "tie_word_embeddings", False) else set()

    def tie_weights(self) -> None:
        if self.tied_parameter_names():
            self.lm_head.weight = self.model.embed_tokens.weight
