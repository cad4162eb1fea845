"""GGUF matrices in their own formats (``--dtype gguf``): Q8_0, Q5_0, Q4_K and Q6_K, run by the compiled kernels
of ``kernels/kquant_gemm.c`` with every weight exactly the file's.

Each matrix is repacked once at load from the file's blocks into strips of 16 outputs (:class:`KQuantWeight`): the
same codes and scales, interleaved so that one vector instruction multiplies 16 outputs at once, at about the file's
own size (Q4_K 4.625 bits a weight against the file's 4.5, Q6_K 6.5625 as in the file, Q5_0 5.5, Q8_0 8.5). Each
strip keeps its own format, so a fused matrix (Q, K and V; gate and up) may mix them, as Q4_K_M files do. Where a
matrix is multiplied, its activations are quantized to int8 per row and block of 32 (llama.cpp's Q8 arithmetic, as
``--dtype int4`` does): the products are exact integers, so the only roundings are the activations' and fp32's.

The embedding stays in the file's blocks too (:class:`QuantEmbedding`): the rows a forward needs are dequantized
when gathered, to the values the fp32 conversion holds bit for bit.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys
from dataclasses import dataclass

import numpy as np
import torch

#: The GGUF storage types the kernels run, by the kernels' format number.
FORMATS = {"Q8_0": 0, "Q5_0": 1, "Q4_K": 2, "Q6_K": 3}
#: Outputs per packed strip.
STRIP = 16
_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14


@functools.cache
def _madvise():
    """libc's ``madvise`` (Linux), or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


def huge_empty(nbytes: int) -> torch.Tensor:
    """An uninitialised uint8 buffer of ``nbytes`` on 2 MB pages where the kernel grants them (Linux transparent
    huge pages, asked for with ``madvise``; else ordinary pages).

    Why. A decode step streams every packed matrix once. On 4 KB pages the CPU's prefetchers stop at each page
    boundary and the TLB misses every 4 KB: one row over 335 MB of Q4_K strips took 27 ms on 4 KB pages and 14 ms
    on 2 MB pages (24 GB/s, the core's read bandwidth) on an AVX-512 EPYC."""
    madvise = _madvise()
    if madvise is None or nbytes < _HUGE_PAGE:
        return torch.empty(nbytes, dtype=torch.uint8)
    base = torch.empty(nbytes + _HUGE_PAGE, dtype=torch.uint8)  # untouched: pages come on first write
    skip = -base.data_ptr() % _HUGE_PAGE
    madvise(base.data_ptr() + skip, -(-nbytes // _HUGE_PAGE) * _HUGE_PAGE, _MADV_HUGEPAGE)  # best effort
    return base[skip:skip + nbytes]


@dataclass(frozen=True, slots=True)
class KQuantWeight:
    """A ``[in, out]`` weight as packed strips of 16 outputs, each in its GGUF format (``kernels/kquant_gemm.c``)."""

    packed: torch.Tensor  #: uint8: the strips, one after another
    strips: torch.Tensor  #: int64 ``[n_strips, 4]``: byte offset, format, first output, outputs (at most 16)
    in_features: int
    out_features: int
    gemm: object  #: the kernels, a :class:`KQuantGemm`: ``gemm(x [rows, in] fp32, w)``

    @property
    def shape(self) -> tuple[int, int]:
        return self.in_features, self.out_features

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + self.strips.numel() * 8

    def formats(self) -> dict[str, int]:
        """Outputs by GGUF type."""
        names = {v: k for k, v in FORMATS.items()}
        out: dict[str, int] = {}
        for fmt, width in self.strips[:, 1:4:2].tolist():
            out[names[fmt]] = out.get(names[fmt], 0) + width
        return out


def as_rows(raw: np.ndarray | torch.Tensor) -> torch.Tensor:
    """A GGUF matrix's raw blocks (``[out, row bytes]`` uint8, as ``GGUFReader`` gives them) as a tensor of its
    own (the file's mapping is read-only)."""
    return torch.from_numpy(np.array(raw, dtype=np.uint8)) if isinstance(raw, np.ndarray) else raw.contiguous()


def pack(raw: np.ndarray | torch.Tensor, type_name: str, in_features: int, gemm) -> KQuantWeight:
    """A GGUF matrix (its raw blocks, ``[out, row bytes]``, of type ``type_name``) as a :class:`KQuantWeight` for
    ``gemm`` (:func:`spec_core.backends.cpu.cpu_kernels.kquant_gemm`'s)."""
    if type_name not in FORMATS:
        raise ValueError(f"{type_name} is not a format the K-quant kernels run ({', '.join(FORMATS)})")
    fmt, rows = FORMATS[type_name], np.ascontiguousarray(raw)
    packed = gemm.pack(fmt, rows, in_features, huge_empty)
    n, size = rows.shape[0], gemm.strip_bytes(fmt, in_features)
    first = torch.arange(0, n, STRIP)
    strips = torch.stack([first // STRIP * size, torch.full_like(first, fmt), first, (n - first).clamp(max=STRIP)], 1)
    return KQuantWeight(packed, strips.contiguous(), in_features, n, gemm)


def concat(parts: list[KQuantWeight]) -> KQuantWeight:
    """The matrices ``parts`` (same inputs) stacked along their outputs, as one weight: ``[Q; K; V]``."""
    if len({p.in_features for p in parts}) != 1:
        raise ValueError("matrices stacked along their outputs need the same input size")
    tables, byte, col = [], 0, 0
    for p in parts:
        t = p.strips.clone()
        t[:, 0] += byte
        t[:, 2] += col
        tables.append(t)
        byte, col = byte + p.packed.numel(), col + p.out_features
    packed = torch.cat([p.packed for p in parts], out=huge_empty(byte))
    return KQuantWeight(packed, torch.cat(tables).contiguous(), parts[0].in_features, col, parts[0].gemm)


class KQuantGemm:
    """``kernels/kquant_gemm.c`` through ctypes (``lib``: the CPU kernels' library): :class:`KQuantWeight` matrices
    packed from a file's blocks, multiplied with activations quantized per row and block of 32 (batch-invariant)
    on ``threads()`` threads. ``x``: ``[rows, in]`` fp32, contiguous; the result ``[rows, out]`` fp32."""

    def __init__(self, lib: ctypes.CDLL, threads=lambda: 1) -> None:
        p, i = ctypes.c_void_p, ctypes.c_int64
        self._threads = threads
        self._gemm, self._plain = lib.kq_gemm, lib.kq_gemm_plain
        self._gemm.argtypes = [p, p, p, p, i, i, i, i, i]
        self._plain.argtypes = [p, p, p, p, i, i, i, i]
        self._pack, self._strip_bytes, self._dequant = lib.kq_pack_matrix, lib.kq_strip_bytes, lib.kq_dequant_rows
        self._pack.argtypes = [i, p, i, i, i, p, i]
        self._strip_bytes.argtypes = [i, i]
        self._dequant.argtypes = [i, p, i, p, i, i, p]
        for f in (self._gemm, self._plain, self._pack):
            f.restype = ctypes.c_int
        self._strip_bytes.restype = ctypes.c_int64
        self._dequant.restype = None
        lib.kq_simd.restype = ctypes.c_int
        #: 2: AVX-512 VNNI, 1: AVX2, 0: the plain-C loops.
        self.simd = lib.kq_simd()

    def __call__(self, x: torch.Tensor, w: KQuantWeight) -> torch.Tensor:
        """``x @ w`` (the split over threads changes no result)."""
        return self._run(self._gemm, x, w, self._threads())

    def plain(self, x: torch.Tensor, w: KQuantWeight) -> torch.Tensor:
        """The same product through the plain-C loops, on this thread (what the SIMD forms must equal)."""
        return self._run(self._plain, x, w)

    @staticmethod
    def _run(fn, x: torch.Tensor, w: KQuantWeight, *threads: int) -> torch.Tensor:
        y = x.new_empty(x.shape[0], w.out_features)
        if fn(x.data_ptr(), w.packed.data_ptr(), w.strips.data_ptr(), y.data_ptr(), x.shape[0], w.in_features,
              w.strips.shape[0], w.out_features, *threads) != 0:
            raise MemoryError("the K-quant matmul could not allocate its buffers")
        return y

    def strip_bytes(self, fmt: int, k: int) -> int:
        """Bytes of one packed strip of 16 outputs over ``k`` inputs (-1: not a multiple of the format's block)."""
        return self._strip_bytes(fmt, k)

    def pack(self, fmt: int, raw, k: int, empty=None) -> torch.Tensor:
        """A GGUF matrix's rows (``raw``: uint8 ``[out, row bytes]``, a C-contiguous numpy array, such as a view of
        the file) as packed strips, into a buffer from ``empty(nbytes)`` (default: an ordinary tensor)."""
        size = self.strip_bytes(fmt, k)
        nbytes = -(-raw.shape[0] // 16) * max(size, 0)
        out = empty(nbytes) if empty is not None else torch.empty(nbytes, dtype=torch.uint8)
        if size < 0 or self._pack(fmt, raw.ctypes.data, raw.shape[1], raw.shape[0], k, out.data_ptr(),
                                  torch.get_num_threads()) != 0:
            raise ValueError(f"cannot pack a {raw.shape[0]} x {k} matrix of {raw.shape[1]}-byte rows as format {fmt}")
        return out

    def dequant_rows(self, fmt: int, raw: torch.Tensor, ids: torch.Tensor, k: int) -> torch.Tensor:
        """Rows ``ids`` (int64, contiguous) of a GGUF matrix in fp32, the file's values bit for bit."""
        out = torch.empty(ids.numel(), k)
        self._dequant(fmt, raw.data_ptr(), raw.shape[1], ids.data_ptr(), ids.numel(), k, out.data_ptr())
        return out



@dataclass(frozen=True, slots=True)
class QuantEmbedding:
    """An embedding table kept in its GGUF blocks; :meth:`lookup` dequantizes the rows asked for."""

    raw: torch.Tensor  #: uint8 ``[vocab, row bytes]``: the file's rows
    type_name: str
    dim: int
    gemm: KQuantGemm  #: (its exact row dequantization)

    @property
    def shape(self) -> tuple[int, int]:
        return self.raw.shape[0], self.dim

    @property
    def row_nbytes(self) -> int:
        return self.raw.shape[1]

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """fp32 rows ``[*ids.shape, dim]``: the file's values, as its fp32 conversion holds them."""
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        return self.gemm.dequant_rows(FORMATS[self.type_name], self.raw, flat, self.dim).view(*ids.shape, self.dim)

    def as_matrix(self, rows: torch.Tensor | None = None) -> KQuantWeight:
        """The table as an output layer (a tied LM head), of the ids ``rows`` only where given."""
        raw = self.raw if rows is None else self.raw[rows.cpu()]
        return pack(raw.numpy(), self.type_name, self.dim, self.gemm)
