"""Reading a checkpoint's safetensors files: which files (an index's shards, or every *.safetensors), and
their tensors one at a time."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch

from specserve.config import SpecserveError
from specserve.models import gguf


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (model_dir / f).is_file()]
        if missing:
            raise SpecserveError(
                f"{model_dir}: shards listed in the index are missing: {', '.join(missing[:4])}"
            )
        return [model_dir / f for f in files]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise SpecserveError(f"{model_dir} has no *.safetensors weights")
    return files


def iter_checkpoint_tensors(model_dir: Path, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, tensor) for every tensor of every safetensors file whose name starts with `prefix`,
    one at a time (mmap'd reads: the others are never read). A GGUF's conversion without its fp32 weights
    is read from the GGUF."""
    from safetensors import safe_open

    if (source := gguf.unwritten_weights_source(Path(model_dir))) is not None:
        yield from gguf.iter_gguf_tensors(source, prefix)
        return

    for path in safetensors_files(Path(model_dir)):
        with safe_open(str(path), framework="pt", device="cpu") as fh:
            names = [name for name in fh.keys() if name.startswith(prefix)]  # noqa: SIM118 (not a mapping)
        for name in names:
            # A handle maps its whole file and every page read stays resident (in RSS) until it closes: a
            # handle per tensor keeps a load's peak at the weights plus a tensor, not plus a 2 GB shard.
            with safe_open(str(path), framework="pt", device="cpu") as fh:
                tensor = fh.get_tensor(name)
            yield name, tensor
            del tensor  # before the next read maps its pages
