"""`specserve train`: a drafter for a target from a target cache, with progress, metrics log, checkpoints
and resume. The drafter reads the target layers the cache was built with."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from torch.utils.data import Subset

from specserve.config import SpecserveError
from specserve.models.loader import load_model
from specserve.models.registry import text_config_of
from specserve.spec_decode.deepspec.checkpoint import (
    build_draft_model,
    init_draft_weights,
    init_from_target_layers,
)
from specserve.spec_decode.deepspec.config import default_mask_token, new_draft_config, new_eagle3_config
from specserve.train.curves import plot_curves, read_curve
from specserve.train.target_cache import TargetCache
from specserve.train.trainer import STATE_FILE, Sample, TrainConfig, Trainer, append_metrics, truncate_metrics

CURVE_WINDOW = 50  # steps the plotted curves average over (at most a tenth of the run)


def training_samples(cache: TargetCache, num_samples: int | None) -> Sequence[Sample]:
    """The whole cache, or its first `num_samples` (a smaller data budget without a second cache)."""
    if num_samples is None:
        return cache
    if not 1 <= num_samples <= len(cache):
        raise SpecserveError(
            f"--num-samples must be in 1..{len(cache)} (the cache's samples), got {num_samples}"
        )
    return Subset(cache, range(num_samples))


def train_drafter(
    target_model: str,
    cache_dir: str,
    output: str,
    method: str,
    train_config: TrainConfig,
    num_layers: int = 1,
    block_size: int = 7,
    markov_rank: int = 256,
    mask_token_id: int | None = None,
    checkpoint_every: int = 500,
    ttt_length: int = 7,
    num_samples: int | None = None,
    full_vocabulary: bool = False,
    init: str = "random",
    intermediate_size: int | None = None,
) -> Path:
    """`method` is dspark, dflash or eagle3 (`num_layers`, `block_size`, `markov_rank`, `mask_token_id` and
    `intermediate_size` are DSpark's / DFlash's; `ttt_length` is EAGLE-3's). `num_samples` trains on the
    cache's first samples only; the losses score the tokens the data supervises unless `full_vocabulary`.
    `init` "target" starts a DSpark / DFlash drafter from the target's layers (`init_from_target_layers`)."""
    from tqdm import tqdm

    if checkpoint_every < 1:
        raise SpecserveError(f"checkpoint_every must be >= 1, got {checkpoint_every}")
    cache = TargetCache(cache_dir)  # a wrong --cache fails before the target loads
    samples = training_samples(cache, num_samples)
    target, hf_config, tokenizer = load_model(target_model)
    config_t = text_config_of(hf_config)
    output = Path(output)
    if (output / STATE_FILE).is_file():
        trainer = Trainer.resume(output, target, config_t, samples)
        print(f"resuming {output} at step {trainer.step_index}")
    else:
        layer_ids = cache.manifest["target_layer_ids"]
        if method == "eagle3":
            config = new_eagle3_config(config_t, target_layer_ids=layer_ids, ttt_length=ttt_length)
        else:
            heads = method == "dspark"
            config = new_draft_config(
                config_t,
                num_layers=num_layers,
                block_size=block_size,
                target_layer_ids=layer_ids,
                mask_token_id=mask_token_id
                if mask_token_id is not None
                else default_mask_token(tokenizer, config_t.vocab_size),
                markov_rank=markov_rank if heads else 0,
                confidence_head=heads,
                intermediate_size=intermediate_size,
                num_anchors=train_config.num_anchors,
            )
        model = build_draft_model(config)
        init_draft_weights(model, target, seed=train_config.seed)
        if init == "target":
            init_from_target_layers(model, target)
        vocab = None if full_vocabulary else cache.supervised_tokens(num_samples)
        if vocab is not None:
            print(
                f"training vocabulary: the {len(vocab)} tokens the data supervises (of {config_t.vocab_size})"
            )
        trainer = Trainer(model, samples, train_config, vocab)
    cache.check(trainer.model.config, target_model)
    log = output / "metrics.jsonl"
    output.mkdir(parents=True, exist_ok=True)
    truncate_metrics(log, trainer.step_index)
    with tqdm(total=train_config.total_steps, initial=trainer.step_index, desc=f"training {method}") as bar:
        while trainer.step_index < train_config.total_steps:
            metrics = trainer.step()
            append_metrics(log, trainer.step_index, metrics)
            bar.set_postfix(loss=f"{metrics['loss']:.3f}", tau=f"{metrics['tau']:.2f}")
            bar.update(1)
            if trainer.step_index % checkpoint_every == 0 or trainer.step_index == train_config.total_steps:
                trainer.save(output)
                window = max(1, min(CURVE_WINDOW, train_config.total_steps // 10))
                plot_curves([read_curve(output.name, log, window)], output / "metrics.png", window)
    return output
