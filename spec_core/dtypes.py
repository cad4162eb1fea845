"""Dtype names and how ``auto`` and the draft's dtype resolve them for a model and a device (re-exported by
:mod:`spec_core.config`).

Imports no torch at module level, so the CLI validates flags and input files before paying for torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
           "float16": "float16", "fp16": "float16", "auto": "auto", "int8": "int8",
           "int4": "int4", "w8a8": "w8a8", "gguf": "gguf"}
#: Quantized formats (weight-only int8 and int4; w8a8 also quantizes the matrices' inputs; gguf keeps a GGUF file's
#: own formats): their weights are stored quantized; everything else computes in the given dtype.
WEIGHT_ONLY = {"int8": "float32", "int4": "float32", "w8a8": "float32", "gguf": "float32"}


def check_dtype(name: str) -> str:
    """The canonical dtype name for ``name`` (``ValueError`` if unknown); ``auto`` stays ``auto``."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; choose one of {', '.join(sorted(_DTYPES))}") from None


def native_bf16(device: str = "cpu") -> bool:
    """Whether ``device`` has native bf16 matrix support: CPU AVX512-BF16 or AMX, or a CUDA GPU that has it."""
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)
    if dev.type != "cpu":
        return False
    cpu = torch.backends.cpu.get_cpu_capability()
    return cpu in ("AVX512", "AMX") and bool(torch.cpu._is_avx512_bf16_supported())


def resolve_dtype(name: str, device: str = "cpu", path: str | None = None, kernels: bool = True) -> str:
    """The concrete dtype name. ``auto`` becomes, on a CPU with the compiled kernels (``kernels``), the model's own
    format where ``path`` is a quantized GGUF or converted from one: ``gguf`` for a file of K-quants (and Q5_0,
    Q8_0) on a CPU with AVX-512 VNNI (:func:`spec_core.gguf_weights.native_gguf`: there faster than int4 and closer
    to fp32 on the Qwen2.5-Coder pair, docs/models.md), else ``int4`` for a 4-bit file (the fastest dtype on every
    CPU measured, and what llama.cpp users run); else ``bfloat16`` where :func:`native_bf16`, else ``float32``."""
    from spec_core.gguf_weights import native_gguf

    name = check_dtype(name)
    if name != "auto":
        return name
    if path is not None and kernels and native_gguf(path, device, vnni=True):
        return "gguf"
    if path is not None and kernels and native_int4(path, device):
        return "int4"
    return "bfloat16" if native_bf16(device) else "float32"


def native_int4(path: str, device: str = "cpu") -> bool:
    """Whether the model at ``path`` is stored in 4 bits (a GGUF's Q4 layers) and ``device`` is a CPU whose
    compiled quantized matmuls run them."""
    from spec_core.backends.cpu import cpu_kernels
    from spec_core.gguf_checkpoint import native_format

    if not str(device).startswith("cpu") or native_format(str(path)) != "int4":
        return False
    return cpu_kernels.quant_gemm() is not None


def parse_dtype(name: str, device: str = "cpu") -> torch.dtype:
    """The compute dtype (activations, KV cache) for ``name``: ``int8`` and ``int4`` compute in fp32
    (:mod:`spec_core.backends.cpu.quant`)."""
    import torch

    name = resolve_dtype(name, device)
    return getattr(torch, WEIGHT_ONLY.get(name, name))


def draft_dtype(name: str, kernels: bool = True, path: str | None = None) -> str:
    """The draft's dtype when a run asks for ``name``: for a weight format (int4, int8, w8a8, gguf), ``int4`` where
    the compiled quantized matmuls run (``kernels``, and :func:`spec_core.backends.cpu.cpu_kernels.quant_gemm`), else
    ``auto``; otherwise ``name``. Under ``gguf``, a draft at ``path`` that runs in its own formats
    (:func:`spec_core.gguf_weights.native_gguf`) runs as ``gguf`` too.

    On an int4 target the draft in int4 accepts as the draft in float does and costs a fraction of it: smollm2-draft
    on 4 HumanEval prompts x 64 greedy tokens at K = 3 accepted 0.27 against bf16's 0.28 (6 chat prompts: 0.19
    against 0.21), at T(1) 0.51 ms against bf16 3.48, int8 1.72 and w8a8 2.06 (and 3.46 ms against 4.27 for a
    12-row branch step), so SSD ran 1.17-1.25x AR against 1.13-1.14x (chat: 1.02-1.09x against 0.87-0.89x) on a
    2-vCPU AMD EPYC with AVX-512 BF16. It needs no calibration text, so any draft folder takes it.
    """
    name = check_dtype(name)  # (``auto`` never resolves to a weight-only format, so no device is needed)
    if name not in WEIGHT_ONLY:
        return name
    from spec_core.backends.cpu import cpu_kernels
    from spec_core.gguf_weights import native_gguf

    if name == "gguf" and kernels and path is not None and native_gguf(str(path)):
        return "gguf"

    return "int4" if kernels and cpu_kernels.quant_gemm() is not None else "auto"


def weight_format(name: str, device: str = "cpu") -> str | None:
    """``int8``, ``int4`` or ``w8a8`` for a quantized dtype, else None (weights in the compute dtype)."""
    name = resolve_dtype(name, device)
    return name if name in WEIGHT_ONLY else None
