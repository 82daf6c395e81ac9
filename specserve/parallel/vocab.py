"""The embedding and the LM head split over the vocabulary: each rank holds rows [start, start + rows).

Both return whole tensors on every rank: the embedding looks up the ids it holds (zeros elsewhere) and
all-reduces, which adds only zeros to each row, so it is exact; the head computes its shard of the logits
and all-gathers the rows asked for. Called on the driver outside a command (a drafter sharing the
target's embedding or head), each runs as a command so that the workers take part.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from specserve.parallel.group import TensorParallelGroup


class VocabParallelEmbedding(nn.Module):
    def __init__(self, shard: nn.Embedding, start: int, vocab: int, group: TensorParallelGroup):
        super().__init__()
        self.shard = shard
        self.start, self.vocab = start, vocab
        self.group = group

    @property
    def weight(self) -> torch.Tensor:
        """The whole [vocab, hidden] table, gathered from every rank: for a drafter checking that its
        checkpoint's embedding is the target's (then it shares this module), not for every step."""
        return self.group.run("embed_weight")

    def gather_weight(self) -> torch.Tensor:
        rows = -(-self.vocab // self.group.shard.world_size)
        return _gather(self.shard.weight.detach(), 0, rows, self.vocab, self.group)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.group.in_command:
            return self.group.run("embed", ids)
        local = ids - self.start
        held = (local >= 0) & (local < self.shard.num_embeddings)
        rows = self.shard(torch.where(held, local, 0))
        return self.group.all_reduce(torch.where(held[..., None], rows, 0))


class VocabParallelHead(nn.Module):
    def __init__(self, shard: nn.Module, vocab: int, group: TensorParallelGroup):
        super().__init__()
        self.shard = shard
        self.vocab = vocab
        self.rows = -(-vocab // group.shard.world_size)  # every shard padded to this many for the gather
        self.group = group

    @property
    def weight(self) -> torch.Tensor:
        """The whole [vocab, hidden] weight, gathered (as the embedding's)."""
        return self.group.run("head_weight")

    def gather_weight(self) -> torch.Tensor:
        return _gather(self.shard.weight.detach(), 0, self.rows, self.vocab, self.group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.group.in_command:
            return self.group.run("head", x)
        return _gather(self.shard(x), -1, self.rows, self.vocab, self.group)


def _gather(local: torch.Tensor, dim: int, rows: int, vocab: int, group: TensorParallelGroup) -> torch.Tensor:
    """Every rank's vocabulary rows along `dim` -> all `vocab` of them; the last rank's may be short of
    `rows` (a vocabulary the world size does not divide): padded for the gather, cut after."""
    dim %= local.dim()
    short = rows - local.shape[dim]
    if short:
        local = F.pad(local, [0, 0] * (local.dim() - 1 - dim) + [0, short])
    return torch.cat(group.all_gather(local), dim=dim).narrow(dim, 0, vocab)
