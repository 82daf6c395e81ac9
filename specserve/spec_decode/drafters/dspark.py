"""DSpark (and DFlash) drafting inside the engine: one batched backbone pass for every decoding request,
then the sequential head left to right, vectorised across requests.

Per request the drafter keeps a paged draft cache holding K/V of the projected target context for every
position before the current anchor, plus the target features it has been handed but not projected yet.
A round (DSPARK.md §4.3):
1. project the pending context rows and write their K/V (positions cached..a-1), write the block's K/V
   (positions a..a+B-1) and attend, without a causal mask, over the whole cache (pending rows beyond what
   one forward may hold are written first, in forwards of their own: `HiddenStateDrafter.catch_up`);
2. roll the cache back to `a` (a length change: the block rows are overwritten next round);
3. sample slot by slot: z_i = U_i + MarkovBias(prev_i), q_i = the request's sampling transforms of z_i,
   d_{i+1} ~ q_i, prev_{i+1} = d_{i+1}; confidence c_i from [h_i; W1[prev_i]].
The engine then verifies and hands back (`observe`) the target features of the anchor and the accepted
drafts only, which become the next round's pending context.
"""

from __future__ import annotations

import torch

from specserve.config import SpecserveError, SpeculativeConfig
from specserve.core.proposal import DraftProposal
from specserve.core.sequence import Sequence
from specserve.layers.transfer import to_host
from specserve.spec_decode.calibration.offline import load_temperatures
from specserve.spec_decode.context import TargetContext
from specserve.spec_decode.deepspec.config import DSparkConfig
from specserve.spec_decode.deepspec.dspark import DSparkDraftModel, PagedDraftBatch
from specserve.spec_decode.drafters.base import sample_drafts
from specserve.spec_decode.drafters.graphs import DraftInputs
from specserve.spec_decode.drafters.hidden_states import (
    DrafterLayout,
    HiddenStateDrafter,
    concat_rows,
    context_rows,
)


class DSparkDrafter(HiddenStateDrafter):
    causal = False  # a block's rows see each other and the whole context

    def __init__(self, model: DSparkDraftModel, target: TargetContext, calibrated: bool = True):
        super().__init__(model, target, DrafterLayout.of_checkpoint(model), model.config.block_size)
        self.block_size = model.config.block_size
        self.query_rows_per_request = self.block_size  # a round's block rows
        # Slot of the first draft: 0 with DeepSpec's anchor-first blocks, 1 with z-lab's 1+N infill
        # (slot 0 then only carries the anchor).
        self.first_slot = model.config.first_draft_slot
        self.max_drafts = self.default_num_tokens = model.config.max_drafts
        self.mask_token_id = model.config.mask_token_id
        self.has_confidence_head = model.confidence_head is not None
        directory = getattr(model, "checkpoint_dir", None)
        # STS temperatures per position (`specserve calibrate`); None: the raw confidences.
        self.temperatures = load_temperatures(directory) if calibrated and directory is not None else None

    @classmethod
    def from_config(cls, spec: SpeculativeConfig, target: TargetContext) -> DSparkDrafter:
        model = cls.load(spec, target, DSparkConfig)
        config = model.config
        if spec.method == "dflash" and (config.markov_rank or config.confidence_head):
            raise SpecserveError(
                f"{spec.model}: method 'dflash' expects a checkpoint without sequential heads, this one has "
                f"markov_rank={config.markov_rank}, enable_confidence_head={config.confidence_head}; "
                "use method 'dspark'"
            )
        k = spec.num_speculative_tokens
        if k is not None and k > config.max_drafts:
            raise SpecserveError(
                f"num_speculative_tokens={k} exceeds the {config.max_drafts} drafts a block of the drafter's "
                f"block_size={config.block_size} gives (sample_from_anchor {config.sample_from_anchor})"
            )
        return cls(model, target, calibrated=spec.threshold_semantics != "deepspec")

    def propose(self, seqs: list[Sequence], num_tokens: int, keep_drafting=None) -> list[DraftProposal]:
        num_tokens = min(num_tokens, self.max_drafts)
        ready = self.ready(seqs)
        proposals = [DraftProposal([]) for _ in seqs]
        if not ready or num_tokens < 1:
            return proposals
        ready_seqs = [seqs[i] for i in ready]
        h = self._backbone(ready_seqs)[:, : self.first_slot + num_tokens]
        anchors = torch.tensor([s.all_token_ids[-1] for s in ready_seqs], device=self.device)
        for i, proposal in zip(ready, self._sample(h, anchors, ready_seqs)):
            proposals[i] = proposal
        return proposals

    @torch.inference_mode()
    def _backbone(self, seqs: list[Sequence]) -> torch.Tensor:
        """One draft forward over all requests' new context rows and blocks -> hidden states [R, B, H]."""
        B = self.block_size
        states = [self.states[s.request_id] for s in seqs]
        anchors = [s.num_tokens - 1 for s in seqs]
        for state, a in zip(states, anchors):
            self.blocks.grow(state, a + B)
        self.catch_up(seqs, states)
        kv_only = context_rows([st.num_cached for st in states], [st.num_pending for st in states])
        features = [f for st in states for f in st.take_pending()]
        features = concat_rows(features, self.feature_width, self.caches[0].k)
        block_ids = [[s.all_token_ids[-1]] + [self.mask_token_id] * (B - 1) for s in seqs]
        h = self.run_forward(states, block_ids, anchors, kv_only, kv_rows=features)
        self.roll_back(seqs, states, anchors)  # keep the context rows (< a); the block rows go
        return h.view(len(seqs), B, -1)

    def write_context(self, seqs, states, lens, features) -> None:
        """The context rows alone, K/V-only (no block): an eager forward of no query rows."""
        starts, tables = [st.num_cached for st in states], [st.block_table for st in states]
        no_block = [[] for _ in states]
        self.eager_forward(tables, self.caches, no_block, starts, context_rows(starts, lens), None, features)

    def forward_rows(self, inputs: DraftInputs, batch: PagedDraftBatch) -> torch.Tensor:
        """The block rows' final-normed hidden states; the K/V-only rows are the new context's features."""
        embeds, context = self.model.embed(inputs.token_ids), self.model.project_context(inputs.kv_rows)
        return self.model.backbone(embeds, context, batch)

    def row_widths(self) -> tuple[int, int]:
        return 0, self.feature_width

    @torch.inference_mode()
    def _sample(self, h: torch.Tensor, anchors: torch.Tensor, seqs: list[Sequence]) -> list[DraftProposal]:
        """Left-to-right sampling through the sequential head; keeps every exact q row and confidence.
        `h` [R, first_slot + k, H]: the block's slots up to the last draft's."""
        head = self.model.markov_head
        state = head.initial_state(len(seqs), h) if head is not None else None
        if self.first_slot:
            # The anchor's slot drafts nothing, yet a recurrent head's state passes through it (as trained).
            if head is not None:
                _, state = head.transition(anchors, h[:, 0], state)
            h = h[:, 1:]
        num_seqs, k, _ = h.shape
        base = self.model.compute_logits(h.reshape(num_seqs * k, -1)).view(num_seqs, k, -1)
        prev = anchors
        drafted: list[list[int]] = [[] for _ in seqs]
        q_rows, confidence_logits, peak_rows = [], [], []
        for i in range(k):
            logits = base[:, i]
            if head is not None:
                bias, state = head.step(prev, h[:, i], state)
                logits = logits + bias.float()  # after Gemma's softcap, never re-capped
            conf = self.model.confidence_logits(h[:, i], prev)
            if conf is not None:
                if self.temperatures is not None and i < len(self.temperatures):
                    conf = conf / self.temperatures[i]
                confidence_logits.append(conf)
            if self.model.candidate_selector is not None:  # DFlash2: its candidates only
                logits = self.model.candidate_selector.restrict(logits, h[:, i], prev)
            logits = self.model.target_vocab_logits(logits)
            q, tokens, peaks = sample_drafts(logits, seqs, drafted, self.vocab_size, self.generator)
            q_rows.append(q)
            peak_rows.append(peaks)
            for r, token in enumerate(tokens):
                drafted[r].append(token)
            prev = torch.tensor(tokens, device=self.device)
        probs = torch.stack(q_rows, dim=1)  # [R, k, V]
        if confidence_logits:
            confidences = torch.sigmoid(torch.stack(confidence_logits, dim=1))
        else:  # no confidence head (DFlash): the peaks of the drafter's own distributions
            confidences = torch.stack(peak_rows, dim=1)
        (confidences,) = to_host(confidences)  # the planner reads them on the host; q rows stay
        return [DraftProposal(drafted[r], probs[r], confidences[r]) for r in range(num_seqs)]
