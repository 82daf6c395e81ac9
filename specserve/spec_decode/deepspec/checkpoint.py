"""DeepSpec drafter checkpoints (DSpark, DFlash, EAGLE-3): config.json + model.safetensors, read and written.

Keys and shapes are DeepSpec's (DSPARK.md §3.4-3.5, §8.3), so released checkpoints load 1:1 and ours load in
DeepSpec. The frozen `embed_tokens` and `lm_head` are stored (DeepSpec does) but, when they equal the
target's tensors, the drafter uses the target's modules instead of a second copy.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from specserve.config import SpecserveError
from specserve.layers.meta_device import on_meta
from specserve.models.base import CausalLM
from specserve.models.loader import resolve_model
from specserve.models.weight_files import iter_checkpoint_tensors
from specserve.spec_decode.deepspec.config import DrafterConfig, DSparkConfig
from specserve.spec_decode.deepspec.dspark import DSparkDraftModel
from specserve.spec_decode.deepspec.eagle3 import Eagle3DraftModel

DraftModel = DSparkDraftModel | Eagle3DraftModel

logger = logging.getLogger(__name__)


def build_draft_model(
    config: DrafterConfig, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> DraftModel:
    """Uninitialised storage for every tensor (filled by a checkpoint or `init_draft_weights`); on the
    "meta" device, none (the shapes alone)."""
    model_class = DSparkDraftModel if isinstance(config, DSparkConfig) else Eagle3DraftModel
    with on_meta():
        model = model_class(config)
    return model.to_empty(device=device).to(dtype).eval()


def share_target_modules(model: DraftModel, target: CausalLM) -> None:
    """Use the target's embedding and output layer (frozen in DSpark) instead of the drafter's copies."""
    model.embed_tokens = target.input_embedding()
    model.lm_head = target.output_layer()


@torch.no_grad()
def init_draft_weights(model: DraftModel, target: CausalLM, seed: int = 0, std: float = 0.02) -> None:
    """A fresh drafter: target embedding and LM head, N(0, std) linears and embeddings, unit norms."""
    share_target_modules(model, target)
    generator = torch.Generator().manual_seed(seed)
    frozen = {id(model.embed_tokens), id(model.lm_head)}
    for module in model.modules():
        if id(module) in frozen:
            continue
        if isinstance(module, nn.Linear | nn.Embedding):
            module.weight.copy_(torch.randn(module.weight.shape, generator=generator) * std)
            if getattr(module, "bias", None) is not None:
                module.bias.zero_()
        elif getattr(module, "weight", None) is not None and module.weight.dim() == 1:  # norms
            module.weight.fill_(1.0)
    for name, buffer in model.named_buffers():
        if name.endswith("layer_scalar"):
            buffer.fill_(1.0)
    for name, param in model.named_parameters():
        if name.endswith("base_kernel"):  # DFlash2's convolutions: identity plus noise
            param.copy_(torch.randn(param.shape, generator=generator) * std)
            param[:, 0] += 1.0
        elif name.endswith("_codebook"):  # DFlash2's candidate selector
            param.copy_(torch.randn(param.shape, generator=generator) * std)


@torch.no_grad()
def init_from_target_layers(model: DSparkDraftModel, target: CausalLM) -> None:
    """Start the draft layers as copies of the target layers after the deepest captured one, and the context
    projection as that layer's input: `fc` selects the deepest captured features and `hidden_norm` is the next
    layer's input norm, so the first draft layer's context K/V are the target's own from step 0. Tensors
    without a same-named, same-shaped target twin (Qwen2 targets: q/k norms, biases) keep
    `init_draft_weights`' values. (Measured on Qwen2.5-Coder-1.5B at lr 2e-3: no faster than random init
    over the first 117 steps; the first updates undo the copy.)"""
    if not isinstance(model, DSparkDraftModel):
        raise SpecserveError("initialising from target layers is for DSpark / DFlash drafters")
    target_layers, hidden = target.model.layers, model.config.hidden_size
    deepest = model.config.target_layer_ids[-1]  # (the ids increase: its features are fc's last block)
    model.fc.weight.zero_()
    model.fc.weight[:, -hidden:] = torch.eye(hidden)
    first = min(deepest + 1, len(target_layers) - 1)
    model.hidden_norm.weight.copy_(target_layers[first].input_layernorm.weight)
    model.norm.weight.copy_(target.model.norm.weight)
    for i, layer in enumerate(model.layers):
        twins = dict(target_layers[min(first + i, len(target_layers) - 1)].named_modules())
        for name, module in layer.named_modules():
            mine, theirs = getattr(module, "weight", None), getattr(twins.get(name), "weight", None)
            if (
                isinstance(mine, torch.Tensor)
                and isinstance(theirs, torch.Tensor)
                and mine.shape == theirs.shape
            ):
                mine.copy_(theirs)


def load_draft_checkpoint(
    model_id: str, target: CausalLM, target_config, dtype: torch.dtype = torch.float32, revision=None
) -> DraftModel:
    """A drafter checkpoint (local directory or hub id) in any format `spec_decode.formats` reads, checked
    against the target from its config.json before any tensor is read."""
    from specserve.spec_decode.formats import parse_checkpoint_config

    directory = resolve_model(model_id, revision=revision)
    config_path = directory / "config.json"
    try:
        raw = json.loads(config_path.read_text())
    except json.JSONDecodeError as exc:
        raise SpecserveError(f"{config_path} is not valid JSON: {exc}") from None
    checkpoint = parse_checkpoint_config(raw, target_config, source=str(config_path))
    config = checkpoint.config
    config.check_target(target_config, source=str(config_path))
    model = build_draft_model(config, dtype)
    tensors = (
        (ours, tensor)
        for name, tensor in iter_checkpoint_tensors(directory)
        if (ours := checkpoint.rename(name)) is not None
    )
    load_draft_weights(model, tensors, target, source=str(directory), optional=checkpoint.optional)
    model.checkpoint_dir = directory  # calibration files live beside the weights
    return model


@torch.no_grad()
def load_draft_weights(
    model: DraftModel,
    tensors: Iterable[tuple[str, torch.Tensor]],
    target: CausalLM,
    source: str,
    optional: tuple[str, ...] = (),
) -> None:
    """Copy checkpoint tensors in; every key must exist with its exact shape, and none may be missing
    except the target-shared `optional` ones (the target's are used)."""
    slots = model.state_dict()  # parameters and persistent buffers, sharing storage with the model
    target_tensors = {
        "embed_tokens.weight": lambda: target.input_embedding().weight,
        "lm_head.weight": lambda: target.output_layer().weight,
    }
    seen, shared = set(), []
    for name, tensor in tensors:
        if name not in slots:
            raise SpecserveError(
                f"{source}: unexpected tensor {name!r} (not part of a {model.config.source} "
                f"{model.config.architecture})"
            )
        expected = tuple(slots[name].shape)
        if tuple(tensor.shape) != expected:
            raise SpecserveError(
                f"{source}: tensor {name!r} has shape {tuple(tensor.shape)}, expected {expected}"
            )
        seen.add(name)
        if name in target_tensors and tensor.shape == target_tensors[name]().shape:
            theirs = target_tensors[name]()
            if torch.equal(tensor.to(theirs.dtype), theirs):
                shared.append(name)
                continue
            logger.warning("%s: %s differs from the target's; the drafter keeps its own copy", source, name)
        slots[name].copy_(tensor)
    absent = set(slots) - seen
    shared += sorted(absent & set(optional))
    missing = sorted(absent - set(optional))
    if missing:
        more = " ..." if len(missing) > 8 else ""
        raise SpecserveError(f"{source}: checkpoint is missing tensors: {', '.join(missing[:8])}{more}")
    if model.d2t is not None:
        _check_vocab_map(model, source)
    if "embed_tokens.weight" in shared:
        model.embed_tokens = target.input_embedding()
    if "lm_head.weight" in shared:
        model.lm_head = target.output_layer()


def _check_vocab_map(model: DraftModel, source: str) -> None:
    """d2t and t2d must name the same target ids, in increasing order (as speculators builds them)."""
    ids = model.d2t + torch.arange(len(model.d2t))
    kept = model.t2d.nonzero().flatten()
    if not (
        torch.equal(ids, kept) and bool((ids >= 0).all()) and bool((ids < model.config.vocab_size).all())
    ):
        raise SpecserveError(
            f"{source}: d2t and t2d disagree: d2t must map draft id i to target id i + d2t[i], the ids t2d "
            f"marks ({int(model.t2d.sum())} of them for draft_vocab_size {len(model.d2t)}), in order"
        )


def save_draft_checkpoint(model: DraftModel, directory: str | Path) -> Path:
    """config.json + model.safetensors in DeepSpec's layout (shared target tensors written as copies)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(model.config.to_dict(), indent=2, sort_keys=True))
    state, seen = {}, set()
    for name, tensor in model.state_dict().items():
        tensor = tensor.detach()
        if tensor.data_ptr() in seen:  # safetensors refuses aliased tensors (a tied target's embed/head)
            tensor = tensor.clone()
        seen.add(tensor.data_ptr())
        state[name] = tensor.contiguous()
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory
