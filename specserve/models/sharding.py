"""Splitting a model across tensor-parallel ranks (Megatron-style), for every family the same way.

A rank's model is built from a *sharded config*: attention heads, KV heads, MLP and expert widths and Gated
DeltaNet heads divided by the world size. Its layers then have exactly their shard's shapes, and each
checkpoint tensor is cut to the parameter it fills while loading (`WeightShard`), one tensor at a time, so no
rank ever holds the whole model. Which dimension a tensor is split along is read off the shapes: the one where
the full model's parameter (built on the meta device) and the rank's differ. That makes q/k/v, gate/up and
in-projections column-parallel (output rows split) and o/down/out projections row-parallel (inputs split)
with no per-model table. Fused tensors made of several blocks (Gated DeltaNet's q|k|v) say so in
`tp_segments`, and each block is split on its own.

KV heads: with fewer KV heads than ranks, each rank keeps the one KV head its query heads read (replicated).
The residual stream stays whole on every rank: the outputs of the attention, linear-attention, MLP and MoE
blocks are partial sums, added across ranks (`all_reduce`) once per block (`PARTIAL_BLOCKS`). A row-parallel
bias is kept on rank 0 only, so it is added once. The embedding and the LM head are split over the
vocabulary (`parallel/vocab.py`).

Exactness: the sum of a block's partials is one more rounding than the single-process matmul, so logits
agree with TP=1 to fp32 rounding, not bitwise. Batch invariance holds at any world size (each rank's
kernels are batch invariant, and an all-reduce adds elementwise), so greedy speculation still equals greedy
decoding token for token.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from specserve.config import SpecserveError
from specserve.layers.meta_device import on_meta

# Config fields that count heads or channels split across ranks (top level and per-layer overrides).
SPLIT_FIELDS = (
    "num_attention_heads",
    "intermediate_size",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "linear_num_key_heads",
    "linear_num_value_heads",
)
# KV heads: split when there are at least as many as ranks, else one (replicated) per rank.
KV_FIELDS = ("num_key_value_heads", "num_global_key_value_heads")
# Children of a decoder layer whose output is a partial sum under TP (summed across ranks once).
PARTIAL_BLOCKS = ("self_attn", "linear_attn", "mlp", "experts")


@dataclass(frozen=True)
class Shard:
    rank: int
    world_size: int

    def piece(self, num_pieces: int) -> int:
        """Which of `num_pieces` equal pieces of a split dimension this rank holds (num_pieces divides the
        world size, or is a multiple of it: a replicated KV head serves world_size / num_pieces ranks)."""
        return self.rank * num_pieces // self.world_size


def _split(value: int, world_size: int, field: str, kv: bool) -> int:
    if kv and value < world_size:
        if world_size % value:
            raise SpecserveError(
                f"{field}={value} cannot be replicated over tensor_parallel_size={world_size}: "
                "the size must be a multiple of it"
            )
        return 1
    if value % world_size:
        raise SpecserveError(
            f"{field}={value} is not divisible by tensor_parallel_size={world_size}; choose a size "
            f"that divides it"
        )
    return value // world_size


def _shard_fields(fields: dict, world_size: int) -> None:
    for name in SPLIT_FIELDS + KV_FIELDS:
        value = fields.get(name)
        if isinstance(value, int) and value > 0:
            fields[name] = _split(value, world_size, name, name in KV_FIELDS)


def shard_config(config, world_size: int):
    """The config a rank's model is built from: split counts divided by `world_size` (head_dim kept)."""
    if world_size == 1:
        return config
    values = config.to_dict()
    if not values.get("head_dim") and values.get("num_attention_heads"):  # keep head_dim = hidden / heads
        values["head_dim"] = config.hidden_size // config.num_attention_heads
    _shard_fields(values, world_size)
    for overrides in (values.get("per_layer_config") or {}).values():  # Gemma 4's per-layer views
        _shard_fields(overrides, world_size)
    heads, kv = values["num_attention_heads"], values.get("num_key_value_heads")
    if kv and heads % kv:
        raise SpecserveError(
            f"tensor_parallel_size={world_size}: {heads} query heads per rank cannot share {kv} KV heads"
        )
    return type(config).from_dict(values)


class WeightShard:
    """Cuts full checkpoint tensors to one rank's parameters, while loading.

    `full_shapes` are the single-process model's parameter shapes, `local` the rank's model; a tensor whose
    shape is not the full one is an error (a wrong checkpoint), as without TP."""

    def __init__(self, shard: Shard, full_shapes: Mapping[str, torch.Size], local: nn.Module):
        self.shard = shard
        self.full_shapes = dict(full_shapes)
        self.local_shapes = {name: p.shape for name, p in local.named_parameters()}
        self.segments = _declared_segments(local)

    def cut(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        full, local = self.full_shapes.get(name), self.local_shapes.get(name)
        if full is None or local is None or tuple(tensor.shape) != tuple(full) or full == local:
            return tensor  # not ours to cut: the caller's checks report a mismatch
        dims = [d for d in range(len(full)) if full[d] != local[d]]
        if len(dims) != 1:
            raise SpecserveError(f"{name}: cannot split {tuple(full)} into {tuple(local)} (several dims)")
        dim = dims[0]
        num_pieces = full[dim] // local[dim]
        piece = self.shard.piece(num_pieces)
        blocks = self.segments.get(name, (local[dim],))
        parts = tensor.split([size * num_pieces for size in blocks], dim)
        cut = [part.narrow(dim, piece * size, size) for part, size in zip(parts, blocks, strict=True)]
        return (cut[0] if len(cut) == 1 else torch.cat(cut, dim)).contiguous()


def _declared_segments(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """{parameter name: its blocks' sizes along the split dimension, on this rank} from `tp_segments`."""
    found = {}
    for prefix, module in model.named_modules():
        for leaf, sizes in getattr(module, "tp_segments", {}).items():
            found[f"{prefix}.{leaf}" if prefix else leaf] = tuple(sizes)
    return found


def full_parameter_shapes(model_cls, config) -> dict[str, torch.Size]:
    """Parameter shapes of the unsharded model, built on the meta device (no memory)."""
    with on_meta():
        model = model_cls(config)
    return {name: p.shape for name, p in model.named_parameters()}


def finish_sharded_load(model: nn.Module, full_shapes: Mapping[str, torch.Size], shard: Shard) -> None:
    """After loading: row-parallel biases on rank 0 only, and the embedding and the LM head cut to this
    rank's vocabulary rows (a tied head shares the embedding's). Call before quantizing or packing."""
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and module.bias is not None and shard.rank:
            full = full_shapes.get(f"{name}.weight")
            if full is not None and full[1] != module.in_features:
                with torch.no_grad():
                    module.bias.zero_()
    embedding, head = model.input_embedding(), model.lm_head
    vocab = embedding.num_embeddings
    rows = -(-vocab // shard.world_size)
    start, stop = min(shard.rank * rows, vocab), min((shard.rank + 1) * rows, vocab)
    tied = head.weight.untyped_storage().data_ptr() == embedding.weight.untyped_storage().data_ptr()
    local_embedding = nn.Embedding(stop - start, embedding.embedding_dim, device="meta")
    local_embedding.weight = _rows_of(embedding.weight, start, stop)
    local_head = nn.Linear(head.in_features, stop - start, bias=False, device="meta")
    local_head.weight = local_embedding.weight if tied else _rows_of(head.weight, start, stop)
    model.model.embed_tokens, model.lm_head = local_embedding, local_head
    model.vocab_start = start


def _rows_of(weight: torch.Tensor, start: int, stop: int) -> nn.Parameter:
    """A copy of the rows (a view would keep the whole table alive)."""
    return nn.Parameter(weight.detach()[start:stop].clone(), requires_grad=False)
