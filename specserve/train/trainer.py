"""Drafter training loop: AdamW with linear warmup and cosine decay, gradient clipping, the drafter's own
objective (DSpark / DFlash: sampled blocks; EAGLE-3: training-time test over the whole sequence),
checkpoints in DeepSpec's format plus a training state to resume from.

Determinism: sample order comes from (seed, epoch) and each sample's anchors from (seed, step, index), so
resuming from a checkpoint continues exactly as an uninterrupted run would (tested bit for bit on CPU).
The embedding and LM head are the target's and stay frozen. With a training vocabulary (`vocab`), the
losses score only those tokens' rows of the LM head (train/forward.py says why).

Several processes (torch.distributed, e.g. gloo on CPU or nccl on GPUs): each rank takes every
world_size-th sample of the global batch, scales its losses by 1 / global batch, and the gradients are
summed across ranks before clipping, so every rank takes the step one process would take on the whole batch.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from specserve.config import SpecserveError, check
from specserve.spec_decode.deepspec.checkpoint import DraftModel, load_draft_checkpoint, save_draft_checkpoint
from specserve.spec_decode.deepspec.eagle3 import Eagle3DraftModel
from specserve.train.anchors import position_weights
from specserve.train.eagle3 import eagle3_training_forward
from specserve.train.forward import dspark_training_forward
from specserve.train.losses import DFLASH_WEIGHTS, DSPARK_WEIGHTS, LossTerms, dspark_loss, eagle3_loss

STATE_FILE = "training_state.pt"
CANNOT_RESUME = (
    f"so the run cannot resume: train into another --output, or remove {STATE_FILE} to start anew there"
)


@dataclass
class TrainConfig:
    total_steps: int
    batch_size: int = 1  # sequences per optimizer step
    lr: float = 6e-4
    weight_decay: float = 0.0
    warmup_ratio: float = 0.04
    grad_clip: float = 1.0
    num_anchors: int = 512  # per sequence: DSpark / DFlash blocks, EAGLE-3 TTT chains (rows)
    loss_decay_gamma: float = 4.0  # DSpark / DFlash slot weights
    seed: int = 42

    def __post_init__(self) -> None:
        check(self.total_steps >= 1, f"steps must be >= 1, got {self.total_steps}")
        check(self.batch_size >= 1, f"batch_size must be >= 1, got {self.batch_size}")
        check(math.isfinite(self.lr) and self.lr > 0, f"lr must be finite and > 0, got {self.lr}")
        check(self.num_anchors >= 1, f"num_anchors must be >= 1, got {self.num_anchors}")


@dataclass
class Sample:
    """One training sequence with the target's view of it (from the target cache)."""

    input_ids: torch.Tensor  # [S] long
    loss_mask: torch.Tensor  # [S]
    features: torch.Tensor  # [S, n_f H]
    last_hidden: torch.Tensor  # [S, H] final-normed


def learning_rate(step: int, config: TrainConfig) -> float:
    """Linear warmup to `lr` over warmup_ratio of the steps, then cosine annealing to 0."""
    warmup = max(1, int(config.warmup_ratio * config.total_steps))
    if step < warmup:
        return config.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, config.total_steps - warmup)
    return config.lr * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def trainable_parameters(model: DraftModel) -> list[torch.nn.Parameter]:
    frozen = {id(p) for p in (*model.embed_tokens.parameters(), *model.lm_head.parameters())}
    return [p for p in model.parameters() if id(p) not in frozen]


class Trainer:
    def __init__(
        self,
        model: DraftModel,
        samples: Sequence[Sample],
        config: TrainConfig,
        vocab: torch.Tensor | None = None,
    ):
        if type(model.lm_head) is not torch.nn.Linear:
            # The target's inference layer (oneDNN-packed) has no autograd: gradients would silently stop
            # there. Train through a plain frozen copy of the same weight.
            weight = model.lm_head.weight.detach()
            model.lm_head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
            model.lm_head.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.model = model
        self.samples = samples
        self.config = config
        self.vocab = vocab
        self.params = trainable_parameters(model)
        for p in model.parameters():
            p.requires_grad_(False)
        for p in self.params:
            p.requires_grad_(True)
        self.optimizer = torch.optim.AdamW(self.params, lr=config.lr, weight_decay=config.weight_decay)
        self.eagle3 = isinstance(model, Eagle3DraftModel)
        # draft positions with an acceptance estimate: EAGLE-3's TTT steps or DSpark's block slots
        self.num_slots = model.config.ttt_length if self.eagle3 else model.config.block_size
        self.step_index = 0
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        self.rank = torch.distributed.get_rank() if distributed else 0
        self.world_size = torch.distributed.get_world_size() if distributed else 1

    def sample_indices(self, step: int) -> list[int]:
        """The samples of optimizer step `step`: a seeded permutation per epoch, read in order."""
        n, size = len(self.samples), self.config.batch_size
        out = []
        for i in range(step * size, (step + 1) * size):
            epoch, offset = divmod(i, n)
            order = torch.randperm(n, generator=torch.Generator().manual_seed(self.config.seed + epoch))
            out.append(int(order[offset]))
        return out

    def step(self) -> dict:
        """One optimizer step; returns the loss terms and the per-slot analytic acceptance."""
        self.model.train()
        lr = learning_rate(self.step_index, self.config)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        logs = {"ce": 0.0, "l1": 0.0, "conf": 0.0, "loss": 0.0}
        acceptance = torch.zeros(self.num_slots)
        indices = self.sample_indices(self.step_index)
        for j in range(self.rank, len(indices), self.world_size):
            generator = torch.Generator().manual_seed(
                self.config.seed * 1_000_003 + self.step_index * 1009 + j
            )
            terms = self.sample_loss(self.samples[indices[j]], generator)
            (terms.total / len(indices)).backward()
            for key, value in (
                ("ce", terms.ce),
                ("l1", terms.l1),
                ("conf", terms.conf),
                ("loss", terms.total),
            ):
                logs[key] += float(value.detach()) / len(indices)
            acceptance += terms.slot_acceptance / len(indices)
        if self.world_size > 1:
            self._sum_across_ranks(logs, acceptance)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.config.grad_clip)
        self.optimizer.step()
        self.step_index += 1
        # tau estimate from the analytic conditional acceptance: 1 + sum_k prod_{j<=k} acc_j
        tau = 1 + float(torch.cumprod(acceptance, 0).sum())
        return {
            **logs,
            "lr": lr,
            "grad_norm": float(grad_norm),
            "tau": tau,
            "acceptance": acceptance.tolist(),
        }

    def sample_loss(self, s: Sample, generator: torch.Generator) -> LossTerms:
        """The drafter's objective on one sample (anchors or TTT rows are drawn from `generator`)."""
        model = self.model
        if self.eagle3:
            out = eagle3_training_forward(
                model,
                s.input_ids,
                s.features,
                s.last_hidden,
                s.loss_mask,
                model.config.ttt_length,
                self.config.num_anchors,
                generator,
                self.vocab,
            )
            return eagle3_loss(out.draft_logits, out.target_logits, out.mask, out.normaliser)
        out = dspark_training_forward(
            model,
            s.input_ids,
            s.features,
            s.last_hidden,
            s.loss_mask,
            self.config.num_anchors,
            generator,
            self.vocab,
        )
        has_heads = model.markov_head is not None or model.confidence_head is not None
        return dspark_loss(
            out.draft_logits,
            out.target_logits,
            out.labels,
            out.blocks.eval_mask,
            position_weights(model.config.block_size, self.config.loss_decay_gamma),
            out.confidence_logits,
            DSPARK_WEIGHTS if has_heads else DFLASH_WEIGHTS,
        )

    def _sum_across_ranks(self, logs: dict, acceptance: torch.Tensor) -> None:
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            torch.distributed.all_reduce(p.grad)
        totals = torch.tensor([logs[k] for k in sorted(logs)])
        torch.distributed.all_reduce(totals)
        logs.update(zip(sorted(logs), totals.tolist()))
        torch.distributed.all_reduce(acceptance)

    def save(self, directory: str | Path) -> Path:
        """The drafter (DeepSpec format) and the state to resume from."""
        directory = save_draft_checkpoint(self.model, directory)
        torch.save(
            {
                "step": self.step_index,
                "optimizer": self.optimizer.state_dict(),
                "config": asdict(self.config),
                "vocab": self.vocab,
            },
            directory / STATE_FILE,
        )
        return directory

    @staticmethod
    def saved_config(directory: str | Path) -> TrainConfig:
        """The TrainConfig of the run saved in `directory` (its tensors memory-mapped, not read)."""
        return load_state(directory, mmap=True)["config"]

    @classmethod
    def resume(cls, directory: str | Path, target, target_config, samples: Sequence[Sample]) -> Trainer:
        directory = Path(directory)
        state = load_state(directory)
        model = load_draft_checkpoint(str(directory), target, target_config)
        trainer = cls(model, samples, state["config"], state.get("vocab"))
        try:
            trainer.optimizer.load_state_dict(state["optimizer"])
        except (KeyError, TypeError, ValueError) as exc:  # an optimizer state of another drafter, or edited
            raise _damaged(directory, f"its optimizer state does not fit the drafter ({exc})") from None
        trainer.step_index = state["step"]
        return trainer


def _damaged(directory: str | Path, what: str) -> SpecserveError:
    return SpecserveError(f"{Path(directory) / STATE_FILE} is damaged: {what}, {CANNOT_RESUME}")


def load_state(directory: str | Path, mmap: bool = False) -> dict:
    """The training state saved in `directory` (its tensors memory-mapped if `mmap`), its config a
    TrainConfig. A damaged one (cut short, overwritten, edited) is refused naming the file: no traceback."""
    try:
        state = torch.load(Path(directory) / STATE_FILE, weights_only=True, mmap=mmap)
    except Exception as exc:  # by the damage: RuntimeError, UnpicklingError, EOFError, KeyError... whose
        # text (re-run with weights_only=False, save with the zip format) would mislead
        raise _damaged(directory, f"torch cannot read it ({type(exc).__name__})") from None
    kinds = {"step": int, "optimizer": dict, "config": dict, "vocab": (torch.Tensor, type(None))}
    if not isinstance(state, dict) or not all(isinstance(state.get(k), t) for k, t in kinds.items()):
        raise _damaged(directory, "not a dict of step, optimizer, config and vocab")
    try:
        return {**state, "config": TrainConfig(**state["config"])}
    except (TypeError, SpecserveError) as exc:  # a field unknown or missing, or a value out of range
        raise _damaged(directory, f"its config is not a training config ({exc})") from None


def truncate_metrics(path: str | Path, step: int) -> None:
    """Drop the log's rows past `step`: a resumed run redoes the steps after its last checkpoint."""
    path = Path(path)
    if path.is_file():
        rows = path.read_text().splitlines(keepends=True)
        path.write_text("".join(r for r in rows if r.strip() and json.loads(r)["step"] <= step))


def append_metrics(path: str | Path, step: int, metrics: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps({"step": step, **metrics}) + "\n")
