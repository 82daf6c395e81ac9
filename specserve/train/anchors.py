"""Anchor sampling and block targets for drafter training (DSPARK.md §5.4).

An anchor is a response token whose next token is supervised too (loss_mask at a and a+1): at inference the
first response token comes from the target's prefill, so it is never a label. Up to `num_anchors`
distinct anchors are drawn uniformly per sequence and sorted; missing ones are dummies (anchor 0, not
kept). Slot i of the block at anchor a is labelled with the token at a+i+1; its eval mask is
"inside the sequence, supervised, block kept", made prefix-contiguous along the block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Blocks:
    anchors: torch.Tensor  # [A] long, ascending among kept ones; dummies are 0
    keep: torch.Tensor  # [A] bool
    labels: torch.Tensor  # [A, B] long: token at anchor + i + 1 (clamped into the sequence)
    eval_mask: torch.Tensor  # [A, B] bool, prefix-contiguous
    prev_tokens: torch.Tensor  # [A, B] long: the anchor, then the labels of the previous slots


def sample_anchors(
    loss_mask: torch.Tensor, num_anchors: int, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(anchors [num_anchors], keep [num_anchors]) for one sequence's loss mask [S]."""
    mask = loss_mask.bool()
    chosen = choose(torch.nonzero(mask[:-1] & mask[1:]).flatten(), num_anchors, generator)
    anchors = torch.zeros(num_anchors, dtype=torch.long)
    keep = torch.zeros(num_anchors, dtype=torch.bool)
    anchors[: len(chosen)] = chosen
    keep[: len(chosen)] = True
    return anchors, keep


def choose(candidates: torch.Tensor, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """Up to n of `candidates`, uniformly without replacement (random keys, keep the smallest), ascending."""
    if len(candidates) > n:
        keys = torch.rand(len(candidates), generator=generator)
        candidates = candidates[keys.argsort()[:n]]
    return candidates.sort().values


def make_blocks(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    anchors: torch.Tensor,
    keep: torch.Tensor,
    block_size: int,
) -> Blocks:
    seq_len = len(input_ids)
    positions = anchors[:, None] + torch.arange(1, block_size + 1)  # [A, B] label positions
    inside = positions < seq_len
    clamped = positions.clamp(max=seq_len - 1)
    eval_mask = inside & loss_mask.bool()[clamped] & keep[:, None]
    eval_mask = torch.cumprod(eval_mask.long(), dim=1).bool()
    labels = input_ids[clamped]
    prev_tokens = torch.cat([input_ids[anchors][:, None], labels[:, :-1]], dim=1)
    return Blocks(anchors, keep, labels, eval_mask, prev_tokens)


def position_weights(block_size: int, gamma: float = 4.0) -> torch.Tensor:
    """exp(-i / gamma) for slots i = 0..B-1 (DeepSpec's loss_decay_gamma = 4)."""
    return torch.exp(-torch.arange(block_size, dtype=torch.float) / gamma)
