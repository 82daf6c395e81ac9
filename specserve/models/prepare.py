"""Getting loaded weights ready to serve, one recipe for every model (a target, a draft model, a DeepSpec
drafter, an MTP layer): quantize what is asked (`layers/quant.py`), cache that form, fuse the projections of
one input, then place the model on its platform (`platform.py`): on the CPU, pack the fp32 linears for
oneDNN (`layers/linear.py`) and move everything onto huge pages (`layers/huge_pages.py`); on CUDA, move it
to the GPU and install the GPU kernels into its layers.

The cache. A quantized load is slow for what it computes, not for what it reads: from a GGUF, every
block not in the kernel's format is dequantized and requantized in numpy (72 s for the 0.5B here, loaded
host), and from fp32 safetensors every weight is read in fp32 and quantized. So the quantized model (its
quantized layers' kernel buffers, and every other parameter in its dtype) is written once to
`<cache>/prepared/<key>/` and a later load maps it instead: `PreparedWeights`. The key covers the source
files (paths, sizes, modification times), the mode, the dtype, the group size and the source of the code
that defines the format, so a change to any of them prepares again. Packing and huge pages are not
cached: oneDNN's packed weights are opaque, and both are copies that take seconds.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import sys
import uuid
from pathlib import Path

import torch
from torch import nn

from specserve.cache_dir import cache_root, file_lock
from specserve.layers import kernels
from specserve.layers.delta_rules import use_delta_rule
from specserve.layers.huge_pages import place_on_huge_pages
from specserve.layers.linear import pack_linears
from specserve.layers.quant import (
    DEFAULT_GROUP_SIZE,
    Int4Linear,
    Int8Linear,
    fuse_projections,
    quantize_model,
    replace_module,
    use_device_kernels,
)
from specserve.layers.weight_storage import move_storages, weight_tensors
from specserve.models.weight_files import iter_checkpoint_tensors
from specserve.platform import CPU, Platform

logger = logging.getLogger(__name__)

# of the files below (2: Gemma 4's experts quantized, as Qwen's); the key also hashes the code that defines
# the layers' buffers
FORMAT_VERSION = 2
WEIGHTS_FILE = "weights.safetensors"
MANIFEST_FILE = "manifest.json"
MIN_CACHED_BYTES = 64 << 20  # of source files: smaller models are quantized each time
_LAYER_CLASSES = {"Int4Linear": Int4Linear, "Int8Linear": Int8Linear}


def prepare_model(
    model: nn.Module,
    quantization: str | None = None,
    cache: PreparedWeights | None = None,
    platform: Platform = CPU,
) -> nn.Module:
    """Quantize (every layer not quantized yet; "int8" | "int4" | None), save that form to `cache` if it has
    none yet, fuse and place on `platform`; in place, returns `model`."""
    if quantization is not None:
        quantize_model(model, quantization, fuse=False, use_kernel=platform.quantized_layout)
        if cache is not None and not cache.exists():
            print(
                f"[specserve] caching the {quantization} weights (once: later loads map them)",
                file=sys.stderr,
            )
            cache.save(model)
    fuse_projections(model)
    return place(model, platform)


def place(model: nn.Module, platform: Platform) -> nn.Module:
    """`model` (loaded, quantized, fused) made ready to run on `platform`; in place, returns `model`. The
    CPU: oneDNN-packed fp32 linears, the small ones on specserve's kernel (SPECSERVE_LINEAR=torch keeps
    nn.Linear), on huge pages; the layers' kernels are the CPU's by default. CUDA: the weights on the GPU
    (each storage copied once, so that fused and stacked quantized layers still share theirs), its kernels
    installed into every layer that has a seam for them (an attention layer's `attention_backend`, a Gated
    DeltaNet layer's `delta_rule`, experts' `use_grouped_mm`, quantized layers' `device_ops`)."""
    if not platform.is_cuda:
        pack_linears(model)
        place_on_huge_pages(model)
        return model
    from specserve.layers import triton_qlinear
    from specserve.layers.triton_attention import triton_paged_attention

    elsewhere = [t for t in weight_tensors(model) if t.device != platform.device]
    move_storages(elsewhere, lambda span: span.to(platform.device))
    model.to(platform.device)  # what modules keep besides parameters and buffers (rotary tables)
    use_device_kernels(model, triton_qlinear)
    for module in model.modules():
        if hasattr(module, "attention_backend"):
            module.attention_backend = triton_paged_attention
        # experts that would loop on the host (not stacked on the quantized kernels)
        grouping = hasattr(module, "use_grouped_mm") and module.reads_host
        if grouping and platform.groups_on_device(module.weight_dtype):
            module.use_grouped_mm()  # experts without a host loop (layers/moe.py)
    use_delta_rule(model, platform.delta_rule)
    return model


def _code_fingerprint() -> str:
    """The source of the modules that define what a quantized layer holds."""
    from specserve.layers import quant
    from specserve.models import gguf

    digest = hashlib.sha256()
    for module in (quant, gguf):
        digest.update(Path(module.__file__).read_bytes())
    return digest.hexdigest()


def _files_fingerprint(paths: list[Path]) -> list[list]:
    return [[str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns] for p in sorted(paths)]


class PreparedWeights:
    """The cached quantized form of one model (see the module docstring)."""

    def __init__(self, source_files: list[Path], quantization: str, dtype: torch.dtype):
        key = {
            "format": FORMAT_VERSION,
            "code": _code_fingerprint(),
            "source": _files_fingerprint(source_files),
            "quantization": quantization,
            "dtype": str(dtype),
            "group_size": DEFAULT_GROUP_SIZE,
        }
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
        self.key = key
        self.directory = cache_root() / "prepared" / digest

    @classmethod
    def for_source(
        cls, source_files: list[Path], quantization: str, dtype: torch.dtype
    ) -> PreparedWeights | None:
        """The cache entry for these source files, or None: for a small model (quantized in under a second:
        not worth the disk, and test models would only pile up there), and without specserve's kernels
        (the cache holds their layout; torch's int4 layers are rebuilt from the weights each time)."""
        if sum(p.stat().st_size for p in source_files) < MIN_CACHED_BYTES or kernels.ops() is None:
            return None
        return cls(source_files, quantization, dtype)

    def exists(self) -> bool:
        return (self.directory / MANIFEST_FILE).is_file() and (self.directory / WEIGHTS_FILE).is_file()

    # ---- writing ------------------------------------------------------------------------------------------
    def save(self, model: nn.Module) -> bool:
        """Write `model`'s quantized form (quantized, not yet fused, packed or moved). Returns False, writing
        nothing, when some quantized layer is not on specserve's kernel (its torch form is rebuilt from the
        weights each time) or the cache cannot be written."""
        layers, tensors = {}, {}
        seen: dict[int, str] = {}  # storage -> the name it is saved under (tied parameters are saved once)
        for qualname, module in model.named_modules(remove_duplicate=False):
            if isinstance(module, Int4Linear | Int8Linear):
                if not module.on_kernel:
                    return False
                first = layers.setdefault(id(module), {"names": [], "class": type(module).__name__})
                first["names"].append(qualname)
                if len(first["names"]) == 1:
                    first.update(in_features=module.in_features, group_size=module.group_size)
                    for name in module.KERNEL_BUFFERS:
                        tensors[f"{qualname}.{name}"] = getattr(module, name)
                    if module.bias is not None:
                        tensors[f"{qualname}.bias"] = module.bias
        quantized = {name for layer in layers.values() for name in layer["names"]}
        aliases = {}
        for name, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers()]:
            if name.rpartition(".")[0] in quantized:
                continue
            ptr = tensor.untyped_storage().data_ptr()
            if ptr in seen:
                aliases[name] = seen[ptr]
            else:
                seen[ptr] = name
                tensors[name] = tensor
        manifest = {"key": self.key, "layers": list(layers.values()), "aliases": aliases}
        try:
            self._write(manifest, tensors)
        except OSError as exc:
            logger.warning("could not cache the prepared weights in %s: %s", self.directory, exc)
            return False
        return True

    def _write(self, manifest: dict, tensors: dict[str, torch.Tensor]) -> None:
        from safetensors.torch import save_file

        self.directory.parent.mkdir(parents=True, exist_ok=True)
        with file_lock(self.directory.parent / f".{self.directory.name}.lock"):
            if self.exists():
                return
            tmp = self.directory.parent / f".{self.directory.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            tmp.mkdir()
            try:
                save_file({k: t.detach().contiguous() for k, t in tensors.items()}, str(tmp / WEIGHTS_FILE))
                (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1) + "\n")
                if self.directory.exists():
                    shutil.rmtree(self.directory)
                os.rename(tmp, self.directory)
            finally:
                if tmp.exists():
                    shutil.rmtree(tmp, ignore_errors=True)

    # ---- reading ------------------------------------------------------------------------------------------
    def load_into(self, model: nn.Module) -> None:
        """Fill `model` (built, its weights unread) with the cached form: its parameters and buffers copied
        in, its quantized layers rebuilt from their kernel buffers. A file handle per tensor, as a source
        load: the file's pages leave the process as it goes. `prepare_model` then fuses, packs and moves."""
        manifest = json.loads((self.directory / MANIFEST_FILE).read_text())
        layers = {layer["names"][0]: layer for layer in manifest["layers"]}
        buffers: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for name, tensor in iter_checkpoint_tensors(self.directory):
                if name.rpartition(".")[0] in layers:
                    buffers[name] = tensor.clone()  # a storage of its own, not a view of the file
                else:
                    _get_tensor(model, name).copy_(tensor)
        tie = getattr(model, "tie_weights", None)
        if tie is not None:
            tie()  # before the layers below: a tied head may be one of them (its quantized copy)
        for name, source in manifest["aliases"].items():  # what tie_weights did not tie again
            tensor = _get_tensor(model, source)
            if _get_tensor(model, name) is not tensor:
                _set_tensor(model, name, tensor)
        for first, layer in layers.items():
            cls = _LAYER_CLASSES[layer["class"]]
            kernel = {name: buffers[f"{first}.{name}"] for name in cls.KERNEL_BUFFERS}
            bias = buffers.get(f"{first}.bias")
            if bias is not None:  # a parameter, as the source's bias is in a freshly quantized layer
                bias = nn.Parameter(bias, requires_grad=False)
            new = cls.from_kernel_buffers(kernel, layer["in_features"], layer["group_size"], bias)
            replace_module(model, layer["names"], new)


def _get_tensor(model: nn.Module, name: str) -> torch.Tensor:
    owner, _, leaf = name.rpartition(".")
    return getattr(model.get_submodule(owner), leaf)


def _set_tensor(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Make `name` the very tensor `tensor` (an alias, as a tie)."""
    owner_name, _, leaf = name.rpartition(".")
    owner = model.get_submodule(owner_name)
    if leaf in owner._parameters:
        owner._parameters[leaf] = tensor
    elif leaf in owner._buffers:
        owner._buffers[leaf] = tensor
    else:
        raise ValueError(f"prepared weights: {name} is neither a parameter nor a buffer of the model")
