"""MTP: a Qwen3-Next / Qwen3.5 target drafts for itself with the multi-token-prediction layer its
checkpoint ships (`mtp.*`, `models/qwen3_next.py`'s MultiTokenPredictor), as vLLM's `mtp` method does.

It drafts like EAGLE-3 (`eagle3.py`, whose loop it reuses): the draft cache holds one row per committed
position t before the anchor, pairing the target's final hidden state at t with the token at t+1; the
newest row predicts d1, and each further draft feeds the layer's own output back with the token just
drafted, one position further (the layer applied recursively). The features are the target's last layer
outputs, through the target's own final norm: its final hidden states.
"""

from __future__ import annotations

import torch
from torch import nn

from specserve.config import SpecserveError, SpeculativeConfig
from specserve.models.prepare import prepare_model
from specserve.models.qwen3_next import HybridQwenForCausalLM, MultiTokenPredictor, no_mtp_layer
from specserve.models.weight_files import iter_checkpoint_tensors
from specserve.spec_decode.context import TargetContext
from specserve.spec_decode.deepspec.dspark import PagedDraftBatch
from specserve.spec_decode.drafters.eagle3 import Eagle3Drafter
from specserve.spec_decode.drafters.hidden_states import DrafterLayout


class MTPDraftModel(nn.Module):
    """The predictor with the target's embedding, final norm and LM head: the calls Eagle3Drafter makes."""

    def __init__(self, predictor: MultiTokenPredictor, target: HybridQwenForCausalLM):
        super().__init__()
        self.predictor = predictor
        self._target = (target,)  # shared, not a submodule: its weights stay the target's
        self.hidden_size = target.config.hidden_size

    def project_context(self, features: torch.Tensor) -> torch.Tensor:
        """The target's last layer outputs [n, H] -> its final hidden states."""
        return self._target[0].model.norm(features)

    def forward(self, token_ids: torch.Tensor, hidden: torch.Tensor, batch: PagedDraftBatch) -> torch.Tensor:
        embeds = self._target[0].input_embedding()(token_ids)
        return self.predictor(embeds, hidden, batch.block_pos, batch.meta, batch.caches[0])

    def final_hidden(self, out: torch.Tensor) -> torch.Tensor:
        return out  # already normed: the same tensor is the logits' input and the next step's hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._target[0].compute_logits(hidden)

    def target_vocab_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return logits  # the target's own vocabulary


class MTPDrafter(Eagle3Drafter):
    @classmethod
    def from_config(cls, spec: SpeculativeConfig, target: TargetContext) -> MTPDrafter:
        if not isinstance(target.model, HybridQwenForCausalLM):
            raise SpecserveError(
                "method 'mtp' drafts with the multi-token-prediction layer of a Qwen3-Next / Qwen3.5 "
                f"checkpoint, or with a Gemma 4 assistant given as 'model'; this target is a "
                f"{type(target.model).__name__}"
            )
        weights = list(iter_checkpoint_tensors(target.model_dir, prefix="mtp."))
        if not weights:
            raise SpecserveError(no_mtp_layer(target.model_name))
        predictor = MultiTokenPredictor(target.model_config)
        predictor.load_weights(weights)
        predictor.to(target.torch_dtype).eval()
        prepare_model(predictor, spec.quantization, platform=target.platform)
        attention = predictor.layers[0].self_attn
        hidden = target.model_config.hidden_size
        layout = DrafterLayout(
            capture_layers=(target.model_config.num_hidden_layers - 1,),
            feature_width=hidden,
            num_layers=1,
            num_kv_heads=attention.num_kv_heads,
            head_dim=attention.head_dim,
        )
        k = spec.num_speculative_tokens or 1
        return cls(MTPDraftModel(predictor, target.model), target, k, layout, default_num_tokens=1)
