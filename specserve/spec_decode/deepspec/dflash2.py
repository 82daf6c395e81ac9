"""DFlash2's additions to the DFlash backbone (z-lab; speculators' `dflash2`, vLLM's `qwen3_dflash2.py`):
a grouped two-sided dynamic convolution around each draft layer's attention and MLP, and a candidate
selector that re-scores each slot's top-k tokens by the token chosen before it.

Convolution: a sublayer's input x is convolved causally within its draft block (tap t reads the row t
slots earlier; taps before the block's start read nothing) with per-group coefficients base[0][t] +
delta_in[t], where (delta_in, delta_out) = kernel_projection(x) per row; the sublayer's output is convolved
the same way with base[1][t] + delta_out[t]. Rows must arrive as whole blocks, in slot order.

Selector: slot l's candidates are the top-k of its unary logits U_l; candidate c scores
U_l[c] + sum_r P[prev][r] * proj(h_l)[r] * S[c][r], prev being the token chosen at the slot before (the
anchor first). The drafter samples from those scores over the candidates only: every other token has
draft probability 0, which rejection sampling handles exactly.
"""

from __future__ import annotations

import torch
from torch import nn


class GroupedDynamicConv(nn.Module):
    """The input- and output-side convolutions of one sublayer (`base_kernel` [2, taps, H])."""

    def __init__(self, hidden_size: int, taps: int, group_size: int, block_size: int):
        super().__init__()
        if hidden_size % group_size:
            raise ValueError(f"conv_group_size {group_size} does not divide hidden_size {hidden_size}")
        self.taps, self.group_size, self.block_size = taps, group_size, block_size
        self.num_groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, taps, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * taps * self.num_groups, bias=False)

    def _convolve(self, x: torch.Tensor, delta: torch.Tensor, side: int) -> torch.Tensor:
        """x [N, H] (whole blocks), delta [N, taps, groups] -> [N, H]."""
        groups = x.unflatten(-1, (self.num_groups, self.group_size))
        coefficients = self.base_kernel[side].to(x.dtype).view(self.taps, self.num_groups, self.group_size)
        slot = torch.arange(x.shape[0], device=x.device) % self.block_size
        out = torch.zeros_like(groups)
        for tap in range(self.taps):
            shifted = torch.cat([groups.new_zeros(tap, *groups.shape[1:]), groups[: x.shape[0] - tap]])
            weight = coefficients[tap] + delta[:, tap, :, None].to(x.dtype)
            out = out + shifted * weight * (slot >= tap).view(-1, 1, 1).to(x.dtype)
        return out.flatten(-2)

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the sublayer's convolved input, the output side's kernel deltas)."""
        deltas = self.kernel_projection(x).view(x.shape[0], 2, self.taps, self.num_groups)
        return self._convolve(x, deltas[:, 0], 0), deltas[:, 1]

    def finish(self, y: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        return self._convolve(y, delta, 1)


class CandidateSelector(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)

    def candidate_scores(
        self, unary: torch.Tensor, h: torch.Tensor, prev: torch.Tensor, candidates: torch.Tensor
    ) -> torch.Tensor:
        """Scores [R, k] of `candidates` [R, k] given unary logits [R, V], hidden states [R, H] and the
        previous tokens [R]."""
        context = self.predecessor_codebook[prev] * self.hidden_projection(h).to(
            self.predecessor_codebook.dtype
        )
        transition = (context[:, None, :] * self.successor_codebook[candidates]).sum(-1)
        return unary.gather(-1, candidates) + transition.float()

    def restrict(self, unary: torch.Tensor, h: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """[R, V] logits: the top-k candidates' scores, -inf (probability 0) everywhere else."""
        candidates = unary.topk(self.top_k, dim=-1).indices
        out = torch.full_like(unary, float("-inf"))
        return out.scatter_(-1, candidates, self.candidate_scores(unary, h, prev, candidates))
