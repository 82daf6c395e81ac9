"""`specserve train`: a drafter for a target from a target cache, with progress, metrics log, checkpoints
and resume. The drafter reads the target layers the cache was built with."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from torch.utils.data import Subset

from specserve.config import SpecserveError, check
from specserve.models.loader import load_model, locate_model
from specserve.models.registry import text_config_of
from specserve.spec_decode.deepspec.checkpoint import (
    build_draft_model,
    init_draft_weights,
    init_from_target_layers,
)
from specserve.spec_decode.deepspec.config import (
    Eagle3Config,
    default_mask_token,
    new_draft_config,
    new_eagle3_config,
    parse_drafter_config,
)
from specserve.train.curves import plot_curves, read_curve
from specserve.train.target_cache import TargetCache
from specserve.train.trainer import (
    CANNOT_RESUME,
    STATE_FILE,
    Sample,
    TrainConfig,
    Trainer,
    append_metrics,
    trainable_parameters,
    truncate_metrics,
)

CURVE_WINDOW = 50  # steps the plotted curves average over (at most a tenth of the run)


# The drafter flags each method takes (`method` aside); any other one given is refused, not ignored.
_TAKES = {
    "dspark": ("num_layers", "block_size", "markov_rank", "intermediate_size", "mask_token_id", "init"),
    "dflash": ("num_layers", "block_size", "intermediate_size", "mask_token_id", "init"),
    "eagle3": ("ttt_length",),
}
# Each shape flag's least value, so that a bad one fails before the load (the config checks it again).
_LEAST = dict(num_layers=1, block_size=1, markov_rank=0, intermediate_size=1, mask_token_id=0, ttt_length=1)


def _flag(name: str) -> str:
    """`train`'s flag of a DrafterArgs or TrainConfig field."""
    return {"num_layers": "--layers", "total_steps": "--steps"}.get(name, "--" + name.replace("_", "-"))


def check_unchanged(given: dict, saved: dict, directory: Path) -> None:
    """Refuses a flag given (`given`: field -> value) that would change the run `directory` resumes
    (`saved`: its values; a field it has no value for, None, is not compared)."""
    for name, value in given.items():
        was = saved.get(name)
        check(
            was is None or value == was,
            f"{_flag(name)} {value} conflicts with the run in {directory}, which has {was}: resume it with "
            f"{_flag(name)} {was}, or train into another --output",
        )


def checkpoint_config(directory: Path):
    """The config of the drafter in `directory` (its config.json; no target needed)."""
    path = directory / "config.json"
    try:
        raw = json.loads(path.read_text())
    except ValueError as exc:  # a run cut short while writing it (JSONDecodeError), or bytes not UTF-8
        raise SpecserveError(f"{path} is not valid JSON ({exc}), {CANNOT_RESUME}") from None
    check(isinstance(raw, dict), f"{path} is not a JSON object but {raw!r:.40}, {CANNOT_RESUME}")
    return parse_drafter_config(raw, str(directory))


@dataclass
class DrafterArgs:
    """`train`'s drafter flags, checked from the flags alone (before any model loads). None: not given,
    so a new drafter's default (`new_draft_config`'s, `new_eagle3_config`'s), or a resumed one's value."""

    method: str | None = None
    num_layers: int | None = None
    block_size: int | None = None
    markov_rank: int | None = None
    intermediate_size: int | None = None
    mask_token_id: int | None = None
    ttt_length: int | None = None
    init: str | None = None  # "random" or "target" (`init_from_target_layers`)

    def __post_init__(self) -> None:
        for name, least in _LEAST.items():
            value = getattr(self, name)
            check(value is None or value >= least, f"{_flag(name)} must be >= {least}, got {value}")

    def given(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    @classmethod
    def of_config(cls, config) -> DrafterArgs:
        """The flags that made a drafter of `config` (`checkpoint_config`'s)."""
        if isinstance(config, Eagle3Config):
            return cls("eagle3", ttt_length=config.ttt_length)
        heads = config.confidence_head  # what `new_config` gives DSpark, not DFlash
        return cls(
            "dspark" if heads else "dflash",
            config.num_layers,
            config.block_size,
            config.markov_rank if heads else None,
            config.backbone.intermediate_size,
            config.mask_token_id,
        )

    def check_length(self, longest: int) -> None:
        """Slots (a DSpark / DFlash block, EAGLE-3's test steps) past the cache's longest sample never have a
        label: a count given past it is refused here, where it failed in a huge allocation or ran for hours
        once the target had loaded (a default is kept: a few unlabelled slots cost little)."""
        for name in ("block_size", "ttt_length"):
            value = getattr(self, name)
            check(
                value is None or value < longest,
                f"{_flag(name)} must be in 1..{longest - 1}: the cache's longest sample has {longest} "
                f"tokens, so a position has at most {longest - 1} after it to predict; got {value}",
            )

    def check_target(self, text_config) -> None:
        """What the target's config decides before it loads: the mask token is one of its ids."""
        vocab = text_config.vocab_size
        check(
            self.mask_token_id is None or self.mask_token_id < vocab,
            f"--mask-token-id must be < {vocab} (the target's vocabulary size), got {self.mask_token_id}",
        )

    def check_memory(self, method: str, target_config, layer_ids: list[int], num_anchors: int) -> None:
        """Refuses, before the target loads, a new drafter whose training state alone (its trainable
        weights in fp32, their gradients and AdamW's two moments: 16 bytes each) exceeds this machine's
        memory: a huge --layers, --markov-rank or --intermediate-size failed in an allocation once loaded."""
        from specserve.preflight import host_memory_bytes

        available = host_memory_bytes()
        if available is None:
            return
        # Any mask token: the tokenizer that picks the default is not read yet, and the size does not need it.
        unmasked = method == "eagle3" or self.mask_token_id is not None
        config = (self if unmasked else replace(self, mask_token_id=0)).new_config(
            method, target_config, layer_ids, None, num_anchors
        )
        params = sum(p.numel() for p in trainable_parameters(build_draft_model(config, device="meta")))
        sizes = ("num_layers", "block_size", "markov_rank", "intermediate_size", "ttt_length")
        flags = " ".join(f"{_flag(k)} {v}" for k, v in self.given().items() if k in sizes)
        gib = 2**30
        check(
            16 * params <= available,
            f"a {method} drafter of this target{f' with {flags}' if flags else ''} has {params:,} "
            f"trainable parameters: training it takes ~{16 * params / gib:.1f} GiB (fp32 weights, gradients "
            f"and AdamW's two moments), more than this machine's memory ({available / gib:.1f} GiB of RAM "
            "and swap); give smaller values",
        )

    def method_for(self, resumed: DrafterArgs | None, directory: Path) -> str:
        """The method trained: a new drafter's, or the checkpoint's (`resumed`). Refuses a flag the method
        does not take, and one that would change the resumed drafter."""
        if resumed:  # (its --init is None: how a new drafter starts)
            check_unchanged(self.given(), vars(resumed), directory)
        method = resumed.method if resumed else self.method or "dspark"
        for name in self.given():
            check(
                name == "method" or name in _TAKES[method],
                f"{_flag(name)} does not apply to {method} drafters",
            )
        return method

    def new_config(self, method: str, target_config, layer_ids: list[int], tokenizer, num_anchors: int):
        """A new `method` drafter's config for the target (`method_for` has checked the flags)."""
        shape = {k: v for k, v in self.given().items() if k not in ("method", "init")}
        if method == "eagle3":
            return new_eagle3_config(target_config, target_layer_ids=layer_ids, **shape)
        heads = method == "dspark"
        if not heads:
            shape["markov_rank"] = 0  # DFlash: neither head
        if "mask_token_id" not in shape:
            shape["mask_token_id"] = default_mask_token(tokenizer, target_config.vocab_size)
        return new_draft_config(
            target_config, target_layer_ids=layer_ids, confidence_head=heads, num_anchors=num_anchors, **shape
        )


def training_samples(cache: TargetCache, num_samples: int | None) -> Sequence[Sample]:
    """The whole cache, or its first `num_samples` (a smaller data budget without a second cache)."""
    check(len(cache) > 0, f"{cache.directory} holds no samples")
    if num_samples is None:
        return cache
    if not 1 <= num_samples <= len(cache):
        raise SpecserveError(
            f"--num-samples must be in 1..{len(cache)} (the cache's samples), got {num_samples}"
        )
    return Subset(cache, range(num_samples))


def target_text_config(target_model: str):
    """The target's text config from its config.json or GGUF header, no weight read (None: a hub model not
    downloaded yet); an unknown reference fails here."""
    from specserve.preflight import model_config

    config = model_config(locate_model(target_model))
    return None if config is None else text_config_of(config)


def train_drafter(
    target_model: str,
    cache_dir: str,
    output: str,
    drafter: DrafterArgs,
    train_config: TrainConfig,
    checkpoint_every: int = 500,
    num_samples: int | None = None,
    full_vocabulary: bool = False,
    given: tuple[str, ...] = (),
) -> tuple[Path, str]:
    """(the drafter's directory, its method: dspark, dflash or eagle3). A `drafter` flag left None takes
    the new drafter's default, or the resumed one's value; so does a `train_config` field not in `given`
    (resuming, those in it must be the run's). `num_samples` trains on the cache's first samples only; the
    losses score the tokens the data supervises unless `full_vocabulary`."""
    from tqdm import tqdm

    if checkpoint_every < 1:
        raise SpecserveError(f"checkpoint_every must be >= 1, got {checkpoint_every}")
    cache = TargetCache(cache_dir)  # a wrong --cache fails before the target loads
    samples = training_samples(cache, num_samples)
    output = Path(output)
    resuming = (output / STATE_FILE).is_file()
    if resuming:
        # A run writes its drafter beside its state at each checkpoint: one missing was cut short or edited.
        missing = [name for name in ("config.json", "model.safetensors") if not (output / name).is_file()]
        check(
            not missing,
            f"{output} holds a training state ({STATE_FILE}) but not the drafter's {' or '.join(missing)}, "
            + CANNOT_RESUME,
        )
        saved = Trainer.saved_config(output)
        check_unchanged({name: getattr(train_config, name) for name in given}, asdict(saved), output)
        train_config = saved
        resumed = checkpoint_config(output)
        cache.check(resumed)  # the drafter may read other target layers than the cache holds
    method = drafter.method_for(DrafterArgs.of_config(resumed) if resuming else None, output)
    # An anchor (EAGLE-3: a chain's row) is a position whose next token is in the sample too: past S - 1 of
    # them, the rest are dummies that cost compute (and a huge count, the allocation). The default is cut
    # to that (the same anchors are drawn); a count given past it is refused.
    longest = cache.longest(num_samples)
    if "num_anchors" in given:
        check(
            train_config.num_anchors < longest,
            f"--num-anchors must be in 1..{longest - 1}: the cache's longest sample has {longest} tokens, so "
            f"at most {longest - 1} anchors; got {train_config.num_anchors}",
        )
    elif not resuming:
        train_config = replace(train_config, num_anchors=max(1, min(train_config.num_anchors, longest - 1)))
    drafter.check_length(longest)
    target_text = target_text_config(target_model)
    cache.check_target(target_model, target_text)
    if target_text is not None:
        drafter.check_target(target_text)
        if not resuming:
            layer_ids = cache.manifest["target_layer_ids"]
            drafter.check_memory(method, target_text, layer_ids, train_config.num_anchors)
    target, hf_config, tokenizer = load_model(target_model)
    config_t = text_config_of(hf_config)
    if resuming:
        trainer = Trainer.resume(output, target, config_t, samples)
        print(f"resuming {output} at step {trainer.step_index}")
    else:
        layer_ids = cache.manifest["target_layer_ids"]
        config = drafter.new_config(method, config_t, layer_ids, tokenizer, train_config.num_anchors)
        # its hidden size is the target's: a hub target's is known only once it is downloaded
        cache.check(config)
        model = build_draft_model(config)
        init_draft_weights(model, target, seed=train_config.seed)
        if drafter.init == "target":
            init_from_target_layers(model, target)
        vocab = None if full_vocabulary else cache.supervised_tokens(num_samples)
        if vocab is not None:
            print(
                f"training vocabulary: the {len(vocab)} tokens the data supervises (of {config_t.vocab_size})"
            )
        trainer = Trainer(model, samples, train_config, vocab)
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
    return output, method
