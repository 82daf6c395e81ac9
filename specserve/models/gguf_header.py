"""A GGUF file's header (its key/values and tensor list) read without its tensor data, from the file or from
the chunks a local model ships it in, before they are assembled.

Checks made before loading (`specserve/preflight.py`) need the model's configuration: `build_hf_config` in
`models/gguf.py` reads it off any object with GGUFReader's `fields` (each with `contents()`) and `tensors`
(each with `name` and `shape`; Gemma 4's RoPE factors also with `tensor_type` and `data`), which this one
has. `GGUFReader` itself parses every array element up front
(7-11 s for a Qwen file's 150k token strings); here arrays are skipped over and read only when asked for.

Layout (GGUF v2/v3, little-endian): magic "GGUF", u32 version, u64 tensor count, u64 key/value count; each
key/value: string key, u32 type, value (a string is a u64 length and bytes; an array a u32 element type, a
u64 count and the elements); then each tensor: string name, u32 dimension count, u64 dimensions (innermost
first), u32 type, u64 data offset (from the start of the data section, which follows aligned).
"""

from __future__ import annotations

import math
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
_F32 = 0  # tensor type
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
    def data(self) -> np.ndarray:
        """An F32 tensor's values, flat (a setting the converter stored as a tensor: Gemma 4's RoPE factors);
        larger and quantized tensors are the loaders', from the file itself."""
        if self.tensor_type != _F32:
            raise SpecserveError(f"GGUF header: {self.name} is not F32 (type {self.tensor_type})")
        self.stream.pos = self.start
        return np.frombuffer(self.stream.read(4 * math.prod(self.shape)), dtype="<f4")


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
        stream = _Stream([paths] if isinstance(paths, str | Path) else paths)
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
