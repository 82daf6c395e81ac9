"""EAGLE-3's training-time test (TTT, DSPARK.md §8.3): the drafter unrolled over its own hidden states.

Step 0 is the inference prefill: row t pairs the target's features at t with the token at t+1, at RoPE
position t, causally. Step k feeds row t the previous step's output hidden state with the token at t+k+1, at
position t+k: the k-th draft step of the chain anchored after row t, fed the true tokens. Its attention reads
the step-0 rows up to t and its own chain's rows of steps 1..k, which is the draft cache the inference drafter
holds at that point (DeepSpec's flex mask "causal over step-0 keys + same-position keys of earlier steps").

Row t of step k is scored against the target's distribution at t+k+1 (uniform past the end) where
mask_k[t] = mask_0[t+k], mask_0 being the loss mask without the sequence's last token (it has no next token).
A row's chain reads no other chain, so the chains of a sample of rows (as DSpark samples anchors) give
exactly those rows' terms of the full objective; logits are rows x steps x vocabulary, the memory that
bounds long sequences.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specserve.spec_decode.deepspec.dspark import DenseDraftBatch
from specserve.spec_decode.deepspec.eagle3 import Eagle3DraftModel
from specserve.train.anchors import choose
from specserve.train.forward import target_logits


@dataclass
class TTTOutput:
    rows: torch.Tensor  # [R] the rows t whose chains were unrolled, ascending
    draft_logits: torch.Tensor  # [R, K, V]: row t, step k
    target_logits: torch.Tensor  # [R, K, V]: the target's at t+k+1, zeros (uniform) past the end
    mask: torch.Tensor  # [R, K] bool: mask_k[t]
    normaliser: float  # what the loss sums are divided by: S, scaled up when rows were sampled


@dataclass
class TTTDraftBatch(DenseDraftBatch):
    """One TTT step: `block_pos` / `kv_pos` are this step's rows; `mask` reads [every earlier step's K/V |
    this step's]. The K/V of earlier steps live in `cache` (shared by the steps, as DeepSpec's growing KV
    cache), RoPE'd at their own step's positions."""

    cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def attend(self, layer, q, k, v, scale, backend):
        if layer in self.cache:
            k, v = torch.cat([self.cache[layer][0], k]), torch.cat([self.cache[layer][1], v])
        self.cache[layer] = (k, v)
        return super().attend(layer, q, k, v, scale, backend)


def ttt_mask(rows: torch.Tensor, seq_len: int, step: int) -> torch.Tensor:
    """[R, S + step R] bool: row t reads the step-0 rows <= t and its own chain's rows of steps 1..step."""
    t = torch.arange(seq_len, device=rows.device)
    same_row = torch.eye(len(rows), dtype=torch.bool, device=rows.device).repeat(1, step)
    return torch.cat([t[None, :] <= rows[:, None], same_row], dim=1)


def shift_left(x: torch.Tensor, n: int) -> torch.Tensor:
    """x[t + n] at t, zero past the end."""
    return torch.cat([x[n:], x.new_zeros(min(n, len(x)))])


def eagle3_training_forward(
    model: Eagle3DraftModel,
    input_ids: torch.Tensor,
    features: torch.Tensor,
    target_last_hidden: torch.Tensor,
    loss_mask: torch.Tensor,
    ttt_length: int = 7,
    max_rows: int | None = None,
    generator: torch.Generator | None = None,
    vocab: torch.Tensor | None = None,
) -> TTTOutput:
    """input_ids, loss_mask [S]; features [S, n_f H] (target layer outputs); target_last_hidden [S, H]
    (the target's final-normed hidden states). Unrolls the rows with a supervised step, or `max_rows` of
    them drawn uniformly; step 0 runs over every row, the context all chains read. `vocab`: the token ids
    the logits score (None: all)."""
    seq_len = len(input_ids)
    t = torch.arange(seq_len, device=input_ids.device)
    mask_0 = loss_mask.bool().clone()
    mask_0[-1] = False
    mask = torch.stack([shift_left(mask_0, step) for step in range(ttt_length)], dim=1)
    candidates = torch.nonzero(mask.any(1)).flatten()
    rows = candidates if max_rows is None else choose(candidates, max_rows, generator)
    hidden = model.project_context(features.to(model.fc.weight.dtype))
    cache: dict = {}
    logits = []
    queries = t
    for step in range(ttt_length):
        batch = TTTDraftBatch(queries + step, queries + step, ttt_mask(queries, seq_len, step), cache)
        hidden = model(shift_left(input_ids, step + 1)[queries], hidden, batch)
        if step == 0:
            hidden, queries = hidden[rows], rows
        logits.append(model.compute_logits(model.final_hidden(hidden), vocab))
    aligned = rows[:, None] + torch.arange(1, ttt_length + 1, device=t.device)
    # sum over R sampled rows * (candidates / R) estimates the sum over all candidates (exact when R = all)
    normaliser = seq_len * max(len(rows), 1) / max(len(candidates), 1)
    return TTTOutput(
        rows,
        torch.stack(logits, dim=1),
        target_logits(model, target_last_hidden, aligned, vocab),
        mask[rows],
        normaliser,
    )
