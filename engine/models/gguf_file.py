"""The layout of a GGUF file: metadata, tensor table, and raw tensor bytes. Torch-free.

Why not ``gguf.GGUFReader``: it builds a numpy view for every part of every metadata value, and a
vocabulary is ~100k strings (tokens + merges); that took 2-7 s for the default model on a busy
2-core machine, most of the load time. Walking the same bytes with ``struct`` takes ~0.1 s. The
``gguf`` package still supplies the type table and dequantization (``gguf_loader``).

Format (little-endian; v2 and v3)::

    "GGUF" | version u32 | tensor_count u64 | kv_count u64
    kv_count x   (key: string, value_type: u32, value)
    tensor_count x (name: string, n_dims: u32, dims: u64[n_dims] fastest first, ggml_type: u32,
                    offset: u64 from the data start)
    padding to general.alignment (default 32) | tensor data
    string = length u64 + utf-8 bytes; array = element_type u32 + count u64 + elements
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from engine.mathutils import round_up

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_GGML_TYPES = {member.value for member in GGMLQuantizationType}


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor: ``shape`` in torch order (slowest dim first); ``data`` is its raw bytes as
    ``uint8 [rows, bytes_per_row]``, a read-only view of the mapped file."""

    name: str
    shape: tuple[int, ...]
    ggml_type: GGMLQuantizationType
    data: np.ndarray


@dataclass(frozen=True)
class GGUFFile:
    path: str
    metadata: dict[str, Any]
    tensors: list[GGUFTensor]


def read_gguf(path: str | Path, with_tensors: bool = True) -> GGUFFile:
    """Parse ``path``. Any malformed or truncated file is a ValueError naming it."""
    with open(path, "rb") as file:
        try:
            buffer = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError as error:  # an empty file cannot be mapped
            raise ValueError(f"{path} is not a GGUF file: {error}") from error
    try:
        return _parse(buffer, str(path), with_tensors)
    except (struct.error, UnicodeDecodeError, KeyError, IndexError) as error:
        raise ValueError(f"{path} is not a valid GGUF file ({type(error).__name__}: {error})") from error


def _parse(buffer: mmap.mmap, path: str, with_tensors: bool) -> GGUFFile:
    if buffer[:4] != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file (it does not start with b'GGUF')")
    version, tensor_count, kv_count = struct.unpack_from("<IQQ", buffer, 4)
    if version not in (2, 3):
        raise ValueError(f"{path} is GGUF version {version}; only versions 2 and 3 are supported")
    reader = _Cursor(buffer, 24)
    metadata = {}
    for _ in range(kv_count):
        key = reader.string()
        metadata[key] = reader.value(reader.unpack("<I"))
    if not with_tensors:
        return GGUFFile(path, metadata, [])
    table = []
    for _ in range(tensor_count):
        name = reader.string()
        num_dims = reader.unpack("<I")
        dims = struct.unpack_from(f"<{num_dims}Q", buffer, reader.pos)
        reader.pos += 8 * num_dims
        type_id = reader.unpack("<I")
        if type_id not in _GGML_TYPES:
            raise ValueError(f"{path}: tensor {name} has unknown ggml type {type_id}")
        table.append((name, tuple(reversed(dims)), GGMLQuantizationType(type_id), reader.unpack("<Q")))
    alignment = metadata.get("general.alignment", 32)
    data_start = round_up(reader.pos, alignment)
    raw = np.frombuffer(buffer, dtype=np.uint8)
    tensors = []
    for name, shape, ggml_type, offset in table:
        block_size, type_size = GGML_QUANT_SIZES[ggml_type]
        rows, row_bytes = int(np.prod(shape[:-1])), shape[-1] // block_size * type_size
        start = data_start + offset
        if start + rows * row_bytes > raw.size:
            raise ValueError(f"{path} is truncated: tensor {name} runs past the end of the file")
        tensors.append(GGUFTensor(name, shape, ggml_type, raw[start:start + rows * row_bytes].reshape(rows, row_bytes)))
    return GGUFFile(path, metadata, tensors)


class _Cursor:
    """Reads values forward from ``pos``."""

    def __init__(self, buffer: mmap.mmap, pos: int) -> None:
        self.buffer, self.pos = buffer, pos

    def unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buffer, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.unpack("<Q")
        self.pos += length
        return self.buffer[self.pos - length:self.pos].decode("utf-8")

    def value(self, value_type: int) -> Any:
        if value_type in _SCALARS:
            return self.unpack(_SCALARS[value_type])
        if value_type == _STRING:
            return self.string()
        if value_type != _ARRAY:
            raise ValueError(f"unknown GGUF value type {value_type} at byte {self.pos}")
        element_type, count = self.unpack("<I"), self.unpack("<Q")
        if element_type in _SCALARS:  # one unpack for the whole array (token types, scores)
            fmt = f"<{count}{_SCALARS[element_type][1]}"
            values = list(struct.unpack_from(fmt, self.buffer, self.pos))
            self.pos += struct.calcsize(fmt)
            return values
        return [self.value(element_type) for _ in range(count)]
