"""Method `mtp` with `model`: a Gemma 4 assistant (`gemma4_assistant`) drafts for its Gemma 4 target, reading
the target's own KV cache (models/gemma4_assistant.py has the network), as transformers' assisted decoding
and vLLM's `mtp` method run it.

Per round and request, with anchor a (the newest token, not in the target's cache yet): the first step takes
the anchor's embedding and the target's final hidden state at a-1 (the row that predicted the anchor);
each further step the token just drafted and the assistant's own projected hidden state. Every step's query
sits at position a and attends to the target's K/V of positions < a (the last sliding_window + 1 of them in
sliding layers, as transformers' assistant mask has it), so the assistant keeps no cache of its own and
nothing is rolled back: a round only needs the target's newest hidden state, which `observe` keeps.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from specserve.config import SpecserveError, SpeculativeConfig
from specserve.core.cache_coordinator import DrafterCaches, DrafterCacheSpec
from specserve.core.cache_groups import PagedGroup
from specserve.core.proposal import DraftProposal
from specserve.core.sequence import Sequence
from specserve.layers.meta_device import on_meta
from specserve.layers.metadata import ForwardMetadata
from specserve.models.gemma import GemmaForCausalLM
from specserve.models.gemma4_assistant import KV_SOURCE, Gemma4Assistant
from specserve.models.loader import resolve_model
from specserve.models.prepare import place
from specserve.models.weight_files import iter_checkpoint_tensors
from specserve.spec_decode.context import TargetContext
from specserve.spec_decode.drafters.base import Drafter, sample_drafts

ASSISTANT_TYPES = ("gemma4_assistant",)


@dataclass
class NewestFeature:
    """A request's newest target feature: its position, and the feature there."""

    position: int = -1
    feature: torch.Tensor | None = None


class Gemma4AssistantDrafter(Drafter):
    def __init__(self, model: Gemma4Assistant, target: TargetContext, sources: list, num_tokens: int):
        self.model = model
        self.target = target.model
        self.sources = sources  # the target layers whose caches it reads: [its sliding one, its full one]
        self.capture_layers = (target.model_config.num_hidden_layers - 1,)
        self.feature_width = target.model_config.hidden_size
        self.default_num_tokens = num_tokens
        self.block_size = target.block_size
        self.vocab_size = target.vocab_size
        self.generator = target.generator
        self.embed_scale = target.model_config.hidden_size**0.5

    @classmethod
    def from_config(cls, spec: SpeculativeConfig, target: TargetContext) -> Gemma4AssistantDrafter:
        directory = resolve_model(spec.model)
        source = str(directory / "config.json")
        config = _assistant_config(json.loads((directory / "config.json").read_text()), target, source)
        if not isinstance(target.model, GemmaForCausalLM) or target.model_config.model_type != "gemma4_text":
            raise SpecserveError(f"{source}: a Gemma 4 assistant drafts for a Gemma 4 target only")
        if target.tensor_parallel_size > 1:
            raise SpecserveError(
                "a Gemma 4 assistant reads the target's KV cache, which tensor parallelism splits over "
                "ranks: use tensor_parallel_size 1"
            )
        with on_meta():
            model = Gemma4Assistant(config)
        model = model.to_empty(device="cpu").to(target.torch_dtype).eval()
        model.load_weights(iter_checkpoint_tensors(directory), str(directory))
        place(model, target.platform)  # beside the target: its caches are read in place
        sources = _target_sources(model, target, source)
        return cls(model, target, sources, spec.num_speculative_tokens or 1)

    def cache_spec(self, block_size: int) -> DrafterCacheSpec:
        return DrafterCacheSpec(record_type=NewestFeature)  # no cache of its own: it reads the target's

    def bind_caches(self, caches: DrafterCaches) -> None:
        self.newest = caches.records

    def bind_target(self, kv: PagedGroup, layers: list) -> None:
        self.target_kv = kv
        self.kv_caches = [layers[i] if i is not None else None for i in self.sources]

    # ---- the target's newest hidden state ---------------------------------------------------------------
    def observe(self, seq: Sequence, start: int, features: torch.Tensor) -> None:
        if features.shape[0]:
            newest = self.newest.open(seq.request_id)
            newest.position, newest.feature = start + features.shape[0] - 1, features[-1]

    # ---- drafting ---------------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], num_tokens: int, keep_drafting=None) -> list[DraftProposal]:
        proposals = [DraftProposal([]) for _ in seqs]
        # Ready: the target's hidden state before the anchor is here and its cache holds the rows before it
        # (not so for the cost profiler's requests, which own no blocks of the target's cache).
        ready = [
            i
            for i, s in enumerate(seqs)
            if (newest := self.newest.entry(s.request_id)) is not None
            and newest.position == s.num_tokens - 2
            and (table := self.target_kv.entry(s.request_id)) is not None
            and len(table.block_table) * self.block_size >= s.num_tokens - 1
        ]
        if not ready or num_tokens < 1:
            return proposals
        rows = [seqs[i] for i in ready]
        anchors = torch.tensor([s.num_tokens - 1 for s in rows])
        # Keys are the target's rows < a; in sliding layers transformers' assistant mask keeps the last
        # sliding_window + 1 of them, which a non-causal query at position a - 2 sees.
        attn = ForwardMetadata.build(
            query_start=list(range(len(rows) + 1)),
            context_lens=anchors.tolist(),
            block_tables=[self.target_kv.entry(s.request_id).block_table for s in rows],
            positions=(anchors - 2).clamp(min=0),
            block_size=self.block_size,
            causal=False,
        )
        hidden = self.target.model.norm(torch.stack([self.newest.entry(s.request_id).feature for s in rows]))
        hidden = hidden.to(self.model.pre_projection.weight.dtype)
        attn, (anchors, tokens) = attn.to(
            hidden.device, anchors, torch.tensor([s.all_token_ids[-1] for s in rows])
        )
        drafted: list[list[int]] = [[] for _ in rows]
        q_rows, peak_rows = [], []
        for _ in range(num_tokens):
            embeds = self.target.input_embedding()(tokens)
            embeds = embeds * torch.tensor(self.embed_scale, dtype=embeds.dtype).item()
            normed, hidden = self.model.step(torch.cat([embeds, hidden], -1), anchors, attn, self.kv_caches)
            q, new, peaks = sample_drafts(
                self.model.compute_logits(normed), rows, drafted, self.vocab_size, self.generator
            )
            q_rows.append(q)
            peak_rows.append(peaks)
            for d, token in zip(drafted, new):
                d.append(token)
            tokens = torch.tensor(new, device=hidden.device)
        probs, confidences = torch.stack(q_rows, 1), torch.stack(peak_rows, 1)
        for r, i in enumerate(ready):
            proposals[i] = DraftProposal(drafted[r], probs[r], confidences[r])
        return proposals


def _assistant_config(raw: dict, target: TargetContext, source: str):
    """transformers' Gemma4AssistantConfig of a config.json, checked against the target."""
    import transformers

    model_type = raw.get("model_type")
    if model_type not in ASSISTANT_TYPES:
        raise SpecserveError(
            f"{source}: model_type {model_type!r}: method 'mtp' with a model takes a Gemma 4 assistant "
            f"({', '.join(ASSISTANT_TYPES)})"
        )
    config = transformers.Gemma4AssistantConfig.from_dict(raw)
    text = config.text_config
    checks = (
        ("backbone_hidden_size", config.backbone_hidden_size, target.model_config.hidden_size),
        ("text_config.vocab_size", text.vocab_size, target.vocab_size),
    )
    for key, mine, theirs in checks:
        if mine != theirs:
            raise SpecserveError(f"{source}: {key} is {mine}, the target's is {theirs}")
    for key in ("hidden_size_per_layer_input", "vocab_size_per_layer_input"):
        if getattr(text, key, 0):
            raise SpecserveError(f"{source}: text_config.{key} must be 0 in an assistant")
    if getattr(text, "enable_moe_block", False):
        raise SpecserveError(f"{source}: text_config.enable_moe_block must be false in an assistant")
    return config


def _target_sources(model: Gemma4Assistant, target: TargetContext, source: str) -> list[int | None]:
    """The target layers whose caches the assistant's layers read: its last cache-owning layer of each type,
    checked to have the geometry the assistant's queries expect."""
    plans = target.model.plans
    sources = []
    for layer_type in sorted(KV_SOURCE, key=KV_SOURCE.get):  # sliding (-2), then full (-1)
        owners = [i for i, p in enumerate(plans) if p.layer_type == layer_type and p.kv_source == i]
        sources.append(owners[-1] if owners else None)
        for plan in (p for p in model.plans if p.layer_type == layer_type):
            if not owners:
                raise SpecserveError(f"{source}: the target has no {layer_type} layer for its {layer_type}")
            theirs = plans[owners[-1]]
            if (plan.head_dim, plan.num_kv_heads) != (theirs.head_dim, theirs.num_kv_heads):
                raise SpecserveError(
                    f"{source}: text_config's {layer_type} layers expect {plan.num_kv_heads} KV heads of "
                    f"{plan.head_dim}, the target's have {theirs.num_kv_heads} of {theirs.head_dim}"
                )
    return sources
