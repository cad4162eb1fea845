"""GGUF matrices in their own formats (``spec_core/backends/cpu/kquant.py``, ``kernels/kquant_gemm.c``): for Q8_0, Q5_0,
Q4_K and Q6_K, on random blocks, the compiled matmul equals the file's weights (``gguf.quants.dequantize``) times the
activations quantized per row and block of 32, within fp32 rounding; its AVX-512, AVX2 and plain-C forms give the same
floats; a row's result never depends on the rows beside it; embedding rows come back bit for bit."""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import numpy as np
import pytest
import torch

from spec_core.backends.cpu import cpu_kernels, kquant

pytestmark = pytest.mark.skipif(cpu_kernels.kquant_gemm() is None,
                                reason="the K-quant kernels need AVX-512 VNNI or AVX2, FMA and F16C")

TYPES = ("Q8_0", "Q5_0", "Q4_K", "Q6_K")


def random_blocks(type_name: str, out: int, inp: int, rng: np.random.Generator) -> np.ndarray:
    """A ``[out, row bytes]`` matrix of valid random ``type_name`` blocks: through ``gguf.quants.quantize`` where
    it quantizes the type, else random bytes with finite fp16 scales (every bit pattern of codes and 6-bit or int8
    sub-scales is a valid block)."""
    import gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    if type_name in ("Q8_0", "Q5_0"):
        raw = gguf.quantize(rng.normal(0, 1, (out, inp)).astype(np.float32), qtype)
        if type_name == "Q8_0":  # the code -128, which llama.cpp's quantizer never writes but a file may hold
            raw.reshape(out, -1, 34)[:, ::3, 2] = 0x80
        return raw
    size = {"Q4_K": 144, "Q6_K": 210}[type_name]
    blocks = rng.integers(0, 256, (out, inp // 256, size), dtype=np.uint8)
    scales = rng.uniform(-0.01, 0.01, (out, inp // 256, 2)).astype(np.float16).view(np.uint8)
    if type_name == "Q4_K":
        blocks[..., :4] = scales.reshape(out, inp // 256, 4)
    else:
        blocks[..., 208:210] = scales[..., :2]
    return blocks.reshape(out, -1)


def quantized_activations(x: torch.Tensor) -> torch.Tensor:
    """The kernel's activations in float64: each block of 32 of a row as int8 codes (round half to even) times its
    scale, max |x| / 127."""
    blocks = x.view(x.shape[0], -1, 32)
    top = blocks.abs().amax(-1, keepdim=True)
    q = torch.round(blocks * torch.where(top > 0, 127 / top, 0))
    return (q.double() * (top / 127).double()).flatten(1)


def reference(x: torch.Tensor, raw: np.ndarray, type_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact product of the file's weights and the quantized activations, and its scale Σ |w| |x| per output."""
    import gguf

    w = torch.from_numpy(gguf.dequantize(raw, gguf.GGMLQuantizationType[type_name])).double()
    xq = quantized_activations(x)
    return xq @ w.t(), xq.abs() @ w.abs().t()


def _build(tmp_path, flags: list[str], name: str) -> kquant.KQuantGemm:
    cc = shutil.which("cc") or shutil.which("gcc")
    out = tmp_path / f"{name}.so"
    sources = [str(p) for p in cpu_kernels.SOURCES if p.name in ("quant_gemm.c", "kquant_gemm.c")]
    subprocess.run([cc, *flags, "-shared", "-fPIC", "-pthread", "-o", str(out), *sources, "-lm"], check=True)
    return kquant.KQuantGemm(ctypes.CDLL(str(out)))


@pytest.mark.parametrize("type_name", TYPES)
def test_each_format_multiplies_the_files_weights(type_name):
    gen, rng = torch.Generator().manual_seed(3), np.random.default_rng(3)
    kernels = cpu_kernels.kquant_gemm()
    for inp, out in ((256, 16), (512, 40), (1536, 100)):  # outputs off the strips of 16 too
        raw = random_blocks(type_name, out, inp, rng)
        w = kquant.pack(raw, type_name, inp, kernels)
        assert w.shape == (inp, out) and w.formats() == {type_name: out}
        x = torch.randn(6, inp, generator=gen)
        x[0, 5] = 40.0  # an outlier coarsens only its own block of 32
        got = kernels(x, w)
        ref, scale = reference(x, raw, type_name)
        assert ((got.double() - ref).abs() <= 2 ** -19 * scale + 1e-30).all(), (type_name, inp, out)


@pytest.mark.parametrize("type_name", TYPES)
def test_each_format_is_batch_invariant_and_its_plain_c_form(type_name, tmp_path):
    """A row's floats never depend on the other rows of the call (1 to 11 rows: groups of 8 and a remainder), on
    more threads, or on the form: the plain-C loops (in this build, and built without SIMD) and, where the CPU has
    AVX-512 and AVX2, the AVX2 build give the same bits."""
    gen, rng = torch.Generator().manual_seed(5), np.random.default_rng(5)
    kernels = cpu_kernels.kquant_gemm()
    plain = _build(tmp_path, ["-O2", "-march=x86-64"], "plain")
    assert plain.simd == 0
    forms = [kernels.plain, plain.plain]
    if kernels.simd == 2 and "avx2" in cpu_kernels._cpu_flags().split():
        forms.append(_build(tmp_path, ["-O3", "-march=x86-64-v3"], "avx2"))
    raw = random_blocks(type_name, 72, 512, rng)
    w = kquant.pack(raw, type_name, 512, kernels)
    x = torch.randn(11, 512, generator=gen)
    full = kernels(x, w)
    for rows in (1, 2, 5, 8, 9):
        assert torch.equal(kernels(x[:rows].contiguous(), w), full[:rows]), rows
    loud = torch.cat([x[:1], x[1:] * 1000, torch.zeros(1, 512)])
    got = kernels(loud, w)
    assert torch.equal(got[0], full[0]) and torch.equal(got[-1], torch.zeros(72))  # a zero row: scale 0, not NaN
    for form in forms:  # (the packed weight is the same bytes whichever build packed it)
        assert torch.equal(form(x, w), full), form
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        assert torch.equal(kernels(x, w), full)
    finally:
        torch.set_num_threads(before)


def test_a_matrix_of_mixed_formats_is_its_parts_side_by_side():
    """Q4_K_M files store Q and K in Q4_K and V in Q6_K: the fused matrix keeps each part's format."""
    gen, rng = torch.Generator().manual_seed(8), np.random.default_rng(8)
    kernels = cpu_kernels.kquant_gemm()
    parts = [("Q4_K", 48), ("Q6_K", 20), ("Q8_0", 16), ("Q5_0", 7)]
    raws = [random_blocks(t, n, 256, rng) for t, n in parts]
    weights = [kquant.pack(r, t, 256, kernels) for r, (t, _) in zip(raws, parts)]
    fused = kquant.concat(weights)
    assert fused.shape == (256, 91) and fused.formats() == dict(parts)
    assert fused.nbytes == sum(w.nbytes for w in weights)
    x = torch.randn(3, 256, generator=gen)
    assert torch.equal(kernels(x, fused), torch.cat([kernels(x, w) for w in weights], 1))


@pytest.mark.parametrize("type_name", TYPES)
def test_packed_size_is_about_the_files_own(type_name):
    """Bits a weight: Q8_0 8.5, Q5_0 5.5 (the file's), Q4_K 4.625 (4.5 in the file: its 6-bit scales in bytes),
    Q6_K 6.5625 (the file's)."""
    kernels = cpu_kernels.kquant_gemm()
    bits = {"Q8_0": 8.5, "Q5_0": 5.5, "Q4_K": 4.625, "Q6_K": 6.5625}[type_name]
    assert kernels.strip_bytes(kquant.FORMATS[type_name], 512) * 8 == bits * 16 * 512
    assert kernels.strip_bytes(kquant.FORMATS[type_name], 100) == -1


@pytest.mark.parametrize("type_name", TYPES)
def test_embedding_rows_are_the_files_values_bit_for_bit(type_name):
    import gguf

    rng = np.random.default_rng(11)
    raw = random_blocks(type_name, 50, 512, rng)
    emb = kquant.QuantEmbedding(kquant.as_rows(raw), type_name, 512, cpu_kernels.kquant_gemm())
    ids = torch.tensor([[3, 49], [0, 3]])
    ref = torch.from_numpy(gguf.dequantize(raw, gguf.GGMLQuantizationType[type_name]))
    assert torch.equal(emb.lookup(ids), ref[ids])
    assert emb.shape == (50, 512) and emb.as_matrix().shape == (512, 50)
