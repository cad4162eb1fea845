"""The decoder's small ops as compiled CPU loops (``kernels/decode_ops.c``), built once per machine and loaded
with ctypes.

Why. A decode step on a CPU is its weight matmuls plus about 35 small torch ops a layer (norms, RoPE, the K/V
store and gather, attention and its casts, SiLU, adds), each a few microseconds of dispatch, allocation and
Python: 8-10 ms of a 25-30 ms step for SmolLM2's 30 layers, which no eager rewrite removed and ``torch.compile``
removes only for fixed shapes. Here each layer makes four calls besides its four matmuls: RMSNorm, one call for
RoPE, the K/V store and attention straight from the paged pool (no gather, no cast), RMSNorm, and SiLU-and-multiply.

Exactness. The loops compute in fp32 and round once at their outputs, so they are a different (no less exact)
arithmetic from transformers': only runners off the fp32 reference use them (bf16, int8, int4, w8a8), and those
report their greedy agreement with fp32, as before.

Build. The C file is compiled with the system C compiler (``$CC``, else ``cc``) and ``-O3 -march=native`` into
the model cache (``kernels/``), named by a hash of the source, the flags and the CPU's feature flags, so a cache
copied to another CPU never runs code built for a wider instruction set. ``ssd install-models`` builds it; a
runner builds it on first use otherwise (about a second). Without a compiler the runner logs one line and keeps
torch's ops.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from spec_core.backends.cpu.kquant import KQuantGemm, KQuantWeight
from spec_core.backends.cpu.quant import RowW8A8Weight, matmul
from spec_core.model_paths import cache_dir

logger = logging.getLogger(__name__)

#: The C sources of the one library: the decoder's small ops, quantized matmuls over activations quantized per row
#: and block, the decoder stack in one call over both, and GGUF matrices in their own formats.
SOURCES = tuple(Path(__file__).parent / "kernels" / name
                for name in ("decode_ops.c", "quant_gemm.c", "decoder.c", "kquant_gemm.c"))
#: Headers the sources include: part of the build's name, so an edit to one rebuilds.
HEADERS = tuple(Path(__file__).parent / "kernels" / name
                for name in ("attention_simd.h", "kquant_simd.h", "half.h"))
FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-fno-trapping-math", "-shared", "-fPIC",
         "-pthread")
#: The most new tokens a row may have for the kernels' attention (a loop over every query and slot, fine for
#: decode, verify and draft steps); longer forwards (prefill chunks) keep torch's SDPA.
MAX_TOKENS_PER_ROW = 32
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def library_path() -> Path:
    """Where this machine's build lives: named by the source, the compiler flags and the CPU's features."""
    source = b"".join(path.read_bytes() for path in (*SOURCES, *HEADERS))
    key = hashlib.sha256(source + " ".join(FLAGS).encode() + _cpu_flags().encode()).hexdigest()[:16]
    return cache_dir() / "kernels" / f"decode_ops-{key}.so"


def build() -> Path:
    """Compile the kernels for this machine (once; an existing build is reused). Raises ``RuntimeError`` with the
    compiler's message where it cannot."""
    out = library_path()
    if out.is_file():
        return out
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc or $CC) to build the CPU kernels")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_out = Path(tmp) / out.name
        try:
            proc = subprocess.run([cc, *FLAGS, "-o", str(tmp_out), *map(str, SOURCES), "-lm"], capture_output=True,
                                  text=True)
        except OSError as exc:
            raise RuntimeError(f"cannot run the C compiler {cc}: {exc}") from exc
        if proc.returncode != 0:
            raise RuntimeError(f"building the CPU kernels failed: {proc.stderr.strip()[-500:]}")
        os.replace(tmp_out, out)  # atomic: a concurrent builder's finished file is never half-written
    return out


class DecodeKernels:
    """The compiled ops over torch tensors of one activation dtype (fp32 or bf16). Inputs must be contiguous."""

    def __init__(self, lib: ctypes.CDLL, dtype: torch.dtype) -> None:
        suf = _SUFFIX[dtype]
        p, i = ctypes.c_void_p, ctypes.c_int64
        self._norm = getattr(lib, f"rms_norm_{suf}")
        self._norm.argtypes = [p, p, p, i, i, ctypes.c_float]
        self._silu_mul = getattr(lib, f"silu_mul_{suf}")
        self._silu_mul.argtypes = [p, p, i, i]
        self._attend = getattr(lib, f"rope_store_attend_{suf}")
        self._attend.argtypes = [p, p, p, p, p, p, p, p, p, p, i, i, i, i, i, i]
        for f in (self._norm, self._silu_mul, self._attend):
            f.restype = None

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``x · rsqrt(mean(x²) + eps) · weight`` over the last dimension, rounded once."""
        out = torch.empty_like(x)
        d = x.shape[-1]
        self._norm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // d, d, eps)
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) · up`` for rows of ``[gate, up]``."""
        f = gate_up.shape[-1] // 2
        out = gate_up.new_empty(*gate_up.shape[:-1], f)
        self._silu_mul(gate_up.data_ptr(), out.data_ptr(), gate_up.numel() // (2 * f), f)
        return out

    def rope_store_attend(self, qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], positions: torch.Tensor,
                          pool_ptr: int, write: torch.Tensor, kv_slots: torch.Tensor, mask: torch.Tensor | None,
                          out: torch.Tensor, heads: int, kv_heads: int, head_dim: int,
                          lengths: torch.Tensor | None = None, t: int | None = None) -> None:
        """One layer's attention for ``B`` rows of ``T`` new tokens (``kv_slots [B, S]``, ``mask [B, T, S]`` or
        None): RoPE on q and k (``rope``: fp32 cos and sin ``[positions, D]``), the new K/V stored at ``write`` in
        the pool layer at ``pool_ptr`` (``[slots, 2 · kv_heads, D]``), then softmax attention into ``out``. With
        ``lengths`` (``[B]``, and ``t`` = T), row b has ``lengths[b]`` tokens and the per-token tensors hold only
        those, row after row (``decode_ops.c``, "Ragged rows")."""
        bsz, s = kv_slots.shape
        t = write.numel() // bsz if lengths is None else t
        self._attend(qkv.data_ptr(), rope[0].data_ptr(), rope[1].data_ptr(), positions.data_ptr(), pool_ptr,
                     write.data_ptr(), kv_slots.data_ptr(), None if mask is None else mask.data_ptr(),
                     None if lengths is None else lengths.data_ptr(), out.data_ptr(), bsz, t, s, heads, kv_heads,
                     head_dim)


class QuantGemm:
    """``kernels/quant_gemm.c``: ``x @ w`` for the packed weights of :mod:`spec_core.backends.cpu.quant`
    (:class:`~spec_core.backends.cpu.quant.RowW8A8Weight`, :class:`~spec_core.backends.cpu.quant.RowInt4Weight`), each
    block of 32 of a row of ``x`` quantized to int8 with its own scale (batch-invariant), one call per matmul. ``x``:
    ``[rows, in]`` fp32, contiguous; the result ``[rows, out]`` fp32."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        p, i = ctypes.c_void_p, ctypes.c_int64
        self._w8a8, self._q4 = lib.w8a8_gemm, lib.q4_gemm
        for f in (self._w8a8, self._q4):
            f.argtypes = [p, p, p, p, i, i, i, i]
            f.restype = None

    def w8a8(self, x: torch.Tensor, w) -> torch.Tensor:
        """On :func:`gemm_threads` threads (the split over outputs changes no result)."""
        y = x.new_empty(x.shape[0], w.out_features)
        self._w8a8(x.data_ptr(), w.packed.data_ptr(), w.scale.data_ptr(), y.data_ptr(), x.shape[0], w.in_features,
                   w.out_features, gemm_threads())
        return y

    def q4(self, x: torch.Tensor, w) -> torch.Tensor:
        """On :func:`gemm_threads` threads (the split over outputs changes no result)."""
        y = x.new_empty(x.shape[0], w.out_features)
        self._q4(x.data_ptr(), w.codes.data_ptr(), w.scales.data_ptr(), y.data_ptr(), x.shape[0], w.in_features,
                 w.out_features, gemm_threads())
        return y


_gemm = threading.local()


def gemm_threads() -> int:
    """The compiled matmuls' thread count: torch's, or what :func:`torch_ops_on_one_thread` saved from it."""
    return getattr(_gemm, "threads", None) or torch.get_num_threads()


@contextlib.contextmanager
def torch_ops_on_one_thread():
    """Run torch's ops on one thread inside a forward whose matmuls are all the compiled ones, which keep torch's
    thread count (this Python thread only).

    Why. After each parallel region, torch's OpenMP workers spin for a while on the cores they ran on. Between the
    compiled matmuls of a forward, torch's small ops (the logits' copies) open such regions, and the spinning
    workers then hold the cores the matmuls' own workers need: on two cores a 5-token int4 verify took 4.6x a
    1-token step, against 2.6x with ``OMP_WAIT_POLICY=PASSIVE``."""
    threads = torch.get_num_threads()
    if threads == 1 or getattr(_gemm, "threads", None):
        yield
        return
    _gemm.threads = threads
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        _gemm.threads = None


@functools.cache
def quant_gemm() -> QuantGemm | None:
    """The compiled quantized matmuls where they were built with SIMD (AVX2, FMA, F16C), else None (logged once
    where the library cannot be built): their plain-C forms compute the same floats, but slower than torch's."""
    lib = _library()
    if lib is None:
        return None
    lib.quant_simd.restype = ctypes.c_int
    return QuantGemm(lib) if lib.quant_simd() else None


@functools.cache
def kquant_gemm() -> KQuantGemm | None:
    """The compiled K-quant matmuls where they were built with SIMD (AVX-512 VNNI, or AVX2 with FMA and F16C),
    else None."""
    lib = _library()
    if lib is None:
        return None
    kernels = KQuantGemm(lib, gemm_threads)
    return kernels if kernels.simd else None


@functools.cache
def _library() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(str(build()))
    except (RuntimeError, OSError) as exc:
        logger.warning("CPU kernels unavailable, using torch's ops: %s", exc)
        return None


def load(dtype: torch.dtype) -> DecodeKernels | None:
    """The kernels for activations of ``dtype``, or None where they do not apply (another dtype) or cannot be
    built (logged once)."""
    if dtype not in _SUFFIX:
        return None
    lib = _library()
    return None if lib is None else DecodeKernels(lib, dtype)


class QMat(ctypes.Structure):
    """``decoder.c``'s ``qmat``: one packed matrix (kind 0: w8a8, 1: q4, 2: a GGUF matrix in its own formats)."""

    _fields_ = [("w", ctypes.c_void_p), ("s", ctypes.c_void_p), ("kind", ctypes.c_int64), ("in_", ctypes.c_int64),
                ("out", ctypes.c_int64), ("strips", ctypes.c_int64)]


class QLayer(ctypes.Structure):
    """``decoder.c``'s ``qlayer``: one layer's norms, optional QKV bias and four matrices."""

    _fields_ = [("ln_attn", ctypes.c_void_p), ("ln_mlp", ctypes.c_void_p), ("qkv_bias", ctypes.c_void_p),
                ("qkv", QMat), ("o", QMat), ("gate_up", QMat), ("down", QMat)]


class FusedDecoder:
    """``decoder.c``: every layer of a runner whose matrices are all the compiled matmuls' (fp32 activations), in
    one call per forward. The descriptors point into the runner's own tensors, which outlive it."""

    def __init__(self, lib: ctypes.CDLL, layers) -> None:
        def mat(w) -> QMat:
            if isinstance(w, RowW8A8Weight):
                return QMat(w.packed.data_ptr(), w.scale.data_ptr(), 0, w.in_features, w.out_features, 0)
            if isinstance(w, KQuantWeight):
                return QMat(w.packed.data_ptr(), w.strips.data_ptr(), 2, w.in_features, w.out_features,
                            w.strips.shape[0])
            return QMat(w.codes.data_ptr(), w.scales.data_ptr(), 1, w.in_features, w.out_features, 0)

        self._kept: list[torch.Tensor] = []  # contiguous fp32 copies where a vector is not already one

        def ptr(t: torch.Tensor | None) -> int | None:
            if t is None:
                return None
            self._kept.append(t.float().contiguous())
            return self._kept[-1].data_ptr()

        self.layers = (QLayer * len(layers))(*(
            QLayer(ptr(layer.ln_attn.weight), ptr(layer.ln_mlp.weight), ptr(layer.qkv_bias), mat(layer.qkv),
                   mat(layer.o), mat(layer.gate_up), mat(layer.down)) for layer in layers))
        p, i = ctypes.c_void_p, ctypes.c_int64
        self._run = lib.decoder_layers_f32
        self._run.argtypes = [p, p, i, ctypes.c_float, p, p, p, p, i, p, p, p, p, i, i, i, i, i, i, i]
        self._run.restype = ctypes.c_int

    def run(self, runner, cache, batch, h: torch.Tensor, positions: torch.Tensor, write: torch.Tensor) -> None:
        """Every layer over ``h``'s rows (``positions`` and ``write`` theirs), in place: all ``B · T`` tokens, or
        the real ones of ``batch.lengths`` (the contract of :func:`run_paged`)."""
        spec, pool, mask, lengths = runner.spec, cache.kv, batch.attn_mask, batch.lengths
        bsz, t = batch.input_ids.shape
        rc = self._run(h.data_ptr(), self.layers, len(self.layers), spec.rms_norm_eps, runner.rope_f32[0].data_ptr(),
                       runner.rope_f32[1].data_ptr(), positions.data_ptr(), pool.data_ptr(), pool.stride(0),
                       write.data_ptr(), batch.kv_slots.data_ptr(), None if mask is None else mask.data_ptr(),
                       None if lengths is None else lengths.data_ptr(), bsz, t, batch.kv_slots.shape[1],
                       spec.num_heads, spec.num_kv_heads, spec.head_dim, gemm_threads())
        if rc != 0:
            raise MemoryError("the fused decoder could not allocate its buffers")


def fused_decoder(runner) -> FusedDecoder | None:
    """The one-call decoder for ``runner`` where it applies: a batch-invariant runner (the kernels loaded, so no q/k
    norms, and every matrix one of the compiled matmuls') with fp32 activations."""
    if not runner.batch_invariant or runner.dtype != torch.float32:
        return None
    return FusedDecoder(_library(), runner.layers)


def run_paged(runner, cache, batch) -> torch.Tensor:
    """The decoder stack of :meth:`ModelRunner.forward_paged` through ``runner.kernels``: the final hidden states
    ``[B, T, hidden]`` (before the final norm). Same contract as the torch path: every new token's K/V is written
    at its ``write_slots`` entry, then each query attends the ``kv_slots`` its mask row allows."""
    k, spec = runner.kernels, runner.spec
    bsz, t = batch.input_ids.shape
    ids, positions, write = batch.input_ids.reshape(-1), batch.positions.reshape(-1), batch.write_slots.reshape(-1)
    real = None
    if batch.lengths is not None:  # ragged rows: only the real tokens go through (PagedBatch.lengths)
        real = (torch.arange(t)[None, :] < batch.lengths[:, None]).reshape(-1).nonzero().reshape(-1)
        ids, positions, write = ids[real], positions[real], write[real]
    h = runner.embed_tokens(ids)
    positions, write = positions.contiguous(), write.contiguous()
    if runner.fused is not None:
        runner.fused.run(runner, cache, batch, h, positions, write)
        return _unpack(h, real, bsz, t)
    attn = h.new_empty(h.shape[0], runner.q_size)
    pool = cache.kv
    base, stride = pool.data_ptr(), pool.stride(0) * pool.element_size()
    heads, eps = (spec.num_heads, spec.num_kv_heads, spec.head_dim), spec.rms_norm_eps
    for li, layer in enumerate(runner.layers):
        qkv = matmul(k.rms_norm(h, layer.ln_attn.weight, eps), layer.qkv, layer.qkv_bias)
        k.rope_store_attend(qkv, runner.rope_f32, positions, base + li * stride, write, batch.kv_slots,
                            batch.attn_mask, attn, *heads, lengths=batch.lengths, t=t)
        h.add_(matmul(attn, layer.o))
        h.add_(matmul(k.silu_mul(matmul(k.rms_norm(h, layer.ln_mlp.weight, eps), layer.gate_up)), layer.down))
    return _unpack(h, real, bsz, t)


def _unpack(h: torch.Tensor, real: torch.Tensor | None, bsz: int, t: int) -> torch.Tensor:
    """``[B, T, hidden]`` from the hidden states of every token, or of the ``real`` ones (pads' rows zero)."""
    if real is None:
        return h.view(bsz, t, -1)
    return h.new_zeros(bsz * t, h.shape[-1]).index_copy_(0, real, h).view(bsz, t, -1)
