"""The DSpark training objective (DSPARK.md §5.5), DFlash's (cross-entropy only) and EAGLE-3's (§8.3).

With corrected draft logits z (Markov bias included), q = softmax(z), the target distribution p at the
same position, label y, eval mask m and slot weights w = m exp(-i / gamma), each term is a weighted mean
over all slots:
  L_ce   = sum w (-log q(y)) / sum w
  L_l1   = sum w ||q - p||_1 / sum w                      (the full L1 distance, 2 x TV)
  L_conf = sum w BCE(l, c*) / sum w,  c* = clamp(1 - ||q - p||_1 / 2, 0, 1), detached
and L = a_ce L_ce + a_l1 L_l1 + a_conf L_conf (DSpark 0.1 / 0.9 / 1.0; DFlash 1 / 0 / 0).
c* is the analytic acceptance probability of the slot's draft distribution, so the confidence head learns
P(accept | previous accepted). `slot_acceptance` reports it per slot (DeepSpec's training accept_rate@k).
EAGLE-3 distils the target's whole distribution instead: a soft cross-entropy per TTT step (`eagle3_loss`),
reporting the same per-step acceptance so that training logs read alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

DSPARK_WEIGHTS = (0.1, 0.9, 1.0)
DFLASH_WEIGHTS = (1.0, 0.0, 0.0)
EAGLE3_DECAY = 0.8  # step_loss_decay: TTT step k weighs decay^k


@dataclass
class LossTerms:
    total: torch.Tensor
    ce: torch.Tensor
    l1: torch.Tensor
    conf: torch.Tensor
    slot_acceptance: torch.Tensor  # [B]: mean analytic acceptance 1 - TV per slot over the eval mask
    weight_sum: torch.Tensor


def dspark_loss(
    draft_logits: torch.Tensor,
    target_logits: torch.Tensor,
    labels: torch.Tensor,
    eval_mask: torch.Tensor,
    slot_weights: torch.Tensor,
    confidence_logits: torch.Tensor | None = None,
    weights: tuple[float, float, float] = DSPARK_WEIGHTS,
) -> LossTerms:
    """draft/target logits [..., B, V]; labels, eval_mask [..., B]; slot_weights [B]."""
    log_q = draft_logits.float().log_softmax(-1)
    p = target_logits.float().softmax(-1)
    w = eval_mask.float() * slot_weights
    total_w = w.sum().clamp(min=1e-6)
    ce = -(log_q.gather(-1, labels[..., None]).squeeze(-1) * w).sum() / total_w
    distance, acceptance, per_slot = _acceptance(log_q, p, eval_mask)
    l1 = (distance * w).sum() / total_w
    if confidence_logits is not None:
        bce = F.binary_cross_entropy_with_logits(
            confidence_logits.float(), acceptance.detach(), reduction="none"
        )
        conf = (bce * w).sum() / total_w
    else:
        conf = torch.zeros((), device=draft_logits.device)
    a_ce, a_l1, a_conf = weights
    return LossTerms(a_ce * ce + a_l1 * l1 + a_conf * conf, ce, l1, conf, per_slot, total_w)


def eagle3_loss(
    draft_logits: torch.Tensor,
    target_logits: torch.Tensor,
    mask: torch.Tensor,
    normaliser: float,
    decay: float = EAGLE3_DECAY,
) -> LossTerms:
    """EAGLE-3's TTT objective: draft/target logits [R, K, V] (row t, step k), mask [R, K].

    `total` (= `ce`) = sum_k decay^k sum_t mask soft-CE(p, q) / normaliser: DeepSpec divides every step by
    the rows of the (one-sequence) batch, S, not by the masked count, so every sequence weighs the same.
    `l1` (a metric only) is the decay-weighted mean ||q - p||_1; there is no confidence term.
    """
    log_q = draft_logits.float().log_softmax(-1)
    p = target_logits.float().softmax(-1)
    w = mask.float() * decay ** torch.arange(mask.shape[-1], dtype=torch.float, device=mask.device)
    soft_ce = -(p * log_q).sum(-1)
    total = (soft_ce * w).sum() / normaliser
    distance, _, per_slot = _acceptance(log_q, p, mask)
    l1 = (distance.detach() * w).sum() / w.sum().clamp(min=1e-6)
    return LossTerms(total, total, l1, torch.zeros_like(l1), per_slot, torch.tensor(normaliser))


def _acceptance(
    log_q: torch.Tensor, p: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(||q - p||_1 [..., K], analytic acceptance 1 - TV [..., K], its masked mean per slot [K])."""
    distance = (log_q.exp() - p).abs().sum(-1)
    acceptance = (1 - 0.5 * distance).clamp(0, 1)
    m = mask.float()
    dims = tuple(range(m.dim() - 1))
    return distance, acceptance, (acceptance.detach() * m).sum(dims) / m.sum(dims).clamp(min=1)
