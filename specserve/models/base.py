"""What the engine needs from a target model, and the weight loading every model shares."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from specserve.layers.attention import KVCache
from specserve.layers.gated_deltanet import RecurrentState, RecurrentStateSpec
from specserve.layers.metadata import ForwardMetadata, StateCheckpoints

ALIGNMENT = 64  # bytes: torch's CPU allocator (c10 alignment)


@dataclass(frozen=True)
class LayerCacheSpec:
    """Shape of one layer's paged KV cache. A layer that reads another layer's cache has `shared_with`."""

    num_kv_heads: int
    head_dim: int
    sliding_window: int | None = None
    shared_with: int | None = None


class CausalLM(nn.Module):
    """Base of every target model.

    `forward` runs a flat batch (all pieces of a step concatenated) and returns the final-normed hidden
    states [N, H] plus the residual-stream outputs of the requested layers ({layer_id: [N, H]}; layer id -1
    is the embedding output that enters layer 0). Logits are computed separately, only for the rows that
    need them. Hybrid models (linear-attention layers) take a `RecurrentState` pool in those layers' places
    of `kv_caches`, and their `cache_specs()` give a `RecurrentStateSpec` there.
    """

    config: object
    weight_shard = None  # a models.sharding.WeightShard when the model is one rank's shard
    quantize_on_load = None  # a layers.quant.QuantizingLoad while a quantized load reads the checkpoint

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: ForwardMetadata,
        kv_caches: Sequence[KVCache | RecurrentState],
        capture_layers: Sequence[int] = (),
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def cache_specs(self) -> list[LayerCacheSpec | RecurrentStateSpec]:
        raise NotImplementedError

    @property
    def has_recurrent_state(self) -> bool:
        """Whether a layer keeps per-sequence recurrent state (the forward then needs meta.state_slots)."""
        return False

    def rollback_states(
        self, checkpoints: StateCheckpoints, caches: Sequence[KVCache | RecurrentState], keep: dict[int, int]
    ) -> None:
        """For each checkpointed piece p, set its slot's recurrent state in every linear-attention layer to
        the state after the first keep[p] tokens of the piece (1 <= keep[p] <= its length). KV caches need
        nothing: their rollback is a length change."""

    def input_embedding(self) -> nn.Embedding:
        """The token embedding table (unscaled); drafters share it instead of holding a copy."""
        return self.model.embed_tokens

    def output_layer(self) -> nn.Module:
        """The module mapping final hidden states to raw logits (before any softcap); drafters share it."""
        return self.lm_head

    def checkpoint_name_map(self, name: str) -> str | None:
        """Our parameter name for a checkpoint tensor name, or None to skip it. Override to rename."""
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], adopt: bool = False) -> None:
        """Copy checkpoint tensors into the parameters; every parameter must be filled exactly once.

        `adopt`: the tensors are the caller's to give away (read from a file for this load), so one that
        already has the parameter's dtype and owns its memory becomes the parameter's data instead of being
        copied: a load then never holds a second copy of its largest tensor (the embedding)."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for ckpt_name, tensor in weights:
            name = self.checkpoint_name_map(ckpt_name)
            if name is None:
                continue
            if name not in params:
                raise ValueError(
                    f"checkpoint tensor {ckpt_name!r} has no matching parameter in {type(self).__name__}"
                )
            param = params[name]
            if self.weight_shard is not None:  # tensor parallelism: this rank's part of the tensor
                tensor = self.weight_shard.cut(name, tensor)
            if tuple(param.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"checkpoint tensor {ckpt_name!r} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(param.shape)}"
                )
            quantize = self.quantize_on_load
            if quantize is not None and quantize(self, name, tensor, param.dtype):
                loaded.add(name)
                continue
            with torch.no_grad():
                if adopt and _adoptable(tensor) and tensor.dtype == param.dtype:
                    param.data = tensor
                else:
                    param.copy_(tensor)
            loaded.add(name)
        missing = sorted(set(params) - loaded - self.tied_parameter_names())
        if missing:
            raise ValueError(
                f"checkpoint is missing tensors: {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}"
            )
        self.tie_weights()

    def tied_parameter_names(self) -> set[str]:
        """Parameters filled by `tie_weights` rather than by the checkpoint."""
        return set()

    def tie_weights(self) -> None:
        """Called after loading; models with tied embeddings alias lm_head to the embedding here."""


def _adoptable(t: torch.Tensor) -> bool:
    """Its storage is exactly its elements (not a piece of a larger buffer, which adopting would keep
    alive), aligned as torch's CPU allocator aligns (MKL rounds differently by the alignment of its
    operands: a parameter must not take whatever alignment a file reader left it; safetensors' tensors
    start 40 bytes past a 64-byte line, so those are copied)."""
    whole = t.untyped_storage().nbytes() == t.numel() * t.element_size()
    return whole and t.storage_offset() == 0 and t.is_contiguous() and t.data_ptr() % ALIGNMENT == 0
