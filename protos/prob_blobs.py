"""Draft probability rows on the wire (layouts in ``ssd.proto``): dense float32 ``[rows, vocab]``, or sparse (ids
and values ``[rows, width]``) when most of each row is zero, as a top-n proposal's rows are. Both decode to the
same dense rows, bit for bit."""

from __future__ import annotations

import numpy as np
import torch

_I32 = np.dtype("<i4")
_F32 = np.dtype("<f4")


def pack_probs(probs: torch.Tensor | None) -> bytes:
    if probs is None:
        return b""
    return probs.detach().to("cpu", torch.float32).contiguous().numpy().astype(_F32, copy=False).tobytes()


def unpack_probs(blob: bytes, rows: int, vocab_size: int, build: bool = True) -> torch.Tensor | None:
    """The dense rows (``build`` False: only checked, None)."""
    if not blob:
        return None
    if len(blob) != rows * vocab_size * 4:
        raise ValueError(f"draft_probs blob has {len(blob)} bytes; expected {rows}x{vocab_size} float32")
    if not build:
        return None
    return torch.from_numpy(np.frombuffer(blob, dtype=_F32).reshape(rows, vocab_size).copy())


#: Columns per block in :func:`sparse_rows`' scan: a block's max says whether it holds a non-zero at all.
_SCAN_BLOCK = 64


def sparse_rows(probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Every non-zero of ``probs [rows, V]`` (probabilities, so >= 0) as (row, column, value), row by row; None if
    there are none. One vectorized pass takes each block of 64 columns' max; only blocks holding a non-zero are
    looked into. (A top-n proposal row has 64 non-zeros in 49152 columns. The full scan of a ``topk`` or a
    ``nonzero`` takes a quarter of a sampled bundle's build.)"""
    probs = probs.detach().to("cpu", torch.float32).contiguous()
    rows, vocab = probs.shape
    pad = -vocab % _SCAN_BLOCK
    blocks = (torch.nn.functional.pad(probs, (0, pad)) if pad else probs).view(rows, -1, _SCAN_BLOCK)
    b_row, b_col = (blocks.amax(-1) > 0).nonzero(as_tuple=True)
    if not b_row.numel():
        return None
    sub = blocks[b_row, b_col]
    i, j = (sub > 0).nonzero(as_tuple=True)  # row-major: rows in order, columns ascending within each
    return b_row[i], b_col[i] * _SCAN_BLOCK + j, sub[i, j]


def pack_sparse_probs(probs: torch.Tensor) -> tuple[bytes, bytes, int] | None:
    """(ids, values, width) when the rows are mostly zero (smaller than dense), else None: each row's non-zeros
    in column order, padded with (id 0, 0.0) to the widest row's count."""
    packed = _sparse_arrays(probs)
    return None if packed is None else (packed[0].tobytes(), packed[1].tobytes(), packed[2])


def pack_sparse_many(probs: list[torch.Tensor | None]) -> list[tuple[bytes, bytes, int] | None]:
    """:func:`pack_sparse_probs` for several speculations' rows (a bundle's branches) in one scan, at the widest
    row's width; None for each (they then pack alone) where there are none or together they are dense."""
    live = [i for i, p in enumerate(probs) if p is not None and p.numel()]
    out: list[tuple[bytes, bytes, int] | None] = [None] * len(probs)
    packed = _sparse_arrays(torch.cat([probs[i].detach().to("cpu", torch.float32) for i in live])) if live else None
    if packed is None:
        return out
    ids, vals, width = packed
    start = 0
    for i in live:
        end = start + probs[i].shape[0]
        out[i] = (ids[start:end].tobytes(), vals[start:end].tobytes(), width)
        start = end
    return out


def _sparse_arrays(probs: torch.Tensor) -> tuple[np.ndarray, np.ndarray, int] | None:
    """The sparse layout's arrays (int32 ids, float32 values, both ``[rows, width]``) and width, or None (dense)."""
    found = sparse_rows(probs) if probs.numel() else None
    if found is None:
        return None
    rows = probs.shape[0]
    row, col, val = found
    counts = torch.bincount(row, minlength=rows)
    width = int(counts.max())
    if width * 2 >= probs.shape[-1]:
        return None
    at = torch.arange(row.numel()) - (counts.cumsum(0) - counts)[row]  # each non-zero's place in its row
    ids = torch.zeros(rows, width, dtype=torch.int32)
    vals = torch.zeros(rows, width, dtype=torch.float32)
    ids[row, at] = col.to(torch.int32)
    vals[row, at] = val
    return ids.numpy().astype(_I32, copy=False), vals.numpy().astype(_F32, copy=False), width


def unpack_sparse_probs(ids_blob: bytes, vals_blob: bytes, rows: int, width: int, vocab_size: int,
                        build: bool = True) -> torch.Tensor | None:
    """The dense rows of a sparse layout (``build`` False: only checked, None)."""
    n = rows * width
    if width <= 0 or len(ids_blob) != 4 * n or len(vals_blob) != 4 * n:
        raise ValueError(f"sparse probability blobs do not hold {rows}x{width} entries")
    ids = torch.from_numpy(np.frombuffer(ids_blob, dtype=_I32).astype(np.int64).reshape(rows, width))
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ValueError("sparse probability ids out of vocabulary")
    if not build:
        return None
    vals = torch.from_numpy(np.frombuffer(vals_blob, dtype=_F32).reshape(rows, width).copy())
    return torch.zeros(rows, vocab_size).scatter_add_(-1, ids, vals)
