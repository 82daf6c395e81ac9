"""Shared machinery of drafters conditioned on the target's hidden states (DSpark, DFlash, EAGLE-3, MTP):
per-request context rows handed over by the engine, and a paged draft KV cache rolled back by length."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from specserve.config import SpecserveError, SpeculativeConfig
from specserve.core.cache_coordinator import DrafterCaches, DrafterCacheSpec
from specserve.core.cache_groups import PagedEntry, PagedGroup, PagedSpec
from specserve.core.sequence import Sequence
from specserve.layers.attention import KVCache
from specserve.layers.metadata import ForwardMetadata, padded_block_tables, slot_mapping
from specserve.models.prepare import prepare_model
from specserve.spec_decode.context import TargetContext
from specserve.spec_decode.deepspec.checkpoint import load_draft_checkpoint
from specserve.spec_decode.deepspec.dspark import PagedDraftBatch, attention_geometry
from specserve.spec_decode.drafters.base import Drafter

logger = logging.getLogger(__name__)


@dataclass
class ContextState(PagedEntry):
    """One request's draft context: rows [0, num_cached) are in the draft cache, then `pending` rows."""

    pending: list[torch.Tensor] = field(default_factory=list)
    num_pending: int = 0

    @property
    def num_rows(self) -> int:
        return self.num_cached + self.num_pending

    def take_pending(self) -> list[torch.Tensor]:
        rows, self.pending, self.num_pending = self.pending, [], 0
        return rows


def concat_rows(rows: list[torch.Tensor], width: int, dtype: torch.dtype) -> torch.Tensor:
    """[sum of rows, width]; empty when a request was proposed for again without new rows (it had not
    been scheduled since its last proposal)."""
    return torch.cat(rows).to(dtype) if rows else torch.zeros(0, width, dtype=dtype)


@dataclass(frozen=True)
class DrafterLayout:
    """What a hidden-state drafter reads and keeps: the target layers it reads (their outputs are
    concatenated: `feature_width` wide) and its paged cache, `num_layers` x [.., num_kv_heads, head_dim]."""

    capture_layers: tuple[int, ...]
    feature_width: int
    num_layers: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def of_checkpoint(cls, model) -> DrafterLayout:
        """A DeepSpec-format drafter's (its config says)."""
        config, geo = model.config, attention_geometry(model.config)
        return cls(
            tuple(config.target_layer_ids),
            model.fc.in_features,
            config.num_layers,
            geo.num_kv_heads,
            geo.head_dim,
        )


class HiddenStateDrafter(Drafter):
    """`observe` collects the target features of each position in order; a subclass's `propose` turns
    the pending rows into draft cache entries and drafts from them.

    Its context cache is a paged group of the engine's cache coordinator. With prefix caching the full
    blocks of context rows join that group's prefix cache, keyed by the tokens they were computed from
    (`context_lookahead` tokens past the block too, when a row reads the next token); its content comes
    from the target's forward, so a target prefix hit goes only as far as this cache holds it too."""

    context_lookahead = 0

    def __init__(self, model, target: TargetContext, layout: DrafterLayout, extra_tokens_per_request: int):
        self.model = model
        self.layout = layout
        self.capture_layers = layout.capture_layers
        self.feature_width = layout.feature_width
        self.vocab_size = target.vocab_size
        self.dtype = target.torch_dtype
        self.generator = target.generator  # unseeded requests draw from the engine's generator
        self.extra_tokens_per_request = extra_tokens_per_request  # drafted rows beyond the context

    def cache_spec(self, block_size: int) -> DrafterCacheSpec:
        layout = self.layout
        elem = torch.empty((), dtype=self.dtype).element_size()
        per_block = layout.num_layers * 2 * block_size * layout.num_kv_heads * layout.head_dim * elem
        context = PagedSpec(
            per_block,
            self.extra_tokens_per_request,
            self.context_lookahead,
            limits_prefix_hits=True,
            entry_type=ContextState,
        )
        return DrafterCacheSpec(paged=(context,))

    def bind_caches(self, caches: DrafterCaches) -> None:
        (group,) = caches.paged
        self.group: PagedGroup[ContextState] = group
        self.blocks = group.blocks
        self.states = group.entries  # request id -> its context (the coordinator frees it with the request)
        shape = (group.blocks.num_blocks, group.block_size, self.layout.num_kv_heads, self.layout.head_dim)
        self.caches = [
            KVCache(torch.zeros(shape, dtype=self.dtype), torch.zeros(shape, dtype=self.dtype))
            for _ in range(self.layout.num_layers)
        ]

    @staticmethod
    def load(spec: SpeculativeConfig, target: TargetContext, config_type: type):
        """The checkpoint's drafter, checked to be a `config_type` drafter, quantized if the config says so
        (its own layers only: modules it shares with the target are replaced, not changed) and packed for
        CPU inference."""
        model = load_draft_checkpoint(spec.model, target.model, target.model_config, dtype=target.torch_dtype)
        if not isinstance(model.config, config_type):
            raise SpecserveError(
                f"{spec.model}: a {model.config.architecture} drafter cannot run method {spec.method!r}"
            )
        return prepare_model(model, spec.quantization)

    # ---- context bookkeeping ------------------------------------------------------------------------
    def observe(self, seq: Sequence, start: int, features: torch.Tensor) -> None:
        state = self.states.get(seq.request_id)
        if state is None or start != state.num_rows:
            # Rows arrive in position order from 0; anything else means a restart (after preemption the
            # sequence is recomputed from position 0) or a state we cannot trust: begin again.
            self.group.free(seq.request_id)
            if start != 0:
                logger.warning(
                    "request %s: target features from position %d, expected 0", seq.request_id, start
                )
                return
            state = self.group.open(seq.request_id)
        state.pending.append(features)
        state.num_pending += features.shape[0]

    def ready(self, seqs: list[Sequence]) -> list[int]:
        """Indices of the sequences whose every position before the anchor has been handed over."""
        return [
            i
            for i, s in enumerate(seqs)
            if (state := self.states.get(s.request_id)) is not None and state.num_rows == s.num_tokens - 1
        ]

    def paged_batch(
        self,
        states: list[ContextState],
        kv_owner: torch.Tensor,
        kv_pos: torch.Tensor,
        query_lens: list[int],
        query_pos: torch.Tensor,
        causal: bool,
    ) -> PagedDraftBatch:
        """Rows to write (owner request, position) and queries (per request, consecutive) of one forward;
        every request's blocks must already cover its last position."""
        tables = padded_block_tables([st.block_table for st in states])
        owners = torch.repeat_interleave(torch.arange(len(states)), torch.tensor(query_lens))
        last = torch.full((len(states),), -1, dtype=torch.long)
        last = last.scatter_reduce(0, kv_owner, kv_pos, reduce="amax").scatter_reduce(
            0, owners, query_pos, reduce="amax"
        )
        return PagedDraftBatch(
            block_pos=query_pos,
            kv_pos=kv_pos,
            kv_slots=slot_mapping(tables, kv_owner, kv_pos, self.blocks.block_size),
            meta=ForwardMetadata.build(
                query_start=[0, *torch.tensor(query_lens).cumsum(0).tolist()],
                context_lens=(last + 1).tolist(),
                block_tables=[st.block_table for st in states],
                positions=query_pos,
                block_size=self.blocks.block_size,
                causal=causal,
            ),
            caches=self.caches,
        )

    def roll_back(self, seqs: list[Sequence], states: list[ContextState], lengths: list[int]) -> None:
        """Keep the first `lengths[i]` rows of each request's draft cache (a length change): its context
        rows, which are final (full blocks of them join the prefix cache)."""
        for seq, state, n in zip(seqs, states, lengths):
            self.group.roll_back(state, n, lambda seq=seq: seq.all_token_ids)
