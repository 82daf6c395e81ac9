"""DSpark (and DFlash) drafting inside the engine: one batched backbone pass for every decoding request,
then the sequential head left to right, vectorised across requests.

Per request the drafter keeps a paged draft cache holding K/V of the projected target context for every
position before the current anchor, plus the target features it has been handed but not projected yet.
A round (DSPARK.md §4.3):
1. project the pending context rows and write their K/V (positions cached..a-1), write the block's K/V
   (positions a..a+B-1) and attend, without a causal mask, over the whole cache;
2. roll the cache back to `a` (a length change: the block rows are overwritten next round);
3. sample slot by slot: z_i = U_i + MarkovBias(prev_i), q_i = the request's sampling transforms of z_i,
   d_{i+1} ~ q_i, prev_{i+1} = d_{i+1}; confidence c_i from [h_i; W1[prev_i]].
The engine then verifies and hands back (`observe`) the target features of the anchor and the accepted
drafts only, which become the next round's pending context.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from specserve.config import SpecserveError, SpeculativeConfig
from specserve.engine.kv_cache import BlockManager
from specserve.engine.sequence import Sequence
from specserve.layers.attention import AttentionMetadata, KVCache, padded_block_tables, slot_mapping
from specserve.layers.linear import pack_linears
from specserve.spec.drafters.base import Drafter, DraftProposal, sample_drafts
from specserve.spec.dspark.checkpoint import load_draft_checkpoint
from specserve.spec.dspark.model import DSparkDraftModel, PagedDraftBatch, attention_geometry

logger = logging.getLogger(__name__)


@dataclass
class ContextState:
    """One request's draft context: rows [0, num_cached) are in the draft cache, then `pending` rows."""

    block_table: list[int] = field(default_factory=list)
    num_cached: int = 0
    pending: list[torch.Tensor] = field(default_factory=list)
    num_pending: int = 0

    @property
    def num_rows(self) -> int:
        return self.num_cached + self.num_pending


class DSparkDrafter(Drafter):
    def __init__(self, model: DSparkDraftModel, target):
        config = model.config
        self.model = model
        self.block_size = config.block_size
        self.capture_layers = tuple(config.target_layer_ids)
        self.default_num_tokens = config.block_size
        self.mask_token_id = config.mask_token_id
        self.vocab_size = target.vocab_size
        self.generator = target.generator  # unseeded requests draw from the engine's generator
        cache_block = target.config.block_size
        # Room for every context row the target can hold, plus one block's slots per running request.
        per_request = -(-self.block_size // cache_block) + 1
        num_blocks = target.block_manager.num_blocks + target.config.max_num_seqs * per_request
        self.blocks = BlockManager(num_blocks, cache_block)
        geo = attention_geometry(config)
        shape = (num_blocks, cache_block, geo.num_kv_heads, geo.head_dim)
        dtype = target.config.torch_dtype
        self.caches = [
            KVCache(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
            for _ in range(config.num_layers)
        ]
        self.states: dict[str, ContextState] = {}

    @classmethod
    def from_config(cls, spec: SpeculativeConfig, target) -> DSparkDrafter:
        model = load_draft_checkpoint(
            spec.model, target.model, target.model_config, dtype=target.config.torch_dtype
        )
        config = model.config
        if spec.method == "dflash" and (config.markov_rank or config.confidence_head):
            raise SpecserveError(
                f"{spec.model}: method 'dflash' expects a checkpoint without sequential heads, this one has "
                f"markov_rank={config.markov_rank}, enable_confidence_head={config.confidence_head}; "
                "use method 'dspark'"
            )
        k = spec.num_speculative_tokens
        if k is not None and k > config.block_size:
            raise SpecserveError(
                f"num_speculative_tokens={k} exceeds the drafter's block_size={config.block_size} "
                "(a block of B slots drafts at most B tokens)"
            )
        pack_linears(model)
        return cls(model, target)

    # ---- context bookkeeping ------------------------------------------------------------------------
    def observe(self, seq: Sequence, start: int, features: torch.Tensor) -> None:
        state = self.states.get(seq.request_id)
        if state is None or start != state.num_rows:
            # Rows arrive in position order from 0; anything else means a restart (after preemption the
            # sequence is recomputed from position 0) or a state we cannot trust: begin again.
            self.release(seq)
            if start != 0:
                logger.warning(
                    "request %s: target features from position %d, expected 0", seq.request_id, start
                )
                return
            state = self.states[seq.request_id] = ContextState()
        state.pending.append(features)
        state.num_pending += features.shape[0]

    def release(self, seq: Sequence) -> None:
        state = self.states.pop(seq.request_id, None)
        if state is not None:
            self.blocks.shrink(state, 0)

    # ---- drafting -----------------------------------------------------------------------------------
    def propose(self, seqs: list[Sequence], num_tokens: int) -> list[DraftProposal]:
        num_tokens = min(num_tokens, self.block_size)
        # A request can draft once the target has handed over every position before its anchor.
        ready = [
            i
            for i, s in enumerate(seqs)
            if (state := self.states.get(s.request_id)) is not None and state.num_rows == s.num_tokens - 1
        ]
        proposals = [DraftProposal([]) for _ in seqs]
        if not ready or num_tokens < 1:
            return proposals
        ready_seqs = [seqs[i] for i in ready]
        h = self._backbone(ready_seqs)[:, :num_tokens]
        anchors = torch.tensor([s.all_token_ids[-1] for s in ready_seqs])
        for i, proposal in zip(ready, self._sample(h, anchors, ready_seqs)):
            proposals[i] = proposal
        return proposals

    @torch.inference_mode()
    def _backbone(self, seqs: list[Sequence]) -> torch.Tensor:
        """One draft forward over all requests' new context rows and blocks -> hidden states [R, B, H]."""
        B = self.block_size
        states = [self.states[s.request_id] for s in seqs]
        anchors_pos = [s.num_tokens - 1 for s in seqs]
        for state, a in zip(states, anchors_pos):
            self.blocks.grow(state, a + B)
        ctx_pos = torch.cat([torch.arange(st.num_cached, a) for st, a in zip(states, anchors_pos)])
        ctx_owner = torch.repeat_interleave(
            torch.arange(len(seqs)), torch.tensor([st.num_pending for st in states])
        )
        block_pos = (torch.tensor(anchors_pos)[:, None] + torch.arange(B)).reshape(-1)
        block_owner = torch.arange(len(seqs)).repeat_interleave(B)
        tables = padded_block_tables([st.block_table for st in states])
        cache_block = self.blocks.block_size
        batch = PagedDraftBatch(
            block_pos=block_pos,
            kv_pos=torch.cat([ctx_pos, block_pos]),
            kv_slots=slot_mapping(
                tables, torch.cat([ctx_owner, block_owner]), torch.cat([ctx_pos, block_pos]), cache_block
            ),
            meta=AttentionMetadata.build(
                query_start=list(range(0, len(seqs) * B + 1, B)),
                context_lens=[a + B for a in anchors_pos],
                block_tables=[st.block_table for st in states],
                positions=block_pos,
                block_size=cache_block,
                causal=False,
            ),
            caches=self.caches,
        )
        features = [f for st in states for f in st.pending]
        hidden = self.model.config.hidden_size
        context = (
            self.model.project_context(torch.cat(features))
            if features
            else self.caches[0].k.new_zeros(0, hidden)
        )
        block_ids = torch.full((len(seqs), B), self.mask_token_id)
        block_ids[:, 0] = torch.tensor([s.all_token_ids[-1] for s in seqs])
        h = self.model.backbone(
            self.model.embed(block_ids.reshape(-1)), context.to(self.caches[0].k.dtype), batch
        )
        for state, a in zip(states, anchors_pos):
            # Keep the context rows (< a); the block rows are rolled back by length.
            state.num_cached, state.pending, state.num_pending = a, [], 0
            self.blocks.shrink(state, a)
        return h.view(len(seqs), B, -1)

    @torch.inference_mode()
    def _sample(self, h: torch.Tensor, anchors: torch.Tensor, seqs: list[Sequence]) -> list[DraftProposal]:
        """Left-to-right sampling through the sequential head; keeps every exact q row and confidence."""
        num_seqs, k, _ = h.shape
        base = self.model.compute_logits(h.reshape(num_seqs * k, -1)).view(num_seqs, k, -1)
        head = self.model.markov_head
        state = head.initial_state(num_seqs, h) if head is not None else None
        prev = anchors
        drafted: list[list[int]] = [[] for _ in seqs]
        q_rows, confidence_logits = [], []
        for i in range(k):
            logits = base[:, i]
            if head is not None:
                bias, state = head.step(prev, h[:, i], state)
                logits = logits + bias.float()  # after Gemma's softcap, never re-capped
            conf = self.model.confidence_logits(h[:, i], prev)
            if conf is not None:
                confidence_logits.append(conf)
            q, tokens = sample_drafts(logits, seqs, drafted, self.vocab_size, self.generator)
            q_rows.append(q)
            for r, token in enumerate(tokens):
                drafted[r].append(token)
            prev = torch.tensor(tokens)
        probs = torch.stack(q_rows, dim=1)  # [R, k, V]
        confidences = torch.sigmoid(torch.stack(confidence_logits, dim=1)) if confidence_logits else None
        return [
            DraftProposal(drafted[r], probs[r], None if confidences is None else confidences[r])
            for r in range(num_seqs)
        ]
