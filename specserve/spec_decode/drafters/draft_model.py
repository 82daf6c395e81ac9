"""A smaller model with the target's tokenizer drafts k tokens autoregressively, in its own paged KV cache.

Each round is k batched forwards of the draft model over all proposing sequences: the first feeds every
token the draft cache has not seen yet (the tokens accepted last round and the new bonus token, or more
after rounds that drafted nothing; a new request's prompt beyond a step's worth of tokens goes in forwards of
its own first: `_catch_up`), the others one drafted token each. Drafts are sampled with the
request's own sampling parameters and their q rows kept for rejection sampling. A scheduled verify policy
decides before each forward which sequences draft on (`keep_drafting`).

Its KV cache (and a hybrid draft model's state slots) are groups of the engine's cache coordinator. With
prefix caching, the full blocks of tokens it has fed join its group's prefix cache, and a new request starts
from the longest cached chain of its tokens (it catches up from the tokens, so it never shortens the target's
prefix hits). Rejected drafts are rolled back by length in the paged KV cache. Its runner replays CUDA graphs
of its short steps as the target's does (drafters/graphs.py), where the engine captures them. A hybrid draft
model's recurrent state is never rolled back: each request holds two slots, its committed state and a drafting
one. A round's first forward (every committed token fed) advances the committed slot, which is then copied
into the drafting slot for the drafts' forwards; the next round starts from the committed slot and feeds the
accepted drafts again, or, when every fed draft was accepted, the two slots trade places (and no prefix cache:
a cached block would need the recurrent state at its end too).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specserve.config import SpecserveError, SpeculativeConfig
from specserve.core.batch import catch_up_chunks, row_offsets
from specserve.core.cache_coordinator import DrafterCaches, DrafterCacheSpec
from specserve.core.cache_groups import PagedEntry, PagedGroup, PagedSpec, StateCopy
from specserve.core.proposal import DraftProposal, KeepDrafting
from specserve.core.sequence import Sequence
from specserve.models.loader import load_model
from specserve.spec_decode.context import TargetContext
from specserve.spec_decode.drafters.base import Drafter, sample_drafts
from specserve.spec_decode.drafters.graphs import draft_graph_config
from specserve.worker.device_memory import lm_activation_bytes
from specserve.worker.model_runner import ModelRunner, PieceInput, kv_bytes_per_block, state_bytes_per_slot


@dataclass
class DraftState(PagedEntry):
    """Tokens whose K/V the draft cache holds for one sequence, in position order."""

    fed: list[int] = field(default_factory=list)
    num_committed: int = 0  # hybrid draft models: the committed slot holds the state after this many of `fed`


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    # Asked twice a step per drafting request (`backlog`, then `_sync`): the usual answer, a whole
    # prefix, in one list comparison rather than a Python loop over the sequence.
    if a[:n] == b[:n]:
        return n
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _as_tensors(rows: list[list[float]]) -> tuple[torch.Tensor, ...]:
    """Each row as a float32 tensor, made as views of one (a tensor per row costs more at 1000 requests)."""
    return torch.tensor([x for row in rows for x in row]).split([len(row) for row in rows])


class DraftModelDrafter(Drafter):
    drafts_serially = True

    def __init__(self, model, target: TargetContext):
        self.model = model
        self.dtype = target.torch_dtype
        self.vocab_size = target.vocab_size
        self.generator = target.generator  # unseeded requests draw from the engine's generator
        # The most new tokens a forward feeds (`_catch_up` bounds a round's first to it): a target step's, as
        # `activation_bytes` measures
        self.max_forward_tokens = target.max_num_batched_tokens
        # None: its forwards eager (see draft_graph_config); else its runner's, as the target's (set before
        # `bind_caches`)
        self.graph_config = draft_graph_config(target, model)

    def cache_spec(self, block_size: int) -> DrafterCacheSpec:
        # Drafts run ahead of the target's reservation by at most k - 1 tokens: a block a request beyond
        # the target's blocks, so the draft cache can never run out while the target's has room.
        hybrid = self.model.has_recurrent_state
        kv_per_block = kv_bytes_per_block(self.model, block_size, self.dtype)
        kv = PagedSpec(kv_per_block, prefix_caching=not hybrid, entry_type=DraftState)
        states = state_bytes_per_slot(self.model, self.dtype)
        return DrafterCacheSpec((kv,), states, state_slots_per_request=2)  # committed, drafting

    def activation_bytes(self, target: TargetContext) -> int:
        """As the target's (a step of its tokens; a row sampled per request), its graphs' pool included."""
        graph_tokens = self.graph_config.largest_bucket if self.graph_config is not None else 0
        limits = (self.max_forward_tokens, target.max_num_seqs, target.block_size, self.dtype)
        return lm_activation_bytes(self.model, *limits, graph_tokens=graph_tokens)

    def bind_caches(self, caches: DrafterCaches) -> None:
        (group,) = caches.paged
        self.group: PagedGroup[DraftState] = group
        self.blocks = group.blocks
        self.states = group.entries  # request id -> its draft state (the coordinator frees it)
        # A hybrid draft model's recurrent-state slots: each request's committed state, and its drafting one.
        self.slots, self.drafting = caches.states or (None, None)
        num_slots = sum(states.num_slots for states in caches.states)
        num_blocks = group.blocks.num_blocks
        self.runner = ModelRunner(
            self.model, num_blocks, group.block_size, self.dtype, num_slots, graphs=self.graph_config
        )

    def _slot(self, seq: Sequence, drafting: bool = False) -> int | None:
        """Its committed (or drafting) recurrent-state slot; None for attention-only draft models."""
        if self.slots is None:
            return None
        return (self.drafting if drafting else self.slots).slot_of[seq.request_id]

    @classmethod
    def from_config(cls, config: SpeculativeConfig, target: TargetContext) -> DraftModelDrafter:
        model, hf_config, tokenizer = load_model(
            config.model,
            dtype=target.torch_dtype,
            quantization=config.quantization,
            platform=target.platform,
            load_format=target.load_format,
        )
        draft_vocab = getattr(getattr(hf_config, "text_config", None) or hf_config, "vocab_size", None)
        if draft_vocab != target.vocab_size:
            raise SpecserveError(
                f"draft model {config.model!r} has vocabulary size {draft_vocab}, the target has "
                f"{target.vocab_size}: a draft model must share the target's tokenizer"
            )
        if (
            tokenizer is not None
            and target.tokenizer is not None
            and tokenizer.get_vocab() != target.tokenizer.get_vocab()
        ):
            raise SpecserveError(
                f"draft model {config.model!r} has a different tokenizer vocabulary than the target"
            )
        return cls(model, target)

    def propose(
        self, seqs: list[Sequence], num_tokens: int, keep_drafting: KeepDrafting | None = None
    ) -> list[DraftProposal]:
        if not seqs:
            return []
        states = [self._sync(seq) for seq in seqs]
        self._catch_up(seqs, states)
        drafted: list[list[int]] = [[] for _ in seqs]
        q_rows: list[list[torch.Tensor]] = [[] for _ in seqs]
        confidences: list[list[float]] = [[] for _ in seqs]
        active = list(range(len(seqs)))  # the sequences still drafting
        for _ in range(num_tokens):
            if keep_drafting is not None:  # asked before every step, the first included: none may pay
                so_far = [DraftProposal(d, None, c) for d, c in zip(drafted, _as_tensors(confidences))]
                keep = keep_drafting(so_far)
                active = [i for i in active if keep[i]]
                if not active:
                    break
            first = not any(drafted[i] for i in active)  # this forward feeds committed tokens only
            pieces = []
            for i in active:
                tokens = seqs[i].all_token_ids + drafted[i]
                new = tokens[len(states[i].fed) :]
                self.blocks.grow(states[i], len(tokens))
                slot = self._slot(seqs[i], drafting=not first)
                pieces.append(PieceInput(new, len(states[i].fed), states[i].block_table, slot))
                states[i].fed = tokens
            rows = [end - 1 for end in row_offsets(len(p.token_ids) for p in pieces)[1:]]  # newest each
            logits = self.runner.forward(pieces, rows).logits
            if self.slots is not None and first:  # the drafts go on from a copy of the committed state
                for i in active:
                    states[i].num_committed = len(states[i].fed)
                self.runner.copy_states(
                    [StateCopy(self._slot(seqs[i]), self._slot(seqs[i], drafting=True)) for i in active]
                )
            q, tokens, peaks = sample_drafts(
                logits,
                [seqs[i] for i in active],
                [drafted[i] for i in active],
                self.vocab_size,
                self.generator,
            )
            for i, row, token, confidence in zip(active, q, tokens, peaks.tolist()):
                drafted[i].append(token)
                q_rows[i].append(row)
                confidences[i].append(confidence)
        # The last draft was sampled but never fed: the cache holds tokens up to d_{k-1}.
        return [
            DraftProposal(d, torch.stack(rows) if rows else None, c)
            for d, rows, c in zip(drafted, q_rows, _as_tensors(confidences))
        ]

    def _catch_up(self, seqs: list[Sequence], states: list[DraftState]) -> None:
        """Bound a round's first forward to `max_forward_tokens` new tokens: a new request's whole prompt
        (or a long backlog) is more than the memory budget holds a forward of. The excess, each request's
        oldest committed tokens first, is fed beforehand in forwards of at most that many tokens, into its
        committed state; each request's newest token stays for the round (its logits draft d1)."""
        new = [seq.num_tokens - len(state.fed) for seq, state in zip(seqs, states)]
        for chunk in catch_up_chunks(new, 1, self.max_forward_tokens):
            pieces = []
            for r, n in chunk:
                seq, state = seqs[r], states[r]
                start = len(state.fed)
                self.blocks.grow(state, start + n)
                pieces.append(
                    PieceInput(
                        seq.all_token_ids[start : start + n], start, state.block_table, self._slot(seq)
                    )
                )
                state.fed = seq.all_token_ids[: start + n]
                state.num_committed = start + n
            self.runner.forward(pieces, [])

    def backlog(self, seq: Sequence) -> int:
        state = self.states.get(seq.request_id)
        if state is None:
            return (
                seq.num_tokens
                - len(self.blocks.match(seq.all_token_ids, seq.num_tokens - 1)) * self.blocks.block_size
            )
        return seq.num_tokens - self._kept(state, seq)

    def _kept(self, state: DraftState, seq: Sequence) -> int:
        """Cached tokens still a prefix of the sequence; the newest token is always fed again, so that
        its logits are computed this round. A recurrent state goes back to the committed slot's only, or to
        the start (when even that is too new: the sequence gained nothing since its last round)."""
        keep = min(common_prefix_len(state.fed, seq.all_token_ids), seq.num_tokens - 1)
        if self.slots is None or keep == len(state.fed):
            return keep
        return state.num_committed if state.num_committed <= keep else 0

    def _sync(self, seq: Sequence) -> DraftState:
        """Keep only the cached tokens that are still a prefix of the sequence (roll back the rest)."""
        state = self.states.get(seq.request_id)
        if state is None:
            state = self.group.open(seq.request_id)
            if self.slots is not None:
                self.slots.take(seq.request_id)
                self.drafting.take(seq.request_id)
            self.blocks.attach(state, self.blocks.match(seq.all_token_ids, seq.num_tokens - 1))
            state.fed = seq.all_token_ids[: len(state.block_table) * self.blocks.block_size]
        keep = self._kept(state, seq)
        if self.slots is not None and keep == len(state.fed) > state.num_committed:
            # Every fed draft was accepted: the drafting slot holds the committed state now.
            rid = seq.request_id
            self.slots.slot_of[rid], self.drafting.slot_of[rid] = self._slot(seq, True), self._slot(seq)
            state.num_committed = keep
        del state.fed[keep:]
        self.blocks.shrink(state, keep)
        # What is kept stays: later rounds keep at least as much (the sequence only grows by verified tokens).
        self.blocks.commit(state, keep, lambda: seq.all_token_ids)
        return state
