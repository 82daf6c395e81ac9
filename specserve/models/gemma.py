"""Gemma 3 and Gemma 4 text decoders on the paged KV cache.

One class covers both families; the differences are read from the config. transformers'
`modeling_gemma3.py` / `modeling_gemma4.py` define the math and the parity tests pin it:
- both: embedding x sqrt(hidden) (rounded to the weight dtype), sandwich norms around attention and MLP,
  q/k RMSNorm before RoPE, sliding-window and global layers with their own RoPE, tanh final-logit softcap.
- Gemma 3: RMSNorm scales by (1 + w); attention scale query_pre_attn_scalar^-0.5.
- Gemma 4: RMSNorm scales by w; attention scale 1; parameter-free v_norm; global layers have their own
  head_dim / kv heads and may use the K projection as V (`attention_k_eq_v`); a per-layer output scalar;
  optional per-layer inputs (PLE), a MoE block beside the MLP, and trailing layers that read an earlier
  layer's KV cache (`num_kv_shared_layers`, with optionally double-wide MLPs).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from specserve.layers.attention import AttentionBackend, KVCache, sdpa_paged_attention
from specserve.layers.fusion import project
from specserve.layers.metadata import ForwardMetadata
from specserve.layers.mlp import GatedMLP, activation
from specserve.layers.moe import Experts, split_fused_experts
from specserve.layers.norm import RMSNorm
from specserve.layers.rotary import RotaryEmbedding, inverse_frequencies
from specserve.models.base import CausalLM, LayerCacheSpec

_LAYER_TYPES = ("sliding_attention", "full_attention")
# Multimodal checkpoints nest the language model; old-format ones put it first.
_PREFIXES = (
    ("language_model.lm_head.", "lm_head."),
    ("language_model.model.", "model."),
    ("model.language_model.", "model."),
)
_NON_TEXT = {"vision_tower", "audio_tower", "multi_modal_projector", "embed_vision", "embed_audio"}
_KV_WEIGHT = re.compile(r"model\.layers\.(\d+)\.self_attn\.(k_proj|v_proj|k_norm|v_norm)\.")


@dataclass(frozen=True)
class LayerPlan:
    """What varies between layers: attention type, KV geometry, whose cache the layer reads, MLP width."""

    layer_type: str
    head_dim: int
    num_kv_heads: int
    k_eq_v: bool
    kv_source: int
    intermediate_size: int
    rope_config: object  # config (view) whose rope_parameters the RoPE reads; head_dim above is its dim


def plan_layers(config, gemma4: bool) -> list[LayerPlan]:
    num_layers = config.num_hidden_layers
    types = list(config.layer_types)
    bad = sorted(set(types) - set(_LAYER_TYPES))
    if bad:
        raise NotImplementedError(f"layer_types {bad} are not supported (only {_LAYER_TYPES})")
    first_shared = num_layers - (getattr(config, "num_kv_shared_layers", 0) or 0)
    per_layer = getattr(config, "per_layer_config", None)
    plans = []
    for i, layer_type in enumerate(types):
        view = per_layer[i] if per_layer is not None else config
        head_dim, num_kv = view.head_dim, view.num_key_value_heads
        is_global = layer_type == "full_attention"
        if gemma4 and per_layer is None and is_global:  # configs from before transformers' per_layer_config
            head_dim = config.global_head_dim
            if config.attention_k_eq_v and config.num_global_key_value_heads:
                num_kv = config.num_global_key_value_heads
        source = i
        if i >= first_shared:  # reads the cache of the last non-shared layer of its type (HF "store" layer)
            producers = [j for j in range(first_shared) if types[j] == layer_type]
            if not producers:
                n = config.num_kv_shared_layers
                raise NotImplementedError(f"num_kv_shared_layers={n}: no earlier {layer_type} layer to read")
            source = producers[-1]
        double = gemma4 and config.use_double_wide_mlp and source != i
        plans.append(
            LayerPlan(
                layer_type=layer_type,
                head_dim=head_dim,
                num_kv_heads=num_kv,
                k_eq_v=gemma4 and config.attention_k_eq_v and is_global,
                kv_source=source,
                intermediate_size=config.intermediate_size * (2 if double else 1),
                rope_config=view,
            )
        )
    return plans


def _check_supported(config, gemma4: bool) -> None:
    bidirectional = getattr(config, "use_bidirectional_attention", None)
    if bidirectional is True or bidirectional == "all":
        raise NotImplementedError(f"use_bidirectional_attention={bidirectional!r} (non-causal text)")
    # HF Gemma 3 stores attn_logit_softcapping but never applies it; we follow HF (see the parity tests).


def _norm_kwargs(config, gemma4: bool) -> dict:
    return {"eps": config.rms_norm_eps, "offset": 0.0 if gemma4 else 1.0, "scale_in_fp32": True}


def _scaled_embedding(embedding: nn.Module, ids: torch.Tensor, scale: float) -> torch.Tensor:
    # HF multiplies by the scale cast to the weight dtype (sqrt(2304) = 48.0 in bf16, not 48.0104...).
    rows = embedding(ids)
    return rows * torch.tensor(scale, dtype=rows.dtype).item()


class GemmaAttention(nn.Module):
    # (q, k) for the layers whose V is K (attention_k_eq_v); KV-shared layers project only q
    FUSED_PROJECTIONS = (("q_proj", "k_proj", "v_proj"), ("q_proj", "k_proj"))

    def __init__(self, config, plan: LayerPlan, layer_idx: int, gemma4: bool):
        super().__init__()
        hidden, heads, d = config.hidden_size, config.num_attention_heads, plan.head_dim
        bias = config.attention_bias
        self.head_dim = d
        self.kv_source = plan.kv_source
        self.owns_cache = plan.kv_source == layer_idx
        self.scale = 1.0 if gemma4 else config.query_pre_attn_scalar**-0.5
        self.sliding_window = config.sliding_window if plan.layer_type == "sliding_attention" else None
        self.q_proj = nn.Linear(hidden, heads * d, bias=bias)
        self.o_proj = nn.Linear(heads * d, hidden, bias=bias)
        self.q_norm = RMSNorm(d, **_norm_kwargs(config, gemma4))
        if self.owns_cache:  # KV-shared layers have no K/V weights at all
            self.k_proj = nn.Linear(hidden, plan.num_kv_heads * d, bias=bias)
            self.v_proj = None if plan.k_eq_v else nn.Linear(hidden, plan.num_kv_heads * d, bias=bias)
            self.k_norm = RMSNorm(d, **_norm_kwargs(config, gemma4))
            self.v_norm = RMSNorm(d, eps=config.rms_norm_eps, with_scale=False) if gemma4 else None
        self.rotary = RotaryEmbedding(*inverse_frequencies(plan.rope_config, d, plan.layer_type))
        self.attention_backend: AttentionBackend = sdpa_paged_attention  # the platform may install another

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, attn: ForwardMetadata, kv_caches: Sequence[KVCache]
    ) -> torch.Tensor:
        n = x.shape[0]
        cache = kv_caches[self.kv_source]
        if self.owns_cache:
            kv_layers = (self.k_proj,) if self.v_proj is None else (self.k_proj, self.v_proj)
            q, *kv = (y.view(n, -1, self.head_dim) for y in project(x, self.q_proj, *kv_layers))
            # attention_k_eq_v: V is the K projection before k_norm (and before RoPE).
            k, v = kv[0], kv[-1]
            q, k = self.q_norm(q), self.k_norm(k)
            if self.v_norm is not None:
                v = self.v_norm(v)
            q = self.rotary.rotate_and_cache(positions, q, k, v, cache, attn.slot_mapping)
        else:  # the source layer already wrote this step's K/V earlier in the same forward
            (q,) = self.rotary(positions, self.q_norm(self.q_proj(x).view(n, -1, self.head_dim)))
        out = self.attention_backend(q, cache, attn, self.scale, self.sliding_window)
        return self.o_proj(out.reshape(n, -1))


class GemmaRouter(nn.Module):
    """Gemma 4 MoE router: scaled, scale-free RMSNorm, fp32 softmax, renormalised top-k, per-expert scale."""

    def __init__(self, config):
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, with_scale=False)
        self.proj = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(config.hidden_size))
        self.per_expert_scale = nn.Parameter(torch.ones(config.num_experts))
        self.top_k = config.top_k_experts
        self.root = config.hidden_size**-0.5

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = self.proj(self.norm(h) * self.scale * self.root).float().softmax(-1)
        weights, ids = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        return weights * self.per_expert_scale[ids], ids


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config, plan: LayerPlan, layer_idx: int, gemma4: bool):
        super().__init__()
        hidden, norm = config.hidden_size, _norm_kwargs(config, gemma4)
        self.self_attn = GemmaAttention(config, plan, layer_idx, gemma4)
        self.mlp = GatedMLP(hidden, plan.intermediate_size, config.hidden_activation)
        self.input_layernorm = RMSNorm(hidden, **norm)
        self.post_attention_layernorm = RMSNorm(hidden, **norm)
        self.pre_feedforward_layernorm = RMSNorm(hidden, **norm)
        self.post_feedforward_layernorm = RMSNorm(hidden, **norm)
        # A parameter (not a buffer) so that load_weights fills it from the checkpoint.
        self.layer_scalar = nn.Parameter(torch.ones(1), requires_grad=False) if gemma4 else None
        self.moe = gemma4 and config.enable_moe_block
        if self.moe:
            self.router = GemmaRouter(config)
            moe_width = config.moe_intermediate_size
            self.experts = Experts(config.num_experts, hidden, moe_width, config.hidden_activation)
            self.post_feedforward_layernorm_1 = RMSNorm(hidden, **norm)
            self.post_feedforward_layernorm_2 = RMSNorm(hidden, **norm)
            self.pre_feedforward_layernorm_2 = RMSNorm(hidden, **norm)
        self.ple = gemma4 and bool(config.hidden_size_per_layer_input)
        if self.ple:
            self.act = activation(config.hidden_activation)
            self.per_layer_input_gate = nn.Linear(hidden, config.hidden_size_per_layer_input, bias=False)
            self.per_layer_projection = nn.Linear(config.hidden_size_per_layer_input, hidden, bias=False)
            self.post_per_layer_input_norm = RMSNorm(hidden, **norm)

    def forward(self, h, positions, attn, kv_caches, per_layer_input: torch.Tensor | None) -> torch.Tensor:
        x = self.self_attn(self.input_layernorm(h), positions, attn, kv_caches)
        h = h + self.post_attention_layernorm(x)
        x = self.mlp(self.pre_feedforward_layernorm(h))
        if self.moe:  # the experts run beside the dense MLP, routed on the same residual
            moe = self.experts(self.pre_feedforward_layernorm_2(h), *self.router(h))
            x = self.post_feedforward_layernorm_1(x) + self.post_feedforward_layernorm_2(moe)
        h = h + self.post_feedforward_layernorm(x)
        if self.ple:
            x = self.act(self.per_layer_input_gate(h)) * per_layer_input
            h = h + self.post_per_layer_input_norm(self.per_layer_projection(x))
        if self.layer_scalar is not None:
            h = h * self.layer_scalar
        return h


class GemmaModel(nn.Module):
    """The decoder stack; named `model` in GemmaForCausalLM so parameter names match HF checkpoints."""

    def __init__(self, config, plans: list[LayerPlan], gemma4: bool):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(GemmaDecoderLayer(config, p, i, gemma4) for i, p in enumerate(plans))
        self.norm = RMSNorm(config.hidden_size, **_norm_kwargs(config, gemma4))
        self.ple_size = config.hidden_size_per_layer_input if gemma4 else 0
        if self.ple_size:
            total = config.num_hidden_layers * self.ple_size
            self.embed_tokens_per_layer = nn.Embedding(config.vocab_size_per_layer_input, total)
            self.per_layer_model_projection = nn.Linear(config.hidden_size, total, bias=False)
            self.per_layer_projection_norm = RMSNorm(self.ple_size, **_norm_kwargs(config, gemma4))

    def per_layer_inputs(self, ids: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """Gemma 4 PLE [N, layers, ple]: (norm(proj(embeds) / sqrt(H)) + scaled token embedding) / sqrt(2)."""
        shape = (ids.shape[0], len(self.layers), self.ple_size)
        token = _scaled_embedding(self.embed_tokens_per_layer, ids, self.ple_size**0.5).view(shape)
        context = self.per_layer_model_projection(embeds) * self.hidden_size**-0.5
        return (self.per_layer_projection_norm(context.view(shape)) + token) * 2**-0.5

    def forward(self, ids, positions, attn, kv_caches, capture_layers):
        h = _scaled_embedding(self.embed_tokens, ids, self.hidden_size**0.5)
        captured = {-1: h} if -1 in capture_layers else {}
        ple = self.per_layer_inputs(ids, h) if self.ple_size else None
        for i, layer in enumerate(self.layers):
            h = layer(h, positions, attn, kv_caches, ple[:, i] if ple is not None else None)
            if i in capture_layers:
                captured[i] = h
        return self.norm(h), captured


class GemmaForCausalLM(CausalLM):
    def __init__(self, config):
        super().__init__()
        self.config = config
        gemma4 = config.model_type == "gemma4_text"
        _check_supported(config, gemma4)
        self.plans = plan_layers(config, gemma4)
        self.model = GemmaModel(config, self.plans, gemma4)
        self.tied = bool(config.tie_word_embeddings)
        if not self.tied:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.final_softcap = config.final_logit_softcapping

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: ForwardMetadata,
        kv_caches: Sequence[KVCache],
        capture_layers: Sequence[int] = (),
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        return self.model(input_ids, positions, attn, kv_caches, set(capture_layers))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    def tie_weights(self) -> None:
        """A tied head becomes an nn.Linear on the embedding's own Parameter, made after loading so that no
        head weight is allocated or read: `pack_linears` then packs it (batch invariant), as Qwen's."""
        if self.tied:
            embed = self.model.embed_tokens.weight
            self.lm_head = nn.Linear(embed.shape[1], embed.shape[0], bias=False, device="meta")
            self.lm_head.weight = embed

    def cache_specs(self) -> list[LayerCacheSpec]:
        return [
            LayerCacheSpec(
                num_kv_heads=p.num_kv_heads,
                head_dim=p.head_dim,
                sliding_window=self.config.sliding_window if p.layer_type == "sliding_attention" else None,
                shared_with=p.kv_source if p.kv_source != i else None,
            )
            for i, p in enumerate(self.plans)
        ]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], adopt: bool = False) -> None:
        super().load_weights(split_fused_experts(weights), adopt)

    def checkpoint_name_map(self, name: str) -> str | None:
        for old, new in _PREFIXES:
            if name.startswith(old):
                name = new + name[len(old) :]
                break
        if _NON_TEXT & set(name.split(".")):
            return None
        if self.tied and name == "lm_head.weight":  # some tied checkpoints still carry a copy
            return None
        shared = _KV_WEIGHT.match(name)
        if shared and self.plans[int(shared[1])].kv_source != int(shared[1]):
            return None  # KV-shared layers: HF ignores these tensors too
        return name
