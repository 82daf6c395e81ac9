"""The DSpark / DFlash draft network: a parallel block drafter conditioned on target hidden states.

Data flow of one block (DSPARK.md §1): the anchor token and B-1 mask tokens are embedded at absolute
positions a..a+B-1; every draft layer attends, without a causal mask, to K/V projected from the target's
context features of positions < a (`hidden_norm(fc(features))`, shared by all layers, never passed through
a layer's own norms or MLP) and to the B block rows. Slot i predicts the token at position a+i+1.

The same layers run in two forms that tests hold equal: the incremental form writes context and block K/V
into a paged per-request cache (`PagedDraftBatch`, the engine's), the training form attends over the whole
sequence's context with a block mask (`DenseDraftBatch`). Parameter names are DeepSpec's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specserve.layers.attention import AttentionBackend, KVCache, sdpa_paged_attention
from specserve.layers.metadata import ForwardMetadata
from specserve.layers.mlp import GatedMLP
from specserve.layers.norm import RMSNorm
from specserve.layers.rotary import RotaryEmbedding, inverse_frequencies
from specserve.models.gemma import plan_layers
from specserve.spec_decode.deepspec.config import DrafterConfig, DSparkConfig
from specserve.spec_decode.deepspec.dflash2 import CandidateSelector, GroupedDynamicConv
from specserve.spec_decode.deepspec.heads import ConfidenceHead, MarkovHead, build_markov_head


def _norm(config: DrafterConfig, dim: int) -> RMSNorm:
    # Qwen3: w * cast(normed); Gemma 4: (normed * w) in fp32, plain w (not 1 + w).
    return RMSNorm(dim, config.backbone.rms_norm_eps, scale_in_fp32=config.family == "gemma4")


@dataclass(frozen=True)
class AttentionGeometry:
    head_dim: int
    num_kv_heads: int
    k_eq_v: bool
    scale: float
    rope_config: object  # the config view RoPE frequencies are read from


def attention_geometry(config: DrafterConfig) -> AttentionGeometry:
    """Every draft layer uses full-attention geometry (Gemma 4: the global head dim and its K=V option)."""
    b = config.backbone
    if config.family == "gemma4":
        plan = plan_layers(b, gemma4=True)[0]  # all draft layers are full attention
        return AttentionGeometry(plan.head_dim, plan.num_kv_heads, plan.k_eq_v, 1.0, plan.rope_config)
    head_dim = getattr(b, "head_dim", None) or b.hidden_size // b.num_attention_heads
    return AttentionGeometry(head_dim, b.num_key_value_heads, False, head_dim**-0.5, b)


def draft_rotary(config: DrafterConfig) -> RotaryEmbedding:
    """RoPE of the target's full-attention layers (Gemma 4: proportional, over the global head dim)."""
    geo = attention_geometry(config)
    layer_type = "full_attention" if config.family == "gemma4" else None
    return RotaryEmbedding(*inverse_frequencies(geo.rope_config, geo.head_dim, layer_type))


class DraftAttention(nn.Module):
    """Full attention of a draft layer. `in_features` is the hidden size for DSpark, 2H for EAGLE-3 (whose
    attention reads [embedding; hidden] rows)."""

    def __init__(
        self, config: DrafterConfig, layer_idx: int, rotary: RotaryEmbedding, in_features: int | None = None
    ):
        super().__init__()
        b, geo = config.backbone, attention_geometry(config)
        self.layer_idx = layer_idx
        self.geometry = geo
        bias = bool(getattr(b, "attention_bias", False))
        q_size, kv_size = b.num_attention_heads * geo.head_dim, geo.num_kv_heads * geo.head_dim
        in_features = in_features or b.hidden_size
        self.q_proj = nn.Linear(in_features, q_size, bias=bias)
        self.k_proj = nn.Linear(in_features, kv_size, bias=bias)
        self.v_proj = None if geo.k_eq_v else nn.Linear(in_features, kv_size, bias=bias)
        self.o_proj = nn.Linear(q_size, b.hidden_size, bias=bias)
        self.q_norm = _norm(config, geo.head_dim) if config.qk_norm else None
        self.k_norm = _norm(config, geo.head_dim) if config.qk_norm else None
        gemma = config.family == "gemma4"
        self.v_norm = RMSNorm(geo.head_dim, b.rms_norm_eps, with_scale=False) if gemma else None
        self.rotary = rotary
        self.attention_backend: AttentionBackend = sdpa_paged_attention  # the platform may install another

    def forward(self, x: torch.Tensor, context: torch.Tensor | None, batch: DraftBatch) -> torch.Tensor:
        """x: normed query rows [m, in]; context: projected context rows [n, in] that give K/V only."""
        d = self.geometry.head_dim
        q = self.q_proj(x).unflatten(-1, (-1, d))  # (unflatten: also for 0 rows)
        kv_rows = x if context is None else torch.cat([context, x])  # context first (DeepSpec's order)
        k = self.k_proj(kv_rows).unflatten(-1, (-1, d))
        v = k if self.v_proj is None else self.v_proj(kv_rows).unflatten(-1, (-1, d))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.v_norm is not None:
            v = self.v_norm(v)
        (q,) = self.rotary(batch.block_pos, q)
        (k,) = self.rotary(batch.kv_pos, k)
        out = batch.attend(self.layer_idx, q, k, v, self.geometry.scale, self.attention_backend)
        return self.o_proj(out.flatten(1))


class DraftLayer(nn.Module):
    def __init__(
        self, config: DrafterConfig, layer_idx: int, rotary: RotaryEmbedding, attn_in: int | None = None
    ):
        super().__init__()
        b, hidden = config.backbone, config.hidden_size
        self.gemma = config.family == "gemma4"
        self.self_attn = DraftAttention(config, layer_idx, rotary, attn_in)
        act = b.hidden_activation if self.gemma else b.hidden_act
        self.mlp = GatedMLP(hidden, b.intermediate_size, act)
        self.input_layernorm = _norm(config, hidden)
        self.post_attention_layernorm = _norm(config, hidden)
        if self.gemma:  # sandwich norms and a per-layer scalar (a persistent buffer in DeepSpec's files)
            self.pre_feedforward_layernorm = _norm(config, hidden)
            self.post_feedforward_layernorm = _norm(config, hidden)
            self.register_buffer("layer_scalar", torch.ones(1))
        taps = getattr(config, "conv_kernel_size", 0)
        if taps:  # DFlash2
            args = (hidden, taps, config.conv_group_size, config.block_size)
            self.attention_conv, self.mlp_conv = GroupedDynamicConv(*args), GroupedDynamicConv(*args)
        else:
            self.attention_conv = self.mlp_conv = None

    def forward(self, h: torch.Tensor, context: torch.Tensor, batch: DraftBatch) -> torch.Tensor:
        x = self.input_layernorm(h)
        if self.attention_conv is None:
            return self.residual_and_mlp(h, self.self_attn(x, context, batch))
        x, delta = self.attention_conv.prepare(x)
        h = h + self.attention_conv.finish(self.self_attn(x, context, batch), delta)
        y, delta = self.mlp_conv.prepare(self.post_attention_layernorm(h))
        return h + self.mlp_conv.finish(self.mlp(y), delta)

    def residual_and_mlp(self, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        if not self.gemma:
            h = h + attn
            return h + self.mlp(self.post_attention_layernorm(h))
        h = h + self.post_attention_layernorm(attn)
        h = h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))
        return h * self.layer_scalar


class TokenIO:
    """Token embedding and output logits of a drafter (frozen copies of the target's, Gemma's scalings), and
    a pruned draft vocabulary's map back to the target's ids."""

    embed_tokens: nn.Embedding
    lm_head: nn.Module

    def set_output_scaling(self, config: DrafterConfig) -> None:
        self.embed_scale, self.softcap = config.token_scaling()
        self.logit_scale = config.logit_scale
        self.vocab_size = config.vocab_size
        if config.draft_vocab_size is not None:
            # speculators' layout: target id = draft id + d2t[draft id]; t2d marks the target ids kept.
            self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
            self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        else:
            self.d2t = None

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(ids)  # the module, not its weight: a target's may be split over ranks
        if self.embed_scale is not None:  # Gemma: sqrt(H) rounded to the weight dtype, as HF does
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype).item()
        return x

    def compute_logits(self, h: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (fp32) of final-normed hidden states over the drafter's output vocabulary or only `rows`
        of it; Gemma: softcapped (before any Markov bias)."""
        logits = (self.lm_head(h) if rows is None else F.linear(h, self.lm_head.weight[rows])).float()
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        if self.logit_scale != 1.0:
            logits = logits * self.logit_scale
        return logits

    def target_vocab_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """[.., output vocab] -> [.., target vocab]: a pruned vocabulary's logits at their target ids, -inf
        (probability 0) at the ids the drafter cannot propose."""
        if self.d2t is None:
            return logits
        out = logits.new_full((*logits.shape[:-1], self.vocab_size), float("-inf"))
        out[..., self.d2t + torch.arange(len(self.d2t), device=self.d2t.device)] = logits
        return out


class DSparkDraftModel(TokenIO, nn.Module):
    def __init__(self, config: DSparkConfig):
        super().__init__()
        self.config = config
        hidden, vocab, out_vocab = config.hidden_size, config.vocab_size, config.output_vocab_size
        self.rotary = draft_rotary(config)
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(DraftLayer(config, i, self.rotary) for i in range(config.num_layers))
        self.norm = _norm(config, hidden)
        self.fc = nn.Linear(len(config.target_layer_ids) * hidden, hidden, bias=False)
        self.hidden_norm = _norm(config, hidden)
        self.lm_head = nn.Linear(hidden, out_vocab, bias=False)
        rank = config.markov_rank
        self.markov_head: MarkovHead | None = (
            build_markov_head(config.markov_head_type, vocab, hidden, rank, out_vocab) if rank else None
        )
        self.confidence_head = (
            ConfidenceHead(hidden, rank if config.confidence_with_markov else 0)
            if config.confidence_head
            else None
        )
        self.candidate_selector = (
            CandidateSelector(vocab, hidden, config.selector_rank, config.selector_top_k)
            if config.selector_rank
            else None
        )
        self.set_output_scaling(config)

    def project_context(self, features: torch.Tensor) -> torch.Tensor:
        """Target features [n, n_f * H] (layer outputs concatenated in target_layer_ids order) -> [n, H]."""
        return self.hidden_norm(self.fc(features))

    def backbone(self, block_embeds: torch.Tensor, context: torch.Tensor, batch: DraftBatch) -> torch.Tensor:
        """Final-normed hidden states of the block rows [m, H]."""
        h = block_embeds
        for layer in self.layers:
            h = layer(h, context, batch)
        return self.norm(h)

    def confidence_logits(self, h: torch.Tensor, prev: torch.Tensor) -> torch.Tensor | None:
        """Per-slot confidence logits from hidden states and the previous slot's token (None without head)."""
        if self.confidence_head is None:
            return None
        features = self.markov_head.prev_features(prev) if self.config.confidence_with_markov else None
        return self.confidence_head(h, features)


class DraftBatch:
    """Positions of one draft forward and how its block queries attend (paged or dense)."""

    block_pos: torch.Tensor  # [m] absolute positions of the block rows (queries)
    kv_pos: torch.Tensor  # [n + m] positions of the K/V rows: context rows, then block rows

    def attend(self, layer: int, q, k, v, scale: float, backend: AttentionBackend) -> torch.Tensor:
        """The block rows' attention output; `backend`: the paged-attention kernel of the platform."""
        raise NotImplementedError


@dataclass
class PagedDraftBatch(DraftBatch):
    """Incremental form: new context rows and block rows of many requests, K/V into the paged draft cache.

    Each request's block attends to its whole cache (old context + the new rows + its own block), with no
    causal mask: the metadata is built with `causal=False`.
    """

    block_pos: torch.Tensor
    kv_pos: torch.Tensor
    kv_slots: torch.Tensor  # [n + m] cache slot of each K/V row
    meta: ForwardMetadata  # the block queries
    caches: list[KVCache]

    def attend(self, layer, q, k, v, scale, backend):
        cache = self.caches[layer]
        cache.write(self.kv_slots, k, v)
        return backend(q, cache, self.meta, scale)


@dataclass
class DenseDraftBatch(DraftBatch):
    """Training form: full context rows of every sequence and all its blocks, with DeepSpec's block mask."""

    block_pos: torch.Tensor
    kv_pos: torch.Tensor
    mask: torch.Tensor  # [m, n + m] bool: may block row i read K/V row j

    def attend(self, layer, q, k, v, scale, backend):  # dense, with its own mask: no paged kernel
        # Rows that may read nothing (dummy blocks) read K/V row 0 so that softmax stays finite.
        mask = self.mask | (~self.mask.any(-1, keepdim=True) & (torch.arange(self.mask.shape[1]) == 0))
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            attn_mask=mask[None, None],
            scale=scale,
            enable_gqa=True,
        )
        return out[0].transpose(0, 1)


def dense_block_batch(context_lens: list[int], anchors: list[list[int]], block_size: int) -> DenseDraftBatch:
    """Training-form positions and mask for sequences with `context_lens[s]` context rows (all laid out
    first, sequence after sequence) and blocks at `anchors[s]` (then laid out in the same order).

    A block of anchor a sees context rows at positions < a of its own sequence (never the anchor's own row,
    which the target has not computed when the drafter runs) and every slot of its own block.
    """
    ctx_seq = torch.repeat_interleave(torch.arange(len(context_lens)), torch.tensor(context_lens))
    ctx_pos = torch.cat([torch.arange(n) for n in context_lens])
    anchor = torch.tensor([a for seq in anchors for a in seq], dtype=torch.long)
    block_seq = torch.repeat_interleave(torch.arange(len(anchors)), torch.tensor([len(a) for a in anchors]))
    row_anchor = anchor.repeat_interleave(block_size)
    row_seq = block_seq.repeat_interleave(block_size)
    row_block = torch.arange(len(anchor)).repeat_interleave(block_size)
    block_pos = row_anchor + torch.arange(block_size).repeat(len(anchor))
    sees_context = (row_seq[:, None] == ctx_seq[None, :]) & (ctx_pos[None, :] < row_anchor[:, None])
    sees_block = row_block[:, None] == row_block[None, :]
    return DenseDraftBatch(
        block_pos=block_pos,
        kv_pos=torch.cat([ctx_pos, block_pos]),
        mask=torch.cat([sees_context, sees_block], dim=1),
    )
