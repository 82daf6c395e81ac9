"""Turns scheduled pieces into one flat batch, runs the model once, returns the logits needed.

The runner owns the model's caches: a paged KV cache per attention layer and, for hybrid models, a pool of
per-sequence recurrent-state slots per linear-attention layer (`num_state_slots`, one per running
sequence). A verified piece's recurrent state is checkpointed during the forward so that the commit can roll
it back to the accepted prefix (`roll_back_states`); KV is rolled back by length alone.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from specserve.config import EngineConfig, SpecserveError
from specserve.layers.attention import AttentionMetadata, KVCache
from specserve.layers.gated_deltanet import RecurrentState, RecurrentStateSpec, StateCheckpoints
from specserve.layers.sampler import SampleOutput, raw_logprobs
from specserve.models.base import CausalLM, LayerCacheSpec

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


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [rows requested, V] fp32
    hidden: torch.Tensor  # [N, H] final-normed hidden states of every row
    captured: dict[int, torch.Tensor]  # residual-stream outputs of the requested layers, [N, H] each
    checkpoints: StateCheckpoints | None = None  # of the pieces asked to checkpoint (hybrid models)


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


def state_checkpoint_slots(model: CausalLM, config: EngineConfig) -> int:
    """Recurrent-state checkpoints a hybrid target keeps for its prefix cache: one per running sequence,
    or as many as a quarter of the memory left after the running sequences' states holds."""
    per_slot = state_bytes_per_slot(model, config.torch_dtype)
    if not (per_slot and config.enable_prefix_caching):
        return 0
    spare = config.kv_cache_bytes - config.max_num_seqs * per_slot
    return max(0, min(config.max_num_seqs, spare // 4 // per_slot))


def kv_cache_blocks(model: CausalLM, config: EngineConfig, max_model_len: int) -> int:
    """Blocks of `config.block_size` tokens that `config.kv_cache_memory` holds once the recurrent-state
    slots of `max_num_seqs` sequences and the prefix cache's state checkpoints are paid for, never more
    than the running batch can fill: every sequence at max_model_len (plus a block of verification slack).
    The cache is allocated (and zeroed) up front, so the cap saves real memory."""
    per_slot = state_bytes_per_slot(model, config.torch_dtype)
    states = config.max_num_seqs * per_slot
    if states >= config.kv_cache_bytes:
        raise SpecserveError(
            f"kv_cache_memory={config.kv_cache_memory!r} does not even hold the recurrent states of "
            f"max_num_seqs={config.max_num_seqs} sequences ({states / 2**20:.0f} MiB); raise kv_cache_memory "
            "or lower max_num_seqs"
        )
    states += state_checkpoint_slots(model, config) * per_slot
    per_block = kv_bytes_per_block(model, config.block_size, config.torch_dtype)
    num_blocks = (config.kv_cache_bytes - states) // per_block
    per_sequence = -(-max_model_len // config.block_size) + 1
    num_blocks = min(num_blocks, config.max_num_seqs * per_sequence)
    if num_blocks * config.block_size < max_model_len:
        raise SpecserveError(
            f"kv_cache_memory={config.kv_cache_memory!r} holds {num_blocks * config.block_size} tokens, "
            f"fewer than max_model_len={max_model_len}; raise kv_cache_memory or lower max_model_len"
        )
    return num_blocks


class ModelRunner:
    def __init__(
        self, model: CausalLM, num_blocks: int, block_size: int, dtype: torch.dtype, num_state_slots: int = 0
    ):
        self.model = model
        self.block_size = block_size
        self.kv_caches: list[KVCache | RecurrentState] = []
        for spec in model.cache_specs():
            if isinstance(spec, RecurrentStateSpec):
                self.kv_caches.append(spec.allocate(num_state_slots, dtype))
                continue
            if spec.shared_with is not None:
                self.kv_caches.append(self.kv_caches[spec.shared_with])
                continue
            shape = (num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
            self.kv_caches.append(KVCache(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)))

    @torch.inference_mode()
    def forward(
        self, pieces: Seq[PieceInput], logit_rows: Seq[int], capture_layers: Seq[int] = ()
    ) -> ForwardOutput:
        """One target forward over all pieces; logits only for `logit_rows` (indices into the flat batch)."""
        tokens: list[int] = []
        positions: list[int] = []
        query_start = [0]
        for p in pieces:
            tokens += p.token_ids
            positions += range(p.start, p.start + len(p.token_ids))
            query_start.append(len(tokens))
        pos = torch.tensor(positions, dtype=torch.long)
        slots, checkpoints = None, None
        if self.model.has_recurrent_state:
            slots = torch.tensor([p.state_slot for p in pieces], dtype=torch.long)
            if any(p.checkpoint for p in pieces):
                checkpoints = StateCheckpoints([i for i, p in enumerate(pieces) if p.checkpoint])
        meta = AttentionMetadata.build(
            query_start=query_start,
            context_lens=[p.start + len(p.token_ids) for p in pieces],
            block_tables=[p.block_table for p in pieces],
            positions=pos,
            block_size=self.block_size,
            state_slots=slots,
            checkpoints=checkpoints,
        )
        hidden, captured = self.model(
            torch.tensor(tokens, dtype=torch.long), pos, meta, self.kv_caches, tuple(capture_layers)
        )
        logits = self.model.compute_logits(hidden[torch.tensor(list(logit_rows), dtype=torch.long)])
        return ForwardOutput(logits=logits, hidden=hidden, captured=captured, checkpoints=checkpoints)

    @torch.inference_mode()
    def score(self, hidden: torch.Tensor, rows: Seq[int], token_ids: Seq[int], num_top: int) -> SampleOutput:
        """Raw logprobs (log_softmax of the model's logits) of `token_ids` at `rows` of a forward's hidden
        states, and each row's top `num_top`."""
        logprobs, top_ids, top_values = [], [], []
        for at in range(0, len(rows), SCORE_ROWS_PER_CALL):
            index = torch.tensor(rows[at : at + SCORE_ROWS_PER_CALL], dtype=torch.long)
            tokens = torch.tensor(token_ids[at : at + SCORE_ROWS_PER_CALL], dtype=torch.long)
            scored = raw_logprobs(self.model.compute_logits(hidden[index]), tokens, num_top)
            logprobs.append(scored.logprobs)
            if num_top:
                top_ids.append(scored.top_logprobs[0])
                top_values.append(scored.top_logprobs[1])
        return SampleOutput(
            token_ids=torch.tensor(token_ids, dtype=torch.long),
            logprobs=torch.cat(logprobs),
            top_logprobs=(torch.cat(top_ids), torch.cat(top_values)) if num_top else None,
        )

    def save_states(self, slot: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A copy of one slot's recurrent state in every linear-attention layer."""
        return [
            (c.conv[slot].clone(), c.ssm[slot].clone())
            for c in self.kv_caches
            if isinstance(c, RecurrentState)
        ]

    def copy_states(self, src: int, dst: int) -> None:
        """Slot `src`'s recurrent state into slot `dst`, in every linear-attention layer."""
        for c in self.kv_caches:
            if isinstance(c, RecurrentState):
                c.conv[dst], c.ssm[dst] = c.conv[src], c.ssm[src]

    def restore_states(self, slot: int, saved: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        states = [c for c in self.kv_caches if isinstance(c, RecurrentState)]
        for state, (conv, ssm) in zip(states, saved, strict=True):
            state.conv[slot], state.ssm[slot] = conv, ssm

    @torch.inference_mode()
    def roll_back_states(self, checkpoints: StateCheckpoints | None, keep: dict[int, int]) -> None:
        """Recurrent states of checkpointed pieces back to the state after their first `keep[i]` tokens
        (the anchor and the accepted drafts of a verification); nothing for attention-only models."""
        if checkpoints is not None:
            self.model.rollback_states(checkpoints, self.kv_caches, keep)
