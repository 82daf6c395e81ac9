"""Turns scheduled pieces into one flat batch, runs the model once, returns the logits needed.

The runner owns the model's cache tensors: a paged KV cache per attention layer and, for hybrid models, a
pool of recurrent-state slots per linear-attention layer (one per running sequence, then the prefix
cache's checkpoints). Which blocks and slots a piece uses is the cache coordinator's business
(core/cache_coordinator.py); the runner executes the state operations a step carries: the copies that
start a prefix hit from a kept state, before the forward; after sampling (`commit_states`), verified
pieces' recurrent states rolled back to their accepted prefix from the forward's checkpoint, then the
copies that keep states for the prefix cache. KV is rolled back by length alone.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from specserve.core.batch import row_offsets
from specserve.core.cache_coordinator import CacheLayout, DrafterCacheSpec
from specserve.core.cache_groups import StateCopy
from specserve.layers.attention import KVCache
from specserve.layers.gated_deltanet import RecurrentState, RecurrentStateSpec
from specserve.layers.metadata import ForwardMetadata, StateCheckpoints
from specserve.layers.sampler import SampleOutput, raw_logprobs
from specserve.layers.transfer import to_device
from specserve.models.base import CausalLM, LayerCacheSpec
from specserve.worker.cuda_graphs import GraphConfig, GraphRunner

# Rows the LM head scores at once for prompt logprobs: a long prompt chunk never holds rows x vocab logits.
SCORE_ROWS_PER_CALL = 256


@dataclass
class PieceInput:
    """Tokens of one sequence at consecutive positions from `start`, with its cache block table."""

    token_ids: list[int]
    start: int
    block_table: list[int]
    state_slot: int | None = None  # the sequence's recurrent-state slot (hybrid models)
    checkpoint: bool = False  # keep what rolling back this piece's recurrent state needs (verification)
    prompt: bool = False  # prompt tokens only: computed alike with and without speculation


@dataclass
class PromptScoring:
    """Rows of the flat batch whose next prompt token is scored (prompt logprobs), with those tokens and how
    many top alternatives to give."""

    rows: list[int]
    token_ids: list[int]
    num_top: int


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [rows requested, V] fp32
    hidden: torch.Tensor  # [N, H] final-normed hidden states of every row
    captured: dict[int, torch.Tensor]  # residual-stream outputs of the requested layers, [N, H] each
    prompt_scores: SampleOutput | None = None  # of the rows `PromptScoring` asked for


def kv_bytes_per_block(model: CausalLM, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return sum(
        2 * block_size * s.num_kv_heads * s.head_dim * elem
        for s in model.cache_specs()
        if isinstance(s, LayerCacheSpec) and s.shared_with is None
    )


def state_bytes_per_slot(model: CausalLM, dtype: torch.dtype) -> int:
    """One sequence's recurrent state over every linear-attention layer (0 for attention-only models)."""
    return sum(s.bytes_per_slot(dtype) for s in model.cache_specs() if isinstance(s, RecurrentStateSpec))


def cache_layout(
    model: CausalLM, block_size: int, dtype: torch.dtype, drafter: DrafterCacheSpec | None = None
) -> CacheLayout:
    """What the cache budget pays for: the target's KV bytes per block and recurrent-state bytes per slot,
    and the drafter's caches."""
    kv, states = kv_bytes_per_block(model, block_size, dtype), state_bytes_per_slot(model, dtype)
    return CacheLayout(kv, states, drafter or DrafterCacheSpec())


class ModelRunner:
    """Runs `model` where its weights live (`device`): its caches are allocated there, each step's inputs
    built on the host and sent in one copy (`ForwardMetadata.to`). With `graphs`, steps of short pieces run
    padded to a bucket through static buffers (worker/cuda_graphs.py), their padding rows writing to one
    more block than `num_blocks`, which no sequence owns."""

    def __init__(
        self,
        model: CausalLM,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        num_state_slots: int = 0,
        graphs: GraphConfig | None = None,
    ):
        self.model = model
        self.block_size = block_size
        self.device = next(model.parameters()).device
        self.kv_caches: list[KVCache | RecurrentState] = []
        for spec in model.cache_specs():
            if isinstance(spec, RecurrentStateSpec):
                self.kv_caches.append(spec.allocate(num_state_slots, dtype, self.device))
                continue
            if spec.shared_with is not None:
                self.kv_caches.append(self.kv_caches[spec.shared_with])
                continue
            shape = (num_blocks + (graphs is not None), block_size, spec.num_kv_heads, spec.head_dim)
            k, v = (torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(2))
            self.kv_caches.append(KVCache(k, v))
        self._checkpoints: StateCheckpoints | None = None  # the last forward's (hybrid models)
        self.graphs = graphs and GraphRunner(model, self.kv_caches, block_size, num_blocks, graphs)

    @torch.inference_mode()
    def forward(
        self,
        pieces: Seq[PieceInput],
        logit_rows: Seq[int],
        capture_layers: Seq[int] = (),
        restores: Seq[StateCopy] = (),
        scoring: PromptScoring | None = None,
    ) -> ForwardOutput:
        """One target forward over all pieces; logits only for `logit_rows` (indices into the flat batch).
        `restores`: state copies to make first (prefix hits starting from a kept state); `scoring`: prompt
        rows to score from the forward's hidden states."""
        if self.graphs is not None and not restores and scoring is None:
            token_ids, tables = [p.token_ids for p in pieces], [p.block_table for p in pieces]
            bucket = self.graphs.bucket_for(token_ids, tables)
            if bucket is not None:
                starts = [p.start for p in pieces]
                logits, hidden, captured = self.graphs.run(
                    bucket, token_ids, starts, tables, logit_rows, tuple(capture_layers)
                )
                return ForwardOutput(logits=logits, hidden=hidden, captured=captured)
        self.copy_states(restores)
        tokens = [t for p in pieces for t in p.token_ids]
        positions = [i for p in pieces for i in range(p.start, p.start + len(p.token_ids))]
        pos = torch.tensor(positions, dtype=torch.long)
        slots, checkpoints = None, None
        if self.model.has_recurrent_state:
            slots = torch.tensor([p.state_slot for p in pieces], dtype=torch.long)
            if any(p.checkpoint for p in pieces):
                checkpoints = StateCheckpoints([i for i, p in enumerate(pieces) if p.checkpoint])
        meta = ForwardMetadata.build(
            query_start=row_offsets(len(p.token_ids) for p in pieces),
            context_lens=[p.start + len(p.token_ids) for p in pieces],
            block_tables=[p.block_table for p in pieces],
            positions=pos,
            block_size=self.block_size,
            state_slots=slots,
            checkpoints=checkpoints,
            prompt_pieces=frozenset(i for i, p in enumerate(pieces) if p.prompt),
        )
        meta, (tokens, logit_rows) = meta.to(
            self.device,
            torch.tensor(tokens, dtype=torch.long),
            torch.tensor(list(logit_rows), dtype=torch.long),
        )
        hidden, captured = self.model(tokens, meta.positions, meta, self.kv_caches, tuple(capture_layers))
        self._checkpoints = checkpoints
        logits = self.model.compute_logits(hidden[logit_rows])
        scores = self._score(hidden, scoring.rows, scoring.token_ids, scoring.num_top) if scoring else None
        return ForwardOutput(logits=logits, hidden=hidden, captured=captured, prompt_scores=scores)

    def _score(self, hidden: torch.Tensor, rows: Seq[int], token_ids: Seq[int], num_top: int) -> SampleOutput:
        """Raw logprobs (log_softmax of the model's logits) of `token_ids` at `rows` of the hidden states,
        and each row's top `num_top`."""
        logprobs, top_ids, top_values = [], [], []
        for at in range(0, len(rows), SCORE_ROWS_PER_CALL):
            index, tokens = to_device(
                hidden.device,
                torch.tensor(rows[at : at + SCORE_ROWS_PER_CALL], dtype=torch.long),
                torch.tensor(token_ids[at : at + SCORE_ROWS_PER_CALL], dtype=torch.long),
            )
            scored = raw_logprobs(self.model.compute_logits(hidden[index]), tokens, num_top)
            logprobs.append(scored.logprobs)
            if num_top:
                top_ids.append(scored.top_logprobs[0])
                top_values.append(scored.top_logprobs[1])
        return SampleOutput(
            token_ids=torch.tensor(token_ids, dtype=torch.long),
            logprobs=torch.cat(logprobs),
            top_logprobs=(torch.cat(top_ids), torch.cat(top_values)) if num_top else None,
        ).to_host()

    def copy_states(self, copies: Seq[StateCopy]) -> None:
        """Each copy's source slot's recurrent state into its destination slot, in every linear-attention
        layer, in order."""
        for copy in copies:
            for c in self.kv_caches:
                if isinstance(c, RecurrentState):
                    c.conv[copy.dst], c.ssm[copy.dst] = c.conv[copy.src], c.ssm[copy.src]

    @torch.inference_mode()
    def commit_states(self, keep: dict[int, int], saves: Seq[StateCopy] = ()) -> None:
        """After the last forward: the recurrent states of its checkpointed pieces back to the state after
        their first `keep[i]` tokens (the anchor and the accepted drafts of a verification), then the
        copies in `saves`; nothing for attention-only models."""
        if self._checkpoints is not None:
            self.model.rollback_states(self._checkpoints, self.kv_caches, keep)
            self._checkpoints = None
        self.copy_states(saves)
