"""The training form of a DSpark/DFlash drafter on one sequence: every sampled block at once.

One backbone pass over [context rows | all blocks] with DeepSpec's block mask (`dense_block_batch`); the
Markov head is teacher-forced (slot i conditions on the true token before it), confidences read the same
previous tokens, and the aligned target distribution of slot i is the target's logits at position a+i,
through the drafter's frozen LM head (and Gemma's softcap), exactly as at inference.

The 150k-row LM head is nearly all of a step's cost, so the losses may score only a training vocabulary
(`vocab`: the tokens the data ever supervises, a few thousand): both distributions are then the ones
conditioned on that vocabulary. Inference always scores the whole vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.models.base import CausalLM
from specserve.spec_decode.deepspec.checkpoint import DraftModel
from specserve.spec_decode.deepspec.dspark import DSparkDraftModel, dense_block_batch
from specserve.train.anchors import Blocks, make_blocks, sample_anchors
from specserve.worker.model_runner import ModelRunner, PieceInput


@dataclass
class TrainingOutput:
    draft_logits: torch.Tensor  # [A, B, V'] with the Markov bias (V' = the scored vocabulary)
    target_logits: torch.Tensor  # [A, B, V']
    confidence_logits: torch.Tensor | None  # [A, B]
    blocks: Blocks
    labels: torch.Tensor  # [A, B]: the label's index among the scored logits


def vocabulary_index(vocab: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[vocab_size]: each token's index in `vocab` (0 for tokens outside it, which only masked slots see)."""
    index = torch.zeros(vocab_size, dtype=torch.long)
    index[vocab] = torch.arange(len(vocab))
    return index


def dspark_training_forward(
    model: DSparkDraftModel,
    input_ids: torch.Tensor,
    features: torch.Tensor,
    target_last_hidden: torch.Tensor,
    loss_mask: torch.Tensor,
    num_anchors: int,
    generator: torch.Generator | None = None,
    vocab: torch.Tensor | None = None,
) -> TrainingOutput:
    """input_ids, loss_mask [S]; features [S, n_f H] (target layer outputs); target_last_hidden [S, H]
    (the target's final-normed hidden states); `vocab` [V'] the token ids to score (None: all)."""
    config = model.config
    B, seq_len = config.block_size, len(input_ids)
    anchors, keep = sample_anchors(loss_mask, num_anchors, generator)
    blocks = make_blocks(input_ids, loss_mask, anchors, keep, B)
    block_ids = torch.full((num_anchors, B), config.mask_token_id)
    block_ids[:, 0] = torch.where(keep, input_ids[anchors], config.mask_token_id)  # dummies: all mask
    batch = dense_block_batch([seq_len], [anchors.tolist()], B)
    context = model.project_context(features.to(model.fc.weight.dtype))
    h = model.backbone(model.embed(block_ids.reshape(-1)), context, batch).view(num_anchors, B, -1)
    logits = model.compute_logits(h, vocab)
    if model.markov_head is not None:
        logits = logits + model.markov_head.block_bias(blocks.prev_tokens, h, vocab).float()
    confidence = model.confidence_logits(h, blocks.prev_tokens)
    aligned = (anchors[:, None] + torch.arange(B)).clamp(max=seq_len - 1)
    labels = blocks.labels if vocab is None else vocabulary_index(vocab, config.vocab_size)[blocks.labels]
    target = target_logits(model, target_last_hidden, aligned, vocab)
    return TrainingOutput(logits, target, confidence, blocks, labels)


@torch.no_grad()
def target_logits(
    model: DraftModel,
    target_last_hidden: torch.Tensor,
    positions: torch.Tensor,
    vocab: torch.Tensor | None = None,
) -> torch.Tensor:
    """The target's logits [..., V] (or over `vocab` [V']) at `positions` [...] through the drafter's frozen
    LM head (and Gemma's softcap), as the drafter scores them at inference. Positions past the end get zero
    logits: a uniform target (DeepSpec's padding), which only masked rows ever see."""
    seq_len = len(target_last_hidden)
    # overlapping blocks (and EAGLE-3's chains) share positions: the LM head scores each once
    unique, inverse = positions.clamp(max=seq_len - 1).unique(return_inverse=True)
    logits = model.compute_logits(target_last_hidden[unique].to(model.fc.weight.dtype), vocab)[inverse]
    return logits.masked_fill((positions >= seq_len)[..., None], 0.0)


def target_features(
    target: CausalLM, token_ids: list[int], layer_ids: list[int], block_size: int = 16
) -> tuple[torch.Tensor, torch.Tensor]:
    """(features [S, n_f H] = the listed layers' outputs concatenated, final-normed hidden [S, H]) of one
    sequence, from one forward of the target through a private paged cache."""
    num_blocks = -(-len(token_ids) // block_size)
    runner = ModelRunner(target, num_blocks, block_size, next(target.parameters()).dtype)
    out = runner.forward([PieceInput(token_ids, 0, list(range(num_blocks)))], [], capture_layers=layer_ids)
    # clones made outside inference mode are ordinary tensors that autograd may read
    return torch.cat([out.captured[i] for i in layer_ids], dim=-1).clone(), out.hidden.clone()
