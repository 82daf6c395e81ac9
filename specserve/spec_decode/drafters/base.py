"""The drafter interface: proposals for the decoding requests of a step."""

from __future__ import annotations

import torch

from specserve.config import SpeculativeConfig
from specserve.core.cache_coordinator import DrafterCaches, DrafterCacheSpec
from specserve.core.cache_groups import PagedGroup
from specserve.core.proposal import DraftProposal, KeepDrafting
from specserve.core.sequence import Sequence
from specserve.layers.sampler import (
    SamplingBatch,
    add_logit_bias,
    draw_exponential,
    first_argmax,
    target_probs,
)
from specserve.spec_decode.context import TargetContext
from specserve.structured.masks import mask_logits


class Drafter:
    """Proposes tokens for sequences whose next step is a decode step.

    A drafter with caches of its own (a draft model's KV, a context cache) says what they need
    (`cache_spec`); the engine sizes them from its one budget and hands them over (`bind_caches`) before the
    first round. Their per-request entries are the cache coordinator's: it frees them with the request
    (finished, aborted, preempted) and asks them how much of a prefix hit they hold. The drafter learns
    what the target accepted from the sequences themselves: their token lists only ever grow by verified
    tokens, so whatever it computed for tokens that are not a prefix of the sequence any more is rolled
    back.

    Drafters conditioned on the target's hidden states name the layers in `capture_layers`; after every
    target forward the engine calls `observe` with those layers' outputs (concatenated) for exactly the
    rows that were kept: prompt rows, and the anchor plus accepted drafts of a verification.
    """

    capture_layers: tuple[int, ...] = ()
    default_num_tokens: int = 3
    # A confidence head estimates each draft's survival; without one, confidences are peak probabilities.
    has_confidence_head: bool = False
    # Serial drafters ask `keep_drafting` before each draft step; the others draft a round at once and the
    # engine asks the verify planner before it whether the step drafts at all.
    drafts_serially: bool = False
    # Drafts sampled from a distribution (q rows, which verification reads); n-gram drafts are looked up.
    samples_drafts: bool = True

    @classmethod
    def from_config(cls, config: SpeculativeConfig, target: TargetContext) -> Drafter:
        """The drafter the speculative config describes, its weights loaded (no caches yet)."""
        raise NotImplementedError

    def propose(
        self, seqs: list[Sequence], num_tokens: int, keep_drafting: KeepDrafting | None = None
    ) -> list[DraftProposal]:
        """Up to `num_tokens` drafts per sequence. A serial drafter asks `keep_drafting` before each draft
        step which sequences draft on; drafters that draft a block at once may ignore it."""
        raise NotImplementedError

    def backlog(self, seq: Sequence) -> int:
        """Tokens of `seq` the next draft step would feed the drafter before drafting: a round's few
        after a verified one, its whole prompt for a new request, more after steps that drafted nothing.
        Drafters whose catch-up costs next to nothing (they read the target's features) report 0."""
        return 0

    def observe(self, seq: Sequence, start: int, features: torch.Tensor) -> None:
        """Target features [n, n_f * H] of `seq`'s positions start..start+n-1 (only with capture_layers)."""

    def cache_spec(self, block_size: int) -> DrafterCacheSpec:
        """What its own caches need, for blocks of the target's `block_size` (none by default)."""
        return DrafterCacheSpec()

    def bind_caches(self, caches: DrafterCaches) -> None:
        """Its caches' groups, as `cache_spec` asked; it allocates its tensors now."""

    def activation_bytes(self, target: TargetContext) -> int:
        """On a GPU, before its caches: what its network's forwards take beyond its weights and caches (its
        largest eager step's peak and its CUDA graphs' pool, measured: worker/device_memory.py), which the
        engine sets aside from `gpu_memory_utilization`'s budget (none by default: no network)."""
        return 0

    def bind_target(self, kv: PagedGroup, layers: list) -> None:
        """The target's KV cache, for a drafter that reads it: the group (each request's block table) and
        its layers' caches (the runner's, in model layer order)."""


def sample_drafts(
    logits: torch.Tensor,
    seqs: list[Sequence],
    drafted: list[list[int]],
    vocab_size: int,
    generator: torch.Generator,
) -> tuple[torch.Tensor, list[int], torch.Tensor]:
    """One draft token per sequence from `logits` [R, V] under each request's own sampling parameters
    and logit transforms, as the target's rows get them (its logit_bias, and its output constraint's mask
    after the drafts so far; penalties count those drafts as emitted), so drafts are what the target
    accepts; returns the exact q rows [R, V], the tokens and each row's peak confidence [R]: the top
    probability of the drafter's own distribution before the request's transforms (after a greedy one q
    is one-hot and its peak says nothing), known before the draw."""
    batch = SamplingBatch.build(
        [s.params for s in seqs],
        [s.prompt_token_ids for s in seqs],
        [s.output_token_ids + d for s, d in zip(seqs, drafted)],
        vocab_size,
        [s.generator for s in seqs],
        generator=generator,
        device=logits.device,
    )
    q = target_probs(_transformed(logits, seqs, drafted), batch)
    raw = logits.float()
    peaks = torch.exp(raw.amax(dim=-1) - raw.logsumexp(dim=-1))
    return q, first_argmax(q / draw_exponential(batch, q.shape[1])).tolist(), peaks


def _transformed(logits: torch.Tensor, seqs: list[Sequence], drafted: list[list[int]]) -> torch.Tensor:
    """`logits` with each request's logit_bias added and its grammar's mask after its drafts applied."""
    masks = {}
    for r, (seq, tokens) in enumerate(zip(seqs, drafted)):
        mask = seq.grammar.mask_after(tokens) if seq.grammar is not None else None
        if mask is not None:
            masks[r] = mask
    biased = [r for r, seq in enumerate(seqs) if seq.params.logit_bias]
    if not masks and not biased:
        return logits
    logits = logits.clone()
    for r in biased:
        add_logit_bias(logits, [r], seqs[r].params.logit_bias)
    if masks:
        rows = list(masks)
        masked = mask_logits(logits[rows], torch.stack([masks[r] for r in rows]))
        # A drafter whose support is narrowed (a pruned vocabulary, DFlash2's candidates, a centroid
        # vocabulary) may allow no token the grammar does: that row drafts unmasked (q stays a distribution;
        # its ungrammatical draft is rejected for sure and cut by the speculator).
        empty = torch.isinf(masked).all(-1)
        logits[rows] = torch.where(empty[:, None], logits[rows], masked)
    return logits
