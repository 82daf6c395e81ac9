"""Gemma 4 assistant models (`google/gemma-4-*-it-assistant`, model_type `gemma4_assistant`): a small Gemma 4
decoder that drafts for a Gemma 4 target by reading the target's own KV cache.

transformers' `modeling_gemma4_assistant.py` defines the math (tests pin it): a draft step takes
[the target's scaled embedding of the newest token; a backbone-width hidden state] through `pre_projection`,
then Gemma 4 decoder layers whose attention has only Q (each layer reads the K/V the target's last layer of
its own type wrote: sliding or full), the final norm, and the LM head tied to the assistant's embedding;
`post_projection` of the normed output is the hidden state of the next step. E2B/E4B assistants narrow the
vocabulary with centroids (`use_ordered_embeddings`): only the tokens of the top `centroid_intermediate_top_k`
centroids get logits, the rest none (probability 0).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

import torch
from torch import nn

from specserve.layers.attention import KVCache
from specserve.layers.metadata import ForwardMetadata
from specserve.layers.norm import RMSNorm
from specserve.models.gemma import GemmaDecoderLayer, plan_layers

# Where an assistant layer finds its K/V in the caches handed to `step`: [sliding source, full source]
# (negative indices: no layer of the assistant owns a cache, so none may take these for its own).
KV_SOURCE = {"sliding_attention": -2, "full_attention": -1}


class CentroidVocabulary(nn.Module):
    """Logits only for the tokens of the top-k centroids of each row (`token_ordering` lists the vocabulary
    centroid by centroid)."""

    def __init__(self, hidden_size: int, vocab_size: int, num_centroids: int, top_k: int):
        super().__init__()
        if vocab_size % num_centroids:
            raise ValueError(f"num_centroids {num_centroids} does not divide vocab_size {vocab_size}")
        self.top_k, self.num_centroids = top_k, num_centroids
        self.centroids = nn.Linear(hidden_size, num_centroids, bias=False)
        self.register_buffer("token_ordering", torch.zeros(vocab_size, dtype=torch.long))

    def forward(self, h: torch.Tensor, lm_head_weight: torch.Tensor) -> torch.Tensor:
        chosen = self.centroids(h).topk(self.top_k, dim=-1).indices  # [R, top_k]
        tokens = self.token_ordering.view(self.num_centroids, -1)[chosen].flatten(1)  # [R, top_k * per]
        logits = torch.einsum("rd,rtd->rt", h, lm_head_weight[tokens]).float()
        out = logits.new_full((h.shape[0], lm_head_weight.shape[0]), float("-inf"))
        return out.scatter_(-1, tokens, logits)


class Gemma4Assistant(nn.Module):
    def __init__(self, config):
        """`config`: a transformers Gemma4AssistantConfig (its text_config a Gemma 4 text config)."""
        super().__init__()
        text = config.text_config
        self.text_config = text
        hidden, self.backbone_hidden_size = text.hidden_size, config.backbone_hidden_size
        geometry = type(text).from_dict({**text.to_dict(), "num_kv_shared_layers": 0})
        plans = plan_layers(geometry, gemma4=True)
        plans = [dataclasses.replace(p, kv_source=KV_SOURCE[p.layer_type]) for p in plans]
        self.plans = plans
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(text.vocab_size, hidden)
        self.model.layers = nn.ModuleList(
            GemmaDecoderLayer(text, plan, i, gemma4=True) for i, plan in enumerate(plans)
        )
        self.model.norm = RMSNorm(hidden, eps=text.rms_norm_eps, offset=0.0, scale_in_fp32=True)
        self.pre_projection = nn.Linear(2 * self.backbone_hidden_size, hidden, bias=False)
        self.post_projection = nn.Linear(hidden, self.backbone_hidden_size, bias=False)
        self.tied = bool(getattr(config, "tie_word_embeddings", True))
        self.lm_head = None if self.tied else nn.Linear(hidden, text.vocab_size, bias=False)
        self.masked_embedding = (
            CentroidVocabulary(
                hidden, text.vocab_size, config.num_centroids, config.centroid_intermediate_top_k
            )
            if config.use_ordered_embeddings
            else None
        )

    @property
    def head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.tied else self.lm_head.weight

    def step(
        self,
        inputs: torch.Tensor,
        positions: torch.Tensor,
        attn: ForwardMetadata,
        kv_caches: Sequence[KVCache | None],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft step for R rows: inputs [R, 2 * backbone] -> (normed hidden [R, H] for the logits,
        the next step's backbone-width hidden [R, backbone]). `kv_caches`: [sliding source, full source]."""
        h = self.pre_projection(inputs)
        for layer in self.model.layers:
            h = layer(h, positions, attn, kv_caches, None)
        normed = self.model.norm(h)
        return normed, self.post_projection(normed)

    def compute_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """fp32 logits over the vocabulary (-inf off a centroid-narrowed one), without a softcap (as
        transformers' assistant)."""
        if self.masked_embedding is not None:
            return self.masked_embedding(normed, self.head_weight)
        return torch.nn.functional.linear(normed, self.head_weight).float()

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]], source: str) -> None:
        """HF's names; every parameter and buffer filled exactly once (a tied lm_head may be absent)."""
        from specserve.config import SpecserveError

        slots = self.state_dict()
        seen = set()
        for name, tensor in tensors:
            if name == "lm_head.weight" and self.tied:
                continue
            if name not in slots:
                raise SpecserveError(f"{source}: unexpected tensor {name!r} (not in a Gemma 4 assistant)")
            expected = tuple(slots[name].shape)
            if tuple(tensor.shape) != expected:
                shape = tuple(tensor.shape)
                raise SpecserveError(f"{source}: tensor {name!r} has shape {shape}, expected {expected}")
            with torch.no_grad():
                slots[name].copy_(tensor)
            seen.add(name)
        missing = sorted(set(slots) - seen)
        if missing:
            raise SpecserveError(f"{source}: checkpoint is missing tensors: {', '.join(missing[:8])}")
