"""Sparse mixture-of-experts feed-forward: top-k routing and a flat-batch expert dispatch.

Tokens are grouped by expert (one sort), each expert that received tokens runs once over its rows, and the
weighted results are added back with index_add: one Python iteration per *active expert*, never per token.
"""

from __future__ import annotations

import torch
from torch import nn

from specserve.layers.mlp import GatedMLP


def route_topk(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over experts in fp32, keep the top k: (weights [N, k] in the logits' dtype, ids [N, k])."""
    probs = router_logits.float().softmax(dim=-1)
    weights, ids = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids


class Experts(nn.ModuleList):
    """Expert MLPs, named `{e}.gate_proj.weight` etc. as in HF checkpoints."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, act: str = "silu"):
        super().__init__(GatedMLP(hidden_size, intermediate_size, act) for _ in range(num_experts))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [N, H]; weights, ids [N, k] -> sum_j weights[:, j] * expert_{ids[:, j]}(x)  [N, H]."""
        top_k = ids.shape[1]
        flat_ids = ids.flatten()
        order = flat_ids.argsort(stable=True)
        counts = torch.bincount(flat_ids, minlength=len(self)).tolist()
        token_of = order // top_k
        weight_of = weights.flatten()[order]
        out = torch.zeros_like(x)
        start = 0
        for expert, count in zip(self, counts, strict=True):
            if count:
                rows = token_of[start : start + count]
                y = expert(x[rows]) * weight_of[start : start + count, None]
                out.index_add_(0, rows, y.to(out.dtype))
            start += count
        return out
