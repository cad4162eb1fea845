"""A GGUF's tensors read straight into the runner's formats (``--dtype gguf``), with no fp32 copy on disk or in
memory: every layer matrix and the output layer repacked from the file's blocks (:mod:`spec_core.backends.cpu.kquant`),
the embedding kept in its blocks, norms and biases in fp32. Names and layout are those of the fp32 conversion
(:mod:`spec_core.gguf_checkpoint`), so the runner builds its layers from either the same way.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import time
from pathlib import Path

import numpy as np
import torch

from spec_core.backends.cpu import kquant
from spec_core.gguf_checkpoint import SOURCE_RECORD, SUPPORTED_ARCHITECTURES, hf_name, unpermute_rope
from spec_core.gguf_header import read_header
from spec_core.model_paths import ModelLoadError, is_gguf

logger = logging.getLogger(__name__)

EMBEDDING = "model.embed_tokens.weight"
HEAD = "lm_head.weight"


def gguf_source(path: str | Path) -> Path | None:
    """The GGUF file behind ``path``: the file itself, or the one a converted folder's record names."""
    p = Path(path)
    if is_gguf(p) and p.is_file():
        return p
    rec = p / SOURCE_RECORD
    if rec.is_file():
        source = Path(json.loads(rec.read_text()).get("path", ""))
        return source if source.is_file() else None
    return None


def load_tensors(path: str | Path, kernels, head_rows: torch.Tensor | None = None
                 ) -> dict[str, torch.Tensor | kquant.KQuantWeight | kquant.QuantEmbedding]:
    """Every tensor of the GGUF behind ``path`` with transformers' names: matrices as
    :class:`~spec_core.backends.cpu.kquant.KQuantWeight` for ``kernels``
    (:func:`spec_core.backends.cpu.cpu_kernels.kquant_gemm`), the embedding as a
    :class:`~spec_core.backends.cpu.kquant.QuantEmbedding` (fp32 where its type is not one the kernels read), vectors in
    fp32; an output layer of the ids ``head_rows`` only, where given. ``ModelLoadError`` for a matrix in a type the
    kernels do not run."""
    source = gguf_source(path)
    if source is None:
        raise ModelLoadError(f"dtype gguf reads a GGUF file's own blocks, and {path} is not (or not converted from) "
                             "a GGUF file")
    start = time.perf_counter()
    reader = read_header(source)
    arch = reader.fields.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    heads = int(reader.fields[f"{arch}.attention.head_count"])
    kv_heads = int(reader.fields.get(f"{arch}.attention.head_count_kv") or heads)
    out: dict = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        rope_heads = (heads if "q_proj" in name else kv_heads) if arch == "llama" and name.endswith(
            ("q_proj.weight", "k_proj.weight")) else None
        out[name] = _tensor(t, name, rope_heads, kernels, head_rows if name == HEAD else None)
    logger.info("read %s in its own formats in %.1f s", source.name, time.perf_counter() - start)
    return out


def runner_tensors(path: str | Path, device: torch.device, kernels: bool, head_rows: torch.Tensor | None = None) -> dict:
    """:func:`load_tensors` for a runner on ``device``: ``ValueError`` where the compiled kernels cannot multiply
    them (another device, ``kernels`` off, or no build with AVX-512 VNNI or AVX2)."""
    from spec_core.backends.cpu import cpu_kernels

    gemm = cpu_kernels.kquant_gemm() if device.type == "cpu" and kernels else None
    if gemm is None:
        raise ValueError("dtype gguf runs on CPUs, through the compiled CPU kernels (x86 with AVX-512 VNNI, or AVX2, "
                         "FMA and F16C, and a C compiler); use int4 or float32 here")
    return load_tensors(path, gemm, head_rows)


def _tensor(t, name: str, rope_heads: int | None, kernels, rows_kept: torch.Tensor | None = None):
    """One GGUF tensor in the runner's format (see :func:`load_tensors`), of the output rows ``rows_kept`` only
    where given."""
    from gguf import dequantize

    type_name = t.tensor_type.name
    if len(t.shape) != 2:
        return torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))
    inp = int(t.shape[0])
    rows = t.data if rope_heads is None else unpermute_rope(t.data, rope_heads)  # a permutation of whole rows
    if rows_kept is not None:
        rows = np.asarray(rows)[rows_kept.numpy()]
    if name == EMBEDDING and type_name in kquant.FORMATS:  # a copy: the table outlives the file's mapping
        return kquant.QuantEmbedding(torch.from_numpy(np.array(rows)), type_name, inp, kernels)
    if name == EMBEDDING:
        return torch.from_numpy(np.array(dequantize(rows, t.tensor_type), dtype=np.float32))
    if type_name not in kquant.FORMATS:
        raise ModelLoadError(f"dtype gguf runs {', '.join(kquant.FORMATS)} matrices, and {t.name} is {type_name}; "
                             "use --dtype int4 or float32 for this file")
    return kquant.pack(rows, type_name, inp, kernels)


def kquant_types(reader) -> dict[str, int]:
    """The storage types of the file's matrices that a forward multiplies (layers and the output layer, which is the
    embedding where the file has none), by element count."""
    names = {t.name for t in reader.tensors}
    head = "output.weight" if "output.weight" in names else "token_embd.weight"
    counts: dict[str, int] = {}
    for t in reader.tensors:
        if len(t.shape) == 2 and (t.name.startswith("blk.") or t.name == head):
            counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + int(t.n_elements)
    return counts


def native_gguf(path: str, device: str = "cpu", vnni: bool = False) -> bool:
    """Whether the model at ``path`` is a GGUF (or converted from one) whose every multiplied matrix is in a format
    the compiled K-quant matmuls run, some of them K-quants (:func:`runs_natively`), and ``device`` is a CPU where
    those kernels run (``vnni``: with AVX-512 VNNI, where they were measured faster than int4's; the AVX2 form, run
    on the same EPYC, took about twice as long a row and was not measured on an AVX2-only CPU)."""
    from spec_core.backends.cpu import cpu_kernels

    if not str(device).startswith("cpu") or not runs_natively(native_types(str(path))):
        return False
    kernels = cpu_kernels.kquant_gemm()
    return kernels is not None and (not vnni or kernels.simd == 2)


def runs_natively(types: dict[str, int]) -> bool:
    """Whether a file with these matrix types (:func:`kquant_types`) runs in its own formats: every one a format the
    kernels read, and some in K-quants (files of Q4_0/Q4_1 matrices are ``int4``'s own)."""
    return bool(types) and set(types) <= set(kquant.FORMATS) and bool({"Q4_K", "Q6_K"} & set(types))


@functools.lru_cache(maxsize=64)
def native_types(path: str) -> dict[str, int]:
    """:func:`kquant_types` of the GGUF behind ``path`` (none for other models): from a converted folder's record,
    where it notes them, else from the file (seconds: the reader parses the whole vocabulary), noted in the record
    where there is one."""
    p = Path(path)
    rec = p / SOURCE_RECORD
    record = json.loads(rec.read_text()) if rec.is_file() else None
    if record is not None and "kquant_types" in record:
        return record["kquant_types"]
    source = gguf_source(p)
    if source is None:
        return {}
    types = kquant_types(read_header(source))
    if record is not None:
        tmp = rec.with_name(f".{rec.name}.{os.getpid()}")
        tmp.write_text(json.dumps({**record, "kquant_types": types}, indent=1) + "\n")
        os.replace(tmp, rec)
    return types
