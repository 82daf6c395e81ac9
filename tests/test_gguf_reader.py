"""The lazy GGUF reader (`models/gguf_header.py`), which every load path reads tensors through: each tensor's
data is GGUFReader's, for every type the local models hold."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from specserve.config import SpecserveError
from specserve.models import local_models
from specserve.models.gguf_header import GGUFHeader
from tests.gguf_files import finish

TYPES = [QT.F32, QT.F16, QT.Q4_K, QT.Q5_0, QT.Q6_K, QT.Q8_0]


def write_every_type(path, alignment: int | None = None) -> None:
    """A file with one tensor of each type (block types as random bytes: the reader moves bytes), shaped
    [3, 4, 512] to check the outer dimensions too, and a token list (an array the reader skips)."""
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "qwen2")
    if alignment:
        w.add_custom_alignment(alignment)
    w.add_token_list([f"tok{i}" for i in range(1000)])
    for qtype in TYPES:
        block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        if qtype == QT.F32:
            w.add_tensor("f32", rng.standard_normal((3, 4, 512)).astype(np.float32))
        elif qtype == QT.F16:
            w.add_tensor("f16", rng.standard_normal((3, 4, 512)).astype(np.float16))
        else:
            raw = rng.integers(0, 256, (3, 4, 512 // block * block_bytes), dtype=np.uint8)
            w.add_tensor(qtype.name, raw, raw_dtype=qtype)
    w.add_tensor("odd", rng.standard_normal(7).astype(np.float32))  # the next one starts unaligned
    w.add_tensor("last", rng.standard_normal((2, 32)).astype(np.float32))
    finish(w)


@pytest.mark.parametrize("alignment", [None, 64])
def test_tensor_data_is_the_readers(tmp_path, alignment):
    path = tmp_path / "types.gguf"
    write_every_type(path, alignment)
    reader, header = gguf.GGUFReader(str(path)), GGUFHeader(path)
    assert [t.tensor_type for t in header.tensors] == [*TYPES, QT.F32, QT.F32]
    for ours, theirs in zip(header.tensors, reader.tensors, strict=True):
        assert (ours.name, ours.tensor_type) == (theirs.name, theirs.tensor_type)
        data = ours.data
        assert (data.dtype, data.shape) == (theirs.data.dtype, theirs.data.shape), ours.name
        assert np.array_equal(data.view(np.uint8), theirs.data.view(np.uint8)), ours.name
        # a view of the file, which loading must copy rather than adopt
        assert not data.flags.writeable
    header.release_pages()  # drops the pages read, not the map: the data reads the same after
    assert np.array_equal(header.tensors[-1].data, reader.tensors[-1].data)


def test_tensor_data_across_chunks(tmp_path):
    """A model's chunks, before they are assembled (preflight reads Gemma 4's RoPE factors from them)."""
    path = tmp_path / "types.gguf"
    write_every_type(path)
    data = path.read_bytes()
    cuts = [0, 1000, len(data) // 3, len(data) // 2 + 5, len(data)]
    parts = []
    for i, (a, b) in enumerate(zip(cuts, cuts[1:])):
        parts.append(tmp_path / f"part{i}.bin")
        parts[-1].write_bytes(data[a:b])
    reader = gguf.GGUFReader(str(path))
    for ours, theirs in zip(GGUFHeader(parts).tensors, reader.tensors, strict=True):
        assert np.array_equal(ours.data.view(np.uint8), theirs.data.view(np.uint8)), ours.name


def test_truncated_tensor_data_is_an_error(tmp_path):
    path = tmp_path / "types.gguf"
    write_every_type(path)
    header = GGUFHeader(path)
    with open(path, "r+b") as fh:
        fh.truncate(header.tensors[-1].start + 8)
    with pytest.raises(SpecserveError, match="past the end"):
        _ = GGUFHeader(path).tensors[-1].data


@pytest.mark.slow  # needs the local-models extra; assembles each file into the cache on first use
@pytest.mark.parametrize("name", sorted(local_models.LOCAL_MODELS))
def test_local_models_tensor_data_is_the_readers(name):
    """The real files (F32, Q4_K, Q5_0, Q6_K, Q8_0 tensors): every tensor's bytes as GGUFReader reads them."""
    path = local_models.ensure_gguf(name)
    reader, header = gguf.GGUFReader(str(path)), GGUFHeader(path)
    assert len(header.tensors) == len(reader.tensors)
    for ours, theirs in zip(header.tensors, reader.tensors):
        assert (ours.name, ours.tensor_type, ours.data.shape) == (
            theirs.name,
            theirs.tensor_type,
            theirs.data.shape,
        )
        assert np.array_equal(ours.data.view(np.uint8), theirs.data.view(np.uint8)), ours.name
