"""A GGUF file's scalar metadata and tensor table, read without parsing its vocabulary.

``gguf.GGUFReader`` builds an object for every token and merge of the tokenizer's arrays: seven seconds for a
152k-token vocabulary here. Loading the tensors needs none of them, so this reader steps over arrays and keeps
scalar fields only; each tensor's data is a view of the file, mapped read-only.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from spec_core.model_paths import ModelLoadError

#: GGUF value types: struct codes of the fixed-size ones; 8 is a string, 9 an array.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One tensor: its name, GGUF shape (``shape[0]`` the row length), type and data (rows of blocks, as
    ``GGUFReader`` gives them: ``[rows, row bytes]`` uint8 for quantized types)."""

    name: str
    shape: tuple[int, ...]
    tensor_type: object  #: a ``gguf.GGMLQuantizationType``
    data: np.ndarray

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape))


@dataclass(frozen=True, slots=True)
class GGUFHeader:
    fields: dict[str, object]  #: scalar fields and strings (arrays are skipped)
    tensors: list[TensorInfo]


class _Cursor:
    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos = buf, 0

    def take(self, fmt: str):
        value = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return value[0]

    def string(self) -> str:
        n = self.take("Q")
        self.pos += n
        if self.pos > len(self.buf):
            raise ValueError("a string runs past the end of the file")
        return bytes(self.buf[self.pos - n:self.pos]).decode("utf-8", errors="replace")

    def value(self, kind: int):
        if kind in _SCALARS:
            return self.take(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            raise ValueError(f"unknown value type {kind}")
        inner, count = self.take("I"), self.take("Q")
        if inner in _SCALARS:
            self.pos += count * struct.calcsize("<" + _SCALARS[inner])
        else:
            for _ in range(count):
                self.value(inner)
        return None


def read_header(path: str | Path) -> GGUFHeader:
    """The header of the GGUF at ``path``; ``ModelLoadError`` for a file that is not one, or is cut short."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    cur = _Cursor(memoryview(mapped))
    try:
        if bytes(mapped[:4]) != b"GGUF":
            raise ModelLoadError(f"not a GGUF file (bad magic): {path}")
        cur.pos = 4
        cur.take("I")  # version
        n_tensors, n_kv = cur.take("Q"), cur.take("Q")
        fields = {}
        for _ in range(n_kv):
            key = cur.string()
            fields[key] = cur.value(cur.take("I"))
        table = []
        for _ in range(n_tensors):
            name, dims = cur.string(), cur.take("I")
            shape = tuple(cur.take("Q") for _ in range(dims))
            table.append((name, shape, GGMLQuantizationType(cur.take("I")), cur.take("Q")))
    except (struct.error, ValueError) as exc:
        raise ModelLoadError(f"corrupt or truncated GGUF file {path}: {exc}") from exc
    align = int(fields.get("general.alignment", 32))
    start = -(-cur.pos // align) * align
    tensors = []
    for name, shape, qtype, offset in table:
        block, size = GGML_QUANT_SIZES[qtype]
        row_bytes, rows = shape[0] // block * size, int(np.prod(shape[1:]))
        begin = start + offset
        if begin + rows * row_bytes > len(mapped):
            raise ModelLoadError(f"truncated GGUF file {path}: tensor {name} ends past the end of the file")
        data = mapped[begin:begin + rows * row_bytes].reshape(rows, row_bytes)
        if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            data = data.view(np.float32 if qtype == GGMLQuantizationType.F32 else np.float16)
        tensors.append(TensorInfo(name, shape, qtype, data if len(shape) > 1 else data.reshape(-1)))
    return GGUFHeader(fields, tensors)
