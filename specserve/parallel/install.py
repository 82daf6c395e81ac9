"""A rank's shard of the model joined to its group: every decoder layer's partial blocks summed across ranks,
and the embedding and the LM head made whole again (`vocab.py`)."""

from __future__ import annotations

from torch import nn

from specserve.models.sharding import PARTIAL_BLOCKS
from specserve.parallel.group import TensorParallelGroup
from specserve.parallel.vocab import VocabParallelEmbedding, VocabParallelHead


def install_collectives(model: nn.Module, group: TensorParallelGroup) -> None:
    """Call after quantizing and packing (they replace linear layers)."""
    for layer in model.model.layers:
        for name in PARTIAL_BLOCKS:
            block = getattr(layer, name, None)
            if isinstance(block, nn.Module):
                block.register_forward_hook(lambda _m, _in, out: group.all_reduce(out))
    vocab = model.config.vocab_size
    embedding = VocabParallelEmbedding(model.model.embed_tokens, model.vocab_start, vocab, group)
    model.model.embed_tokens = embedding
    model.lm_head = head = VocabParallelHead(model.lm_head, vocab, group)
    group.handlers.update(embed=embedding, embed_weight=embedding.gather_weight)
    group.handlers.update(head=head, head_weight=head.gather_weight)
