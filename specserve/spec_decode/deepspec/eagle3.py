"""The EAGLE-3 draft network as DeepSpec trains it (DSPARK.md §8.3): one decoder layer, autoregressive.

Row t pairs the target's projected features at position t with the token at t+1, at RoPE position t, and
predicts the token at t+2. The layer's attention reads [input_layernorm(embedding); hidden_norm(hidden)]
(2H wide), its residual is the incoming hidden state, and its pre-norm output is fed back as the hidden
state of the next drafting step. Attention is causal over the request's draft cache.
"""

from __future__ import annotations

import torch
from torch import nn

from specserve.spec_decode.deepspec.config import Eagle3Config
from specserve.spec_decode.deepspec.dspark import DraftBatch, DraftLayer, TokenIO, _norm, draft_rotary


class Eagle3Layer(DraftLayer):
    def __init__(self, config: Eagle3Config, rotary):
        super().__init__(config, 0, rotary, attn_in=2 * config.hidden_size)
        self.hidden_norm = _norm(config, config.hidden_size)
        self.norm_before_residual = config.norm_before_residual

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, batch: DraftBatch) -> torch.Tensor:
        normed = self.hidden_norm(hidden)
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)  # embedding first
        residual = normed if self.norm_before_residual else hidden
        return self.residual_and_mlp(residual, self.self_attn(x, None, batch))


class Eagle3DraftModel(TokenIO, nn.Module):
    def __init__(self, config: Eagle3Config):
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.rotary = draft_rotary(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, hidden)
        self.fc = nn.Linear(len(config.target_layer_ids) * hidden, hidden, bias=False)
        self.layers = nn.ModuleList([Eagle3Layer(config, self.rotary)])
        self.norm = _norm(config, hidden)
        self.lm_head = nn.Linear(hidden, config.output_vocab_size, bias=False)
        self.set_output_scaling(config)

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    def project_context(self, features: torch.Tensor) -> torch.Tensor:
        """Target features [n, n_f * H] -> hidden inputs [n, H] (normed inside the layer)."""
        return self.fc(features)

    def forward(self, token_ids: torch.Tensor, hidden: torch.Tensor, batch: DraftBatch) -> torch.Tensor:
        """Pre-norm outputs [n, H]: fed back as the next step's hidden; `final_hidden` gives the logits."""
        return self.layers[0](self.embed(token_ids), hidden, batch)

    def final_hidden(self, out: torch.Tensor) -> torch.Tensor:
        return self.norm(out)
