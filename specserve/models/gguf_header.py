"""A GGUF file read lazily: its key/values and tensor list parsed, arrays skipped over and read only when
asked for, each tensor's data a view of the memory-mapped file at its offset (or, from the chunks a local
model ships it in, before they are assembled, a copy of the bytes). Every load path reads GGUFs through
it: `GGUFReader` parses every array element up front (7-11 s for a Qwen file's 150k token strings), and
only transformers, building the tokenizer (`models/gguf.py`), still does.

It has what the load paths use of GGUFReader's: `fields` (each with `contents()`) and `tensors` (each with
`name`, `shape` innermost-first, `tensor_type` as ggml numbers it and `data` as GGUFReader gives it), and
`release_pages`.

Layout (GGUF v2/v3, little-endian): magic "GGUF", u32 version, u64 tensor count, u64 key/value count; each
key/value: string key, u32 type, value (a string is a u64 length and bytes; an array a u32 element type, a
u64 count and the elements); then each tensor: string name, u32 dimension count, u64 dimensions (innermost
first), u32 type, u64 data offset (from the start of the data section, which follows aligned).
"""

from __future__ import annotations

import math
import mmap
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from specserve.config import SpecserveError

# value type -> struct format (GGUF's numbering: 8 is a string, 9 an array)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?"}
_SCALARS |= {10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
# tensor types whose data are plain values (GGUFReader's choice; the others are blocks, read as bytes)
_PLAIN = {"F32": "<f4", "F16": "<f2", "F64": "<f8", "I8": "i1", "I16": "<i2", "I32": "<i4", "I64": "<i8"}
_ALIGNMENT = 32  # of the data section, where `general.alignment` does not say
_BLOCK = 4 << 20  # bytes read at a time


class _Stream:
    """Sequential and random reads over files taken as one byte string (a model's chunks, in part order)."""

    def __init__(self, paths: Sequence[Path]):
        self.paths = [Path(p) for p in paths]
        self.starts, total = [], 0
        for p in self.paths:
            self.starts.append(total)
            total += p.stat().st_size
        self.size = total
        self.pos = 0
        self._buffer, self._buffer_start = b"", 0
        # the file's memory map, once tensor data is read (one file only)
        self.mapped: np.memmap | None = None

    def _fill(self, at: int, n: int) -> None:
        """Make bytes [at, at + n) readable from the buffer (reading at least a block)."""
        want = max(n, _BLOCK)
        data = bytearray()
        for path, start in zip(self.paths, self.starts):
            end = start + path.stat().st_size
            if end <= at + len(data) or start >= at + want:
                continue
            with open(path, "rb") as fh:
                fh.seek(at + len(data) - start)
                data += fh.read(min(end, at + want) - (at + len(data)))
        if len(data) < n:
            raise SpecserveError(f"{self.paths[0]}: the GGUF header is cut short (a truncated file?)")
        self._buffer, self._buffer_start = bytes(data), at

    def read(self, n: int) -> bytes:
        offset = self.pos - self._buffer_start
        if offset < 0 or offset + n > len(self._buffer):
            self._fill(self.pos, n)
            offset = 0
        self.pos += n
        return self._buffer[offset : offset + n]

    def unpack(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.read(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        return self.read(self.unpack("<Q")).decode("utf-8", errors="replace")

    def array(self, start: int, nbytes: int) -> np.ndarray:
        """Bytes [start, start + nbytes) as uint8: a read-only view of the memory-mapped file, or, from a
        model's chunks (small tensors read before loading), a copy."""
        if len(self.paths) > 1:
            self.pos = start
            return np.frombuffer(self.read(nbytes), dtype=np.uint8)
        if self.mapped is None:
            self.mapped = np.memmap(self.paths[0], mode="r")
        if start + nbytes > self.size:
            raise SpecserveError(f"{self.paths[0]}: tensor data past the end of the file (a truncated file?)")
        return self.mapped[start : start + nbytes]


@dataclass
class HeaderField:
    """One key's value: a scalar or string as read, or where an array's elements lie (read on demand)."""

    stream: _Stream
    value: Any = None
    element_type: int | None = None  # arrays only
    count: int = 0
    start: int = 0

    def contents(self, index: int | None = None) -> Any:
        if self.element_type is None:
            return self.value
        self.stream.pos = self.start
        values = [_value(self.stream, self.element_type) for _ in range(self.count)]
        return values if index is None else values[index]


@dataclass
class HeaderTensor:
    name: str
    shape: list[int]  # innermost first, as GGUFReader's
    tensor_type: int
    stream: _Stream
    start: int = 0  # where its data begins in the file (set once the data section's start is known)

    @property
    def ggml_type(self):
        """`tensor_type` as the gguf package's enum (the number stays an int: the checks before loading read
        headers without importing that package)."""
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(self.tensor_type)

    @property
    def data(self) -> np.ndarray:
        """The tensor's data as GGUFReader gives it: plain types (F32, F16, integers) as their values, shaped
        outermost-first; block-quantized ones as raw bytes [..., rows, row bytes]."""
        from gguf import GGML_QUANT_SIZES

        kind = self.ggml_type
        block, block_bytes = GGML_QUANT_SIZES[kind]
        shape = [int(d) for d in reversed(self.shape)]
        raw = self.stream.array(self.start, math.prod(shape) // block * block_bytes)
        if kind.name in _PLAIN:
            return raw.view(_PLAIN[kind.name]).reshape(shape)
        return raw.reshape(*shape[:-1], shape[-1] // block * block_bytes)


def _value(stream: _Stream, value_type: int) -> Any:
    if value_type == _STRING:
        return stream.string()
    if value_type not in _SCALARS:
        raise SpecserveError(f"GGUF header: unknown value type {value_type}")
    return stream.unpack(_SCALARS[value_type])


def _skip(stream: _Stream, value_type: int, count: int) -> None:
    if value_type == _STRING:
        for _ in range(count):
            length = stream.unpack("<Q")  # (read before `pos` is: the read moves it)
            stream.pos += length
    elif value_type in _SCALARS:
        stream.pos += count * struct.calcsize(_SCALARS[value_type])
    else:
        raise SpecserveError(f"GGUF header: unsupported array element type {value_type}")


class GGUFHeader:
    """`fields` and `tensors` of a GGUF file, given as its path or its chunks' paths in part order."""

    def __init__(self, paths: Path | Sequence[Path]):
        self.stream = stream = _Stream([paths] if isinstance(paths, str | Path) else paths)
        self.source = stream.paths[0]
        if stream.size < 24 or stream.read(4) != b"GGUF":
            raise SpecserveError(f"{self.source} is not a GGUF file (no GGUF magic)")
        version = stream.unpack("<I")
        if version not in (2, 3):
            raise SpecserveError(f"{self.source}: GGUF version {version} is not supported (2 or 3)")
        num_tensors, num_fields = stream.unpack("<Q"), stream.unpack("<Q")
        self.fields: dict[str, HeaderField] = {}
        for _ in range(num_fields):
            key, value_type = stream.string(), stream.unpack("<I")
            if value_type == _ARRAY:
                element_type, count = stream.unpack("<I"), stream.unpack("<Q")
                self.fields[key] = HeaderField(stream, None, element_type, count, stream.pos)
                _skip(stream, element_type, count)
            else:
                self.fields[key] = HeaderField(stream, _value(stream, value_type))
        self.tensors: list[HeaderTensor] = []
        offsets = []
        for _ in range(num_tensors):
            name, num_dims = stream.string(), stream.unpack("<I")
            shape = [stream.unpack("<Q") for _ in range(num_dims)]
            self.tensors.append(HeaderTensor(name, shape, stream.unpack("<I"), stream))
            offsets.append(stream.unpack("<Q"))
        alignment = int(self.get("general.alignment", _ALIGNMENT))
        data_start = -(-stream.pos // alignment) * alignment  # the data section starts aligned
        for tensor, offset in zip(self.tensors, offsets):
            tensor.start = data_start + offset

    def get(self, key: str, default: Any = None) -> Any:
        field = self.fields.get(key)
        return default if field is None else field.contents()

    def release_pages(self) -> None:
        """Take the file's pages read so far out of this process's resident memory (the page cache keeps them,
        so a later read costs a minor fault): a memory map's pages count as the process's own until it is
        unmapped, which would add the whole file to the peak of a load."""
        if self.stream.mapped is not None and hasattr(mmap, "MADV_DONTNEED"):
            self.stream.mapped._mmap.madvise(mmap.MADV_DONTNEED)
