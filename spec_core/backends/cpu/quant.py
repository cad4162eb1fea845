"""Weight-only formats: the weight matrices are stored quantized, everything else in the runner's compute dtype.

- ``--dtype int8``: int8 with one symmetric scale per output channel, through torch's int8 weight-only kernel
  (``_weight_int8pack_mm``) with bf16 inputs; fp32 elsewhere. A token reads a quarter of fp32's weight bytes.
- ``--dtype int4``: 4-bit codes in groups of 32 along the input dimension, each group with its own scale d and
  minimum m (w = d·q + m, q in 0..15): the GGUF's Q4_1 layout. The default target *is* a Q4_1 file dequantized to
  fp32, so quantizing it again recovers the file's own codes, and int4 runs the GGUF's model (up to d and m rounded
  to bf16 for the kernel). Multiplied through torch's int4 CPU kernel (``_weight_int4pack_mm_for_cpu``) with bf16
  inputs; fp32 elsewhere, which measured faster than bf16 elsewhere (13 against 18 ms a token here: no casts
  around fp32 attention and norms). A token reads about a third of bf16's weight bytes.

- ``--dtype w8a8``: int8 weights *and* int8 activations (:class:`W8A8Weight`, through fbgemm's dynamically
  quantized linear: one activation scale per call, integer products on VNNI), with SmoothQuant scales calibrated at
  load (:mod:`spec_core.backends.cpu.w8a8`); fp32 elsewhere, with a bf16 LM head.

Where the CPU kernels run, int4 (:class:`RowInt4Weight`) and, on x86 without VNNI, w8a8 (:class:`RowW8A8Weight`)
multiply through the compiled matmuls of ``kernels/quant_gemm.c`` instead: activations quantized to int8 per row
and block of 32 (llama.cpp's Q8), integer products, and a fixed order of sums, so that a row's result never depends
on the rows beside it.

Embedding rows, norms, RoPE, attention, the KV cache and the logits stay in the compute dtype. Each format is a
different numeric model from fp32, so its greedy agreement with fp32 is reported, never assumed; the fp32 runner
stays the exactness reference.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from spec_core.backends.cpu.kquant import KQuantWeight

#: The kernel's input dtype: its CPU path is vectorised for bf16 inputs (fp32 inputs take a ~10x slower path).
KERNEL_INPUT_DTYPE = torch.bfloat16


@dataclass(frozen=True, slots=True)
class Int8Weight:
    """A ``[in, out]`` weight as int8 ``q [out, in]`` and per-output-channel ``scale [out]``: w ≈ q * scale."""

    q: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        """The float matrix's shape, ``[in, out]`` (as the runner stores its float weights)."""
        return self.q.shape[1], self.q.shape[0]

    @property
    def nbytes(self) -> int:
        return self.q.numel() * self.q.element_size() + self.scale.numel() * self.scale.element_size()


@dataclass(frozen=True, slots=True)
class LinearWeight:
    """A float weight kept as ``w [out, in]`` (``nn.Linear``'s layout) and applied with ``F.linear``.

    The runner keeps fp32 weights transposed (``[in, out]``: ``x @ w_t`` is the fast fp32 CPU path for decode
    rows), but oneDNN's bf16 kernels are fast on this layout instead: about 1.6x for 1-8 rows on AVX512-BF16.
    """

    w: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        """The float matrix's shape as the runner's other weights report it, ``[in, out]``."""
        return self.w.shape[1], self.w.shape[0]

    @property
    def nbytes(self) -> int:
        return self.w.numel() * self.w.element_size()


#: oneDNN's linear over a weight reordered once at load (what Inductor's CPU freezing uses).
_packed_linear = torch.ops.mkldnn._linear_pointwise.default


def can_prepack(w: torch.Tensor) -> bool:
    """Whether ``w`` can be held as a :class:`PackedLinear`: bf16 on a CPU whose oneDNN has a bf16 path."""
    return w.dtype == torch.bfloat16 and w.device.type == "cpu" and onednn_bf16()


@functools.cache
def onednn_bf16() -> bool:
    """Whether oneDNN can reorder and multiply bf16 weights on this CPU. It needs AVX512 (BW, VL, DQ) or
    AVX-NE-CONVERT; elsewhere (an AVX2-only EPYC, say) its reorder raises, and bf16 weights stay ``F.linear``'s,
    which torch runs on any CPU. Asked of oneDNN itself, once, on a tiny weight."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), None)
    except RuntimeError:
        return False
    return True


@dataclass(frozen=True, slots=True)
class PackedLinear:
    """A bf16 ``[out, in]`` weight reordered once into oneDNN's blocked layout, applied by oneDNN's linear.

    Bit for bit what ``F.linear`` computes on the same weight (tested), but ``F.linear`` reorders the weight and
    builds its kernel on every call: measured 7.8 against 4.5 ms for the 576 x 49,152 LM head at one row, and
    30-40 us of fixed cost on each small matrix.
    """

    w: torch.Tensor  #: an opaque mkldnn tensor
    in_features: int
    out_features: int

    @staticmethod
    def pack(w: torch.Tensor) -> PackedLinear:
        """Reorder a bf16 ``[out, in]`` weight (see :func:`can_prepack`)."""
        return PackedLinear(torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), None), w.shape[1], w.shape[0])

    @property
    def shape(self) -> tuple[int, int]:
        return self.in_features, self.out_features

    @property
    def nbytes(self) -> int:
        return self.in_features * self.out_features * 2

    def dense(self) -> torch.Tensor:
        """The ``[out, in]`` bf16 weight back as a plain tensor."""
        return self.w.to_dense()


#: Weights per int4 group (Q4_1's block size).
INT4_GROUP = 32
_int4_mm = torch.ops.aten._weight_int4pack_mm_for_cpu.default  # the overload itself: no dispatch by arguments


@dataclass(frozen=True, slots=True)
class Int4Weight:
    """A ``[in, out]`` weight as packed 4-bit codes (torch's CPU int4 layout, ``[out, in / 2]`` uint8) and
    ``scale_zero [in / 32, out, 2]`` bf16, where the kernel computes w = (q − 8)·scale + zero = d·q + m."""

    packed: torch.Tensor
    scale_zero: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape[1] * 2, self.packed.shape[0]

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + self.scale_zero.numel() * self.scale_zero.element_size()


def quantize_int4(w: torch.Tensor | LinearWeight) -> Int4Weight:
    """Quantize a weight (a ``[in, out]`` tensor or a :class:`LinearWeight`) Q4_1-style: per group of 32 inputs,
    d = (max − min) / 15, m = min, q = round((w − m) / d).

    A group that already holds Q4_1 values has its min at code 0 and its max at code 15, so this recovers its codes.
    """
    w = (w.w if isinstance(w, LinearWeight) else w.t()).float()  # [out, in]
    if w.device.type != "cpu":
        raise ValueError("dtype int4 (weight-only int4) runs on CPU only; on GPUs use bfloat16")
    out, inp = w.shape
    if inp % INT4_GROUP or out % 16:
        raise ValueError(f"dtype int4 needs input sizes divisible by {INT4_GROUP} and output sizes by 16 (the "
                         f"kernel's tiles), got a {inp} x {out} matrix")
    q, d, lo = _q4_1(w)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.view(out, inp).to(torch.int32), 1)
    scale_zero = torch.stack([d, lo + 8 * d], dim=-1).transpose(0, 1).to(KERNEL_INPUT_DTYPE).contiguous()
    return Int4Weight(packed, scale_zero)


def _q4_1(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_1 of an fp32 ``[out, in]`` matrix: codes ``[out, in / 32, 32]`` (0..15, as floats), and each group's d
    and m ``[out, in / 32]``."""
    out, inp = w.shape
    groups = w.view(out, inp // INT4_GROUP, INT4_GROUP)
    lo, hi = groups.amin(-1), groups.amax(-1)
    d = (hi - lo) / 15
    q = torch.round((groups - lo[..., None]) / torch.where(d > 0, d, 1)[..., None]).clamp(0, 15)
    return q, d, lo


@dataclass(frozen=True, slots=True)
class RowInt4Weight:
    """A ``[in, out]`` weight in Q4_1 (4-bit codes, d and m per group of 32 inputs, fp16 as in the GGUF) packed for
    the compiled matmul (``kernels/quant_gemm.c``), which multiplies it with activations quantized per row and
    block of 32 (llama.cpp's Q4_1 × Q8 arithmetic): batch-invariant."""

    codes: torch.Tensor  #: uint8 ``[ceil(out / 8), in / 32, 4, 8, 4]``: ``[.., p, j, t]`` holds output j's input
    #: 4p + t in its low nibble and input 16 + 4p + t in its high one
    scales: torch.Tensor  #: fp16 ``[ceil(out / 8), in / 32, 2, 8]``: d, then m
    in_features: int
    out_features: int
    gemm: object  #: the kernel, ``(x [rows, in] fp32, weight) -> [rows, out] fp32``

    @property
    def shape(self) -> tuple[int, int]:
        return self.in_features, self.out_features

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + self.scales.numel() * 2


def pack_q4_rows(w: torch.Tensor | LinearWeight, gemm) -> RowInt4Weight:
    """A weight (``[in, out]`` tensor or :class:`LinearWeight`) as a :class:`RowInt4Weight` for ``gemm``: the codes
    of :func:`quantize_int4` (a Q4_1 matrix's own), d and m rounded to fp16 (the GGUF's own precision)."""
    w = (w.w if isinstance(w, LinearWeight) else w.t()).float()  # [out, in]
    out, inp = w.shape
    if inp % INT4_GROUP:
        raise ValueError(f"dtype int4 needs input sizes divisible by {INT4_GROUP}, got a {inp} x {out} matrix")
    q, d, m = _q4_1(w)
    op, groups = -(-out // 8) * 8, inp // INT4_GROUP
    q = F.pad(q.to(torch.uint8), (0, 0, 0, 0, 0, op - out))  # [op, groups, 32]
    nibbles = (q[..., :16] | (q[..., 16:] << 4)).view(op // 8, 8, groups, 4, 4)  # [n8, output, group, p, t]
    nibbles = nibbles.permute(0, 2, 3, 1, 4).contiguous()  # [n8, group, p, output, t]: 8 outputs × 4 inputs a vector
    dm = torch.stack([F.pad(d, (0, 0, 0, op - out)), F.pad(m, (0, 0, 0, op - out))])  # [2, op, groups]
    scales = dm.view(2, op // 8, 8, groups).permute(1, 3, 0, 2).to(torch.float16).contiguous()
    return RowInt4Weight(nibbles, scales, inp, out, gemm)


def dequantize_int4(w: Int4Weight) -> torch.Tensor:
    """The ``[in, out]`` fp32 matrix an :class:`Int4Weight` stands for, read back through the kernel itself."""
    inp = w.shape[0]
    eye = torch.eye(inp, dtype=KERNEL_INPUT_DTYPE)
    return _int4_mm(eye, w.packed, INT4_GROUP, w.scale_zero).float()


def quantize_int8(w_t: torch.Tensor) -> Int8Weight:
    """Quantize a ``[in, out]`` float weight: scale ≈ max |w| of its output channel / 127, round to nearest."""
    if w_t.device.type != "cpu":
        raise ValueError("dtype int8 (weight-only int8) runs on CPU only; on GPUs use bfloat16")
    w = w_t.t().float()
    # The kernel reads the scale in bf16: round it up (bf16's relative step is 2^-8) so that no |w| / scale
    # exceeds 127, and quantize against the rounded scale itself, so the error stays within half a step.
    scale = (w.abs().amax(dim=1).clamp(min=1e-12) / 127.0 * (1 + 2**-7)).to(KERNEL_INPUT_DTYPE)
    q = torch.round(w / scale.float()[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
    return Int8Weight(q, scale)


def dequantize(w: Int8Weight) -> torch.Tensor:
    """The ``[in, out]`` fp32 matrix an :class:`Int8Weight` stands for (for tests and error reports)."""
    return (w.q.float() * w.scale.float()[:, None]).t()


_linear_dynamic = torch.ops.quantized.linear_dynamic.default


@dataclass(frozen=True, slots=True)
class W8A8Weight:
    """A ``[in, out]`` weight as int8 per-output-channel codes prepacked for fbgemm; each call quantizes its input
    to int8 with one scale (its largest |x|), multiplies in integers and scales back to fp32."""

    packed: object  #: fbgemm's prepacked weight (a torch script object)
    in_features: int
    out_features: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.in_features, self.out_features

    @property
    def nbytes(self) -> int:
        return self.in_features * self.out_features + self.out_features * 4


def can_w8a8() -> bool:
    """Whether this torch build has fbgemm's quantized linear (x86 CPUs)."""
    return "fbgemm" in torch.backends.quantized.supported_engines


@functools.cache
def w8a8_reduce_range() -> bool:
    """Whether w8a8 quantizes activations to 7 bits: on x86 CPUs without VNNI, fbgemm sums pairs of u8 x s8
    products in int16 (``vpmaddubsw``), which saturates with 8-bit activations (measured on an AVX2-only EPYC: logits
    off by 6 where VNNI's are off by 0.1). torch's own dynamic quantization reduces the range there too."""
    return not torch.cpu._is_vnni_supported()


def require_w8a8(device: torch.device) -> None:
    """``ValueError`` unless ``device`` can run w8a8: a CPU, with fbgemm in this torch build."""
    if device.type != "cpu" or not can_w8a8():
        raise ValueError("dtype w8a8 runs on x86 CPUs only (fbgemm); on GPUs use bfloat16")


def quantize_w8a8(w_t: torch.Tensor) -> W8A8Weight:
    """A ``[in, out]`` fp32 weight as a :class:`W8A8Weight`: the int8 codes and scales of :func:`quantize_int8`."""
    require_w8a8(w_t.device)
    q = quantize_int8(w_t)
    out = q.q.shape[0]
    with warnings.catch_warnings():  # torch 2.13 deprecates quantized tensors (pytorch#184982); fbgemm still takes them
        warnings.simplefilter("ignore", UserWarning)
        per_channel = torch._make_per_channel_quantized_tensor(q.q, q.scale.double(),
                                                               torch.zeros(out, dtype=torch.long), 0)
    return W8A8Weight(torch.ops.quantized.linear_prepack(per_channel, None), w_t.shape[0], out)


@dataclass(frozen=True, slots=True)
class RowW8A8Weight:
    """A ``[in, out]`` weight as int8 codes packed for the compiled W8A8 matmul (``kernels/quant_gemm.c``), which
    quantizes each block of 32 of an input row with its own scale: a row's result never depends on the rows beside
    it, and all 8 bits of each activation are kept (fbgemm keeps 7 without VNNI)."""

    packed: torch.Tensor  #: int8 ``[ceil(out / 8), ceil(in / 32), 8, 8, 4]``: ``[.., i, j, t]`` is output j's input
    #: 4i + t of the block, zero-padded
    scale: torch.Tensor  #: fp32 ``[8 · ceil(out / 8)]``, zero-padded
    in_features: int
    out_features: int
    gemm: object  #: the kernel, ``(x [rows, in] fp32, weight) -> [rows, out] fp32``

    @property
    def shape(self) -> tuple[int, int]:
        return self.in_features, self.out_features

    @property
    def nbytes(self) -> int:
        return self.in_features * self.out_features + self.out_features * 4


def pack_w8a8_rows(w_t: torch.Tensor, gemm) -> RowW8A8Weight:
    """A ``[in, out]`` fp32 weight as a :class:`RowW8A8Weight` for ``gemm``: the codes and scales of
    :func:`quantize_int8` (those of :func:`quantize_w8a8`), in the kernel's blocks."""
    q = quantize_int8(w_t)
    out, inp = q.q.shape
    op, ip = -(-out // 8) * 8, -(-inp // 32) * 32
    codes = F.pad(q.q, (0, ip - inp, 0, op - out))
    packed = codes.view(op // 8, 8, ip // 32, 8, 4).permute(0, 2, 3, 1, 4).contiguous()  # [n8, k32, i, output, t]
    return RowW8A8Weight(packed, F.pad(q.scale.float(), (0, op - out)).contiguous(), inp, out, gemm)


@dataclass(slots=True)
class Observed:
    """A float weight that records the largest |x| of each input channel it multiplies (calibration)."""

    w: torch.Tensor
    amax: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.w.shape)

    def observe(self, x: torch.Tensor) -> None:
        m = x.detach().reshape(-1, x.shape[-1]).abs().amax(0).float()
        self.amax = m if self.amax is None else torch.maximum(self.amax, m)


Weight = (torch.Tensor | LinearWeight | PackedLinear | Int8Weight | Int4Weight | W8A8Weight | RowW8A8Weight
          | RowInt4Weight | KQuantWeight | Observed)


def matmul(x: torch.Tensor, w: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w (+ bias)`` for a float ``[in, out]`` matrix or any weight format above; the result has ``x``'s
    dtype."""
    if isinstance(w, torch.Tensor):
        return x @ w if bias is None else torch.addmm(bias, x.flatten(0, -2), w).view(*x.shape[:-1], w.shape[1])
    if isinstance(w, PackedLinear):
        if x.dtype != torch.bfloat16:  # a bf16 matrix inside a float32 model (w8a8's LM head)
            return matmul(x.to(torch.bfloat16), w, bias).to(x.dtype)
        return _packed_linear(x, w.w, bias, "none", [], "")
    if isinstance(w, LinearWeight):
        return F.linear(x, w.w, bias)
    if isinstance(w, Observed):
        w.observe(x)
        return matmul(x, w.w, bias)
    if bias is not None:
        return matmul(x, w) + bias
    flat = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    if isinstance(w, (RowW8A8Weight, RowInt4Weight, KQuantWeight)):
        y = w.gemm(flat.float().contiguous(), w)
    elif isinstance(w, W8A8Weight):
        y = _linear_dynamic(flat.float(), w.packed, w8a8_reduce_range())
    elif isinstance(w, Int4Weight):
        y = _int4_mm(flat.to(KERNEL_INPUT_DTYPE), w.packed, INT4_GROUP, w.scale_zero)
    else:
        y = torch._weight_int8pack_mm(flat.to(KERNEL_INPUT_DTYPE), w.q, w.scale)
    return y.view(*x.shape[:-1], y.shape[-1]).to(x.dtype)


def quantize(w: Weight, fmt: str, kernels=None) -> Int8Weight | Int4Weight | RowW8A8Weight | RowInt4Weight:
    """``w`` in the weight-only format ``fmt`` (``int8`` or ``int4``): for torch's kernels, or for the compiled
    ``kernels`` (:func:`spec_core.backends.cpu.cpu_kernels.quant_gemm`) where given, whose int8 matrices are W8A8's."""
    if isinstance(w, PackedLinear):
        w = LinearWeight(w.dense())
    if kernels is not None and fmt == "int4":
        return pack_q4_rows(w, kernels.q4)
    if kernels is not None and fmt == "int8":
        return pack_w8a8_rows(w.w.t() if isinstance(w, LinearWeight) else w, kernels.w8a8)
    if fmt == "int8":
        return quantize_int8(w.w.t() if isinstance(w, LinearWeight) else w)
    if fmt == "int4":
        return quantize_int4(w)
    raise ValueError(f"unknown weight format {fmt!r}")


def nbytes(t: Weight) -> int:
    if isinstance(t, (Int8Weight, Int4Weight, LinearWeight, PackedLinear, W8A8Weight, RowW8A8Weight, RowInt4Weight,
                      KQuantWeight)):
        return t.nbytes
    return t.numel() * t.element_size()
