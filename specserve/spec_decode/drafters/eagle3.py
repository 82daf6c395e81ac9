"""EAGLE-3 drafting inside the engine (DSPARK.md §8.3): autoregressive, one single-layer draft forward
per drafted token, batched across requests.

The draft cache holds one row per committed position t < a (the anchor's position): the target's features
at t paired with the token at t+1. A round first writes the pending rows (the anchor and accepted tokens
of the last verification, causally; those beyond what one forward may hold, a new request's prompt, in
forwards of their own before: `HiddenStateDrafter.catch_up`), whose last output predicts d1; then each
step feeds the previous step's output hidden state with the token just drafted, one position further. The
drafted rows are rolled back by length afterwards; the next round rewrites those positions with the
target's real features.
Drafting a request stops at a drafted end-of-sequence token, as DeepSpec's evaluator does.
"""

from __future__ import annotations

import torch

from specserve.config import SpeculativeConfig
from specserve.core.batch import row_offsets
from specserve.core.proposal import DraftProposal
from specserve.core.sequence import Sequence
from specserve.layers.transfer import to_host
from specserve.spec_decode.context import TargetContext
from specserve.spec_decode.deepspec.config import Eagle3Config
from specserve.spec_decode.deepspec.dspark import PagedDraftBatch
from specserve.spec_decode.deepspec.eagle3 import Eagle3DraftModel
from specserve.spec_decode.drafters.base import sample_drafts
from specserve.spec_decode.drafters.graphs import DraftInputs
from specserve.spec_decode.drafters.hidden_states import (
    DrafterLayout,
    HiddenStateDrafter,
    concat_rows,
    context_rows,
)


class Eagle3Drafter(HiddenStateDrafter):
    reads_next_token = True  # context row t reads the token at t + 1
    drafts_from_newest_row = True  # d1 comes from it

    def __init__(
        self,
        model: Eagle3DraftModel,
        target: TargetContext,
        max_num_tokens: int,
        layout: DrafterLayout | None = None,
        default_num_tokens: int | None = None,
    ):
        """`layout` and `default_num_tokens`: the checkpoint's (its config) unless given."""
        super().__init__(model, target, layout or DrafterLayout.of_checkpoint(model), max_num_tokens)
        self.default_num_tokens = default_num_tokens or model.config.ttt_length
        self.max_num_tokens = max_num_tokens
        self.eos_token_ids = set(target.eos_token_ids)

    @classmethod
    def from_config(cls, spec: SpeculativeConfig, target: TargetContext) -> Eagle3Drafter:
        model = cls.load(spec, target, Eagle3Config)
        return cls(model, target, spec.num_speculative_tokens or model.config.ttt_length)

    def propose(self, seqs: list[Sequence], num_tokens: int, keep_drafting=None) -> list[DraftProposal]:
        num_tokens = min(num_tokens, self.max_num_tokens)
        # The first draft comes from the newest context row: a request needs at least one pending row.
        ready = [i for i in self.ready(seqs) if self.states[seqs[i].request_id].num_pending]
        proposals = [DraftProposal([]) for _ in seqs]
        if not ready:
            return proposals
        for i, proposal in zip(ready, self._draft([seqs[i] for i in ready], num_tokens)):
            proposals[i] = proposal
        return proposals

    @torch.inference_mode()
    def _draft(self, seqs: list[Sequence], num_tokens: int) -> list[DraftProposal]:
        states = [self.states[s.request_id] for s in seqs]
        anchors = [s.num_tokens - 1 for s in seqs]
        for state, a in zip(states, anchors):
            self.blocks.grow(state, a + num_tokens - 1)
        self.catch_up(seqs, states)
        lens = [st.num_pending for st in states]
        features = concat_rows(
            [f for st in states for f in st.take_pending()], self.feature_width, self.caches[0].k
        )
        out = self.write_context(seqs, states, lens, features)
        hidden = out[[end - 1 for end in row_offsets(lens)[1:]]]  # each request's newest row
        drafted: list[list[int]] = [[] for _ in seqs]
        q_rows, peak_rows = [], []
        for step in range(num_tokens):
            if step:
                step_tokens = [[d[-1]] for d in drafted]
                hidden = self.run_forward(
                    states, step_tokens, [a + step - 1 for a in anchors], query_rows=hidden
                )
            logits = self.model.compute_logits(self.model.final_hidden(hidden))
            logits = self.model.target_vocab_logits(logits)
            q, new, peaks = sample_drafts(logits, seqs, drafted, self.vocab_size, self.generator)
            q_rows.append(q)
            peak_rows.append(peaks)
            for d, token in zip(drafted, new):
                d.append(token)
        self.roll_back(seqs, states, anchors)
        probs, (confidences,) = torch.stack(q_rows, dim=1), to_host(torch.stack(peak_rows, dim=1))
        return [
            DraftProposal(d, probs[r], confidences[r]).truncate(self._length(d, seq))
            for r, (d, seq) in enumerate(zip(drafted, seqs))
        ]

    def write_context(self, seqs, states, lens, features) -> torch.Tensor:
        """The context rows as query rows, causally (their K/V written): their outputs."""
        starts = [st.num_cached for st in states]
        # Row t pairs the features of position t with the token at t + 1.
        tokens = [s.all_token_ids[p + 1 : p + n + 1] for s, p, n in zip(seqs, starts, lens)]
        owner, pos = (torch.tensor(rows, dtype=torch.long) for rows in context_rows(starts, lens))
        self.group.keep_last_features([st.block_table for st in states], owner, pos, features)
        return self.run_forward(states, tokens, starts, query_rows=self.model.project_context(features))

    def forward_rows(self, inputs: DraftInputs, batch: PagedDraftBatch) -> torch.Tensor:
        """Pre-norm outputs of the rows, each from its token and its hidden input (projected target
        features, or the previous step's output)."""
        return self.model(inputs.token_ids, inputs.query_rows, batch)

    def row_widths(self) -> tuple[int, int]:
        return self.model.hidden_size, 0

    def _length(self, drafted: list[int], seq: Sequence) -> int:
        """Drafts up to and including the first end-of-sequence token (a request that ignores eos: all)."""
        if not seq.params.ignore_eos:
            for i, token in enumerate(drafted):
                if token in self.eos_token_ids:
                    return i + 1
        return len(drafted)
