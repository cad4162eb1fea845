"""The models this package ships (the default draft and the toy pair), packed small, and their unpacked folders.

A packed model is a folder with the small files of a Hugging Face folder as they are (config, tokenizer config,
token map, card) and two compressed ones:

- ``model.q8.safetensors.xz``: every matrix as int8 codes with one bf16 scale per group of :data:`GROUP` values
  of a row (llama.cpp's Q8_0 layout: 8.5 bits a weight), every other tensor as it is; xz-compressed;
- ``tokenizer.json.xz``.

``pack.json`` records the packed weights' sha256. :func:`unpacked` builds, once per packed content, a plain HF folder
in the model cache: bf16 weights ``codes × scale``, rounded once. That folder *is* the model: every loader, ours
and transformers', reads the same bf16 values, so exactness tests compare like with like.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import os
import shutil
import tempfile
from pathlib import Path

from spec_core.model_paths import assets_dir, cache_dir

GROUP = 32
PACKED_WEIGHTS = "model.q8.safetensors.xz"
PACKED_TOKENIZER = "tokenizer.json.xz"
MANIFEST = "pack.json"
_SUFFIX_CODES, _SUFFIX_SCALES = ".q8", ".q8scale"


def packed_dir(name: str) -> Path:
    return assets_dir() / "models" / name


def unpacked(name: str) -> Path:
    """The HF folder of the shipped model ``name``, unpacked into the model cache on first use."""
    return unpack(packed_dir(name))


def unpack(folder: str | Path) -> Path:
    """The cache folder of the packed model in ``folder`` (built atomically if missing; safe across processes)."""
    folder = Path(folder)
    digest = json.loads((folder / MANIFEST).read_text())["sha256"]
    out = cache_dir() / "assets" / f"{folder.name}-{digest[:12]}"
    if (out / "config.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=out.parent))
    try:
        _write_unpacked(folder, tmp)
        try:
            os.rename(tmp, out)
        except OSError:  # another process got there first: its folder has the same content
            if not (out / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _write_unpacked(folder: Path, out: Path) -> None:
    from safetensors.torch import load, save_file

    for f in folder.iterdir():
        if f.name in (PACKED_WEIGHTS, PACKED_TOKENIZER, MANIFEST) or not f.is_file():
            continue
        shutil.copy2(f, out / f.name)
    (out / "tokenizer.json").write_bytes(lzma.decompress((folder / PACKED_TOKENIZER).read_bytes()))
    tensors = load(lzma.decompress((folder / PACKED_WEIGHTS).read_bytes()))
    save_file(dequantize(tensors), str(out / "model.safetensors"), metadata={"format": "pt"})


def quantize(tensors: dict) -> dict:
    """Q8 groups for every 2-D tensor whose rows split into groups of :data:`GROUP`; the rest as it is."""
    import torch

    out = {}
    for name, t in tensors.items():
        if t.dim() != 2 or t.shape[1] % GROUP:
            out[name] = t.contiguous()
            continue
        groups = t.float().reshape(t.shape[0], -1, GROUP)
        scale = (groups.abs().amax(-1, keepdim=True) / 127).to(torch.bfloat16)
        safe = torch.where(scale == 0, torch.ones_like(scale), scale).float()
        out[name + _SUFFIX_CODES] = (groups / safe).round().clamp(-127, 127).to(torch.int8).reshape(t.shape)
        out[name + _SUFFIX_SCALES] = scale.squeeze(-1).contiguous()
    return out


def dequantize(tensors: dict) -> dict:
    """The bf16 model of :func:`quantize`'s output (every tensor bf16, as the shipped folders were)."""
    import torch

    out = {}
    for name, t in tensors.items():
        if name.endswith(_SUFFIX_SCALES):
            continue
        if name.endswith(_SUFFIX_CODES):
            base = name.removesuffix(_SUFFIX_CODES)
            scale = tensors[base + _SUFFIX_SCALES].float()[:, :, None]
            values = t.float().reshape(t.shape[0], -1, GROUP) * scale
            out[base] = values.reshape(t.shape).to(torch.bfloat16).contiguous()
        else:
            out[name] = t.to(torch.bfloat16).contiguous() if t.is_floating_point() else t
    return out


def pack(folder: str | Path, out: str | Path) -> Path:
    """Pack the HF folder ``folder`` (one ``model.safetensors``, a ``tokenizer.json``) into ``out``."""
    from safetensors.torch import load_file, save

    folder, out = Path(folder), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for f in folder.iterdir():
        if f.is_file() and f.name not in ("model.safetensors", "tokenizer.json"):
            shutil.copy2(f, out / f.name)
    weights = lzma.compress(save(quantize(load_file(str(folder / "model.safetensors")))), preset=9)
    (out / PACKED_WEIGHTS).write_bytes(weights)
    (out / PACKED_TOKENIZER).write_bytes(lzma.compress((folder / "tokenizer.json").read_bytes(), preset=9))
    (out / MANIFEST).write_text(json.dumps({"sha256": hashlib.sha256(weights).hexdigest(), "group": GROUP}) + "\n")
    return out
