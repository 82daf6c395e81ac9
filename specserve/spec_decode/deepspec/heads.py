"""DSpark's sequential heads: a Markov (or gated / RNN) transition bias over the parallel backbone's logits,
and the confidence head that predicts, per slot, the chance that the drafted token survives verification.

Parameter names and shapes are DeepSpec's (`markov_head.markov_w1.weight` [V, r], `markov_w2.weight` [V, r],
`gate_proj` / `joint_proj`, `confidence_head.proj`), so checkpoints load 1:1.

Every head is driven one slot at a time by `transition(prev, h, state)`: `prev` is the token chosen at the
previous slot (the anchor for slot 0), `h` the backbone's hidden state of this slot; the bias is markov_w2
of its rank-r output. The engine samples left to right with `step`; training unrolls the same `transition`
over teacher-forced labels (`block_bias`), so the two can never disagree.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")


class MarkovHead(nn.Module):
    """bias(prev) = markov_w2.weight @ W1[prev]: a rank-r bigram correction of the base logits."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int, output_vocab_size: int | None = None):
        """W1 reads the previous token (any of the target's vocabulary), W2 writes the drafter's output
        vocabulary (a pruned one when `output_vocab_size` says)."""
        super().__init__()
        self.rank = rank
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, output_vocab_size or vocab_size, bias=False)

    def prev_features(self, prev: torch.Tensor) -> torch.Tensor:
        """W1[prev] [..., r]: also the confidence head's Markov input."""
        return self.markov_w1(prev)

    def initial_state(self, batch: int, like: torch.Tensor) -> torch.Tensor | None:
        return None

    def transition(
        self, prev: torch.Tensor, h: torch.Tensor, state: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the bias's rank-r input [R, r], next state) for one slot of R blocks."""
        return self.prev_features(prev), state

    def step(
        self, prev: torch.Tensor, h: torch.Tensor, state: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(bias [R, V], next state) for one slot of R blocks."""
        z, state = self.transition(prev, h, state)
        return self.markov_w2(z), state

    def block_bias(
        self, prev: torch.Tensor, h: torch.Tensor, rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Teacher-forced bias for whole blocks: prev [M, B], h [M, B, H] -> [M, B, V], or only the vocabulary
        `rows` [V'] -> [M, B, V']."""
        state = self.initial_state(prev.shape[0], h)
        out = []
        for i in range(prev.shape[1]):
            z, state = self.transition(prev[:, i], h[:, i], state)
            out.append(z)
        weight = self.markov_w2.weight if rows is None else self.markov_w2.weight[rows]
        return F.linear(torch.stack(out, dim=1), weight)


class GatedMarkovHead(MarkovHead):
    """bias = W2 (g * W1[prev]), g = sigmoid(gate_proj([h; W1[prev]])): the hidden state gates the bigram."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int, output_vocab_size: int | None = None):
        super().__init__(vocab_size, hidden_size, rank, output_vocab_size)
        self.gate_proj = nn.Linear(hidden_size + rank, rank)

    def transition(self, prev, h, state):
        w1 = self.prev_features(prev)
        gate = torch.sigmoid(self.gate_proj(torch.cat([h, w1.to(h.dtype)], dim=-1)))
        return gate * w1, state


class RNNMarkovHead(MarkovHead):
    """A GRU-like state carried across the slots of one block (reset to zero at slot 0).

    joint_proj([s; W1[prev]; h]) splits into (gate, candidate, output); s' = g*s + (1-g)*tanh(candidate);
    bias = W2 tanh(output).
    """

    def __init__(self, vocab_size: int, hidden_size: int, rank: int, output_vocab_size: int | None = None):
        super().__init__(vocab_size, hidden_size, rank, output_vocab_size)
        self.joint_proj = nn.Linear(2 * rank + hidden_size, 3 * rank)

    def initial_state(self, batch: int, like: torch.Tensor) -> torch.Tensor:
        return like.new_zeros(batch, self.rank)

    def transition(self, prev, h, state):
        w1 = self.prev_features(prev)
        joint = self.joint_proj(torch.cat([state, w1.to(h.dtype), h], dim=-1))
        gate, candidate, output = joint.chunk(3, dim=-1)
        gate = torch.sigmoid(gate)
        state = gate * state + (1 - gate) * torch.tanh(candidate)
        return torch.tanh(output), state


def build_markov_head(
    kind: str, vocab_size: int, hidden_size: int, rank: int, output_vocab_size: int | None = None
) -> MarkovHead:
    heads = {"vanilla": MarkovHead, "gated": GatedMarkovHead, "rnn": RNNMarkovHead}
    if kind not in heads:
        raise ValueError(f"markov_head_type must be one of {', '.join(heads)}, got {kind!r}")
    return heads[kind](vocab_size, hidden_size, rank, output_vocab_size)


class ConfidenceHead(nn.Module):
    """One logit per slot: P(this slot's draft is accepted | every earlier draft was accepted).

    Input [h_i; W1[prev_i]] when `with_markov` (prev_i as for the Markov bias), else h_i alone.
    """

    def __init__(self, hidden_size: int, markov_rank: int = 0):
        super().__init__()
        self.proj = nn.Linear(hidden_size + markov_rank, 1)

    def forward(self, h: torch.Tensor, prev_features: torch.Tensor | None = None) -> torch.Tensor:
        x = h if prev_features is None else torch.cat([h, prev_features.to(h.dtype)], dim=-1)
        return self.proj(x).squeeze(-1).float()
