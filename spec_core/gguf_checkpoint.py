"""GGUF files as checkpoints: read a llama.cpp model file and write an HF folder our runner (and transformers) loads.

The conversion is a pure function of the file: weights are dequantized with the ``gguf`` library to fp32 (exactly
the values llama.cpp computes from the blocks), names are mapped to transformers' Llama/Qwen names, and the Q/K
projections of Llama-family files are un-permuted (llama.cpp's converter interleaves their rotary halves). The
config and tokenizer come from transformers' own GGUF readers, so the folder also loads with
``AutoModelForCausalLM.from_pretrained``. The folder records the file's sha256 in ``gguf_source.json``; a folder
whose record does not match is converted again.

Supported families: Llama (and Mistral, which llama.cpp files as llama), Qwen2, Qwen3.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path

import numpy as np

from spec_core.model_paths import ModelLoadError

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")
SOURCE_RECORD = "gguf_source.json"
_MAGIC = b"GGUF"

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


def sha256_file(path: str | Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def hf_name(gguf_name: str) -> str:
    """The transformers parameter name of a GGUF tensor (``ModelLoadError`` for a tensor we do not know)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK_RE.match(gguf_name)
    if m is None or m.group(2) not in _BLOCK_NAMES:
        raise ModelLoadError(f"unsupported tensor {gguf_name!r} in GGUF file")
    return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"


def unpermute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (per head, rows ``(2, d/2)`` were stored as ``(d/2, 2)``)."""
    dim = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def open_gguf(path: str | Path):
    """A ``gguf.GGUFReader`` over ``path``; a missing, truncated or corrupt file is one ``ModelLoadError`` line."""
    from gguf import GGUFReader

    p = Path(path)
    if not p.is_file():
        raise ModelLoadError(f"GGUF file not found: {p}")
    with open(p, "rb") as f:
        if f.read(4) != _MAGIC:
            raise ModelLoadError(f"not a GGUF file (bad magic): {p}")
    try:
        reader = GGUFReader(str(p))
    except Exception as exc:  # the reader raises ValueError/IndexError/struct errors on damaged files
        raise ModelLoadError(f"corrupt or truncated GGUF file {p}: {type(exc).__name__}: {exc}") from exc
    size = p.stat().st_size
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size or t.data.nbytes != t.n_bytes:
            raise ModelLoadError(f"truncated GGUF file {p}: tensor {t.name} ends past the end of the file")
    return reader


def _field(reader, key: str):
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def architecture(reader) -> str:
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    return arch


def dequantized_state_dict(reader, desc: str = "dequantize") -> dict[str, np.ndarray]:
    """Every tensor of the file in fp32 with transformers' names and layout (Llama Q/K un-permuted).

    Shows a progress bar (one step per tensor) on stderr when stderr is a terminal; never writes to stdout."""
    from gguf import dequantize
    from tqdm import tqdm

    arch = architecture(reader)
    n_heads = int(_field(reader, f"{arch}.attention.head_count"))
    n_kv = int(_field(reader, f"{arch}.attention.head_count_kv") or n_heads)
    out: dict[str, np.ndarray] = {}
    for t in tqdm(reader.tensors, desc=desc, unit="tensor", disable=None, leave=False):
        name = hf_name(t.name)
        try:
            w = np.ascontiguousarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        except (NotImplementedError, ValueError) as exc:
            raise ModelLoadError(f"cannot dequantize {t.name} ({t.tensor_type.name}): {exc}") from exc
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            w = unpermute_rope(w, n_heads if "q_proj" in name else n_kv)
        out[name] = w
    return out


def _write_folder(gguf_path: Path, out: Path, digest: str, weights: bool = True) -> None:
    """Write the HF folder for ``gguf_path`` into ``out`` (which must be empty): config, tokenizer, generation
    config and source record, then (``weights``) the fp32 weights. A progress bar goes to stderr when stderr is a
    terminal; nothing is written to stdout."""
    from tqdm import tqdm

    reader = open_gguf(gguf_path)
    steps = ["config", "tokenizer"] + (["weights"] if weights else [])
    bar = tqdm(total=len(steps), desc=f"convert {gguf_path.name}", unit="step", disable=None, postfix=steps[0])
    _write_metadata(reader, gguf_path, out, digest, bar)
    if weights:
        _write_weights(reader, out, digest)
        bar.update(1)
    bar.close()


def _write_metadata(reader, gguf_path: Path, out: Path, digest: str, bar) -> None:
    """The folder's config (from the GGUF's header, through transformers' reader), tokenizer, generation config and
    source record: everything but the weights."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    from spec_core.gguf_weights import kquant_types

    src_dir, name = str(gguf_path.parent), gguf_path.name
    config = AutoConfig.from_pretrained(src_dir, gguf_file=name)
    for attr in ("quantization_config", "_name_or_path"):
        if hasattr(config, attr):
            delattr(config, attr)
    key_length = _field(reader, f"{architecture(reader)}.attention.key_length")
    if key_length is not None:  # transformers' reader leaves Qwen3's head_dim at its default
        config.head_dim = int(key_length)
    config.dtype = "float32"
    config.save_pretrained(out)
    bar.update(1)
    bar.set_postfix_str("tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    template = _field(reader, "tokenizer.chat_template")
    if template and not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = template
    tokenizer.save_pretrained(out)
    eos = [i for i in {config.eos_token_id, tokenizer.eos_token_id} if i is not None]
    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=eos[0] if len(eos) == 1 else sorted(eos),
                     pad_token_id=getattr(config, "pad_token_id", None)).save_pretrained(out)
    (out / SOURCE_RECORD).write_text(json.dumps({"file": gguf_path.name, "path": str(Path(gguf_path).resolve()),
                                                 "sha256": digest, "architecture": architecture(reader),
                                                 "matrix_types": matrix_types(reader),
                                                 "kquant_types": kquant_types(reader)}, indent=1) + "\n")
    bar.update(1)
    bar.set_postfix_str("weights")


def _write_weights(reader, out: Path, digest: str) -> None:
    """The fp32 weights (``model.safetensors``) into a folder that has its config, written atomically."""
    import torch
    from safetensors.torch import save_file

    weights = dequantized_state_dict(reader)
    if json.loads((out / "config.json").read_text()).get("tie_word_embeddings"):
        weights.pop("lm_head.weight", None)
    tmp = out / f".model.safetensors.{os.getpid()}"
    try:
        save_file({k: torch.from_numpy(np.array(v)) for k, v in weights.items()}, str(tmp),
                  metadata={"format": "pt", "gguf_sha256": digest})
        os.replace(tmp, out / "model.safetensors")
    finally:
        tmp.unlink(missing_ok=True)


def matrix_types(reader) -> dict[str, int]:
    """The storage types of the file's layer matrices (the embeddings and the head aside), by element count."""
    counts: dict[str, int] = {}
    for t in reader.tensors:
        if t.name.startswith("blk.") and len(t.shape) == 2:
            counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + int(t.n_elements)
    return counts


#: The weight format that keeps a GGUF's own layer quantization (4-bit files run as ``int4``).
_FORMATS = {"Q4_0": "int4", "Q4_1": "int4", "Q4_K": "int4"}


@functools.lru_cache(maxsize=64)
def native_format(path: str) -> str | None:
    """``int4`` for a 4-bit GGUF file, or the folder converted from one (most of its layer matrices' elements in
    Q4_0, Q4_1 or Q4_K), else None. Reads the folder's source record; where the record predates the types it
    notes, reads them once from the file (seconds: the reader parses the whole vocabulary) into the record."""
    p = Path(path)
    rec = p / SOURCE_RECORD
    if rec.is_file():
        record = json.loads(rec.read_text())
        types = record.get("matrix_types")
        source = Path(record.get("path", ""))
        if types is None and source.is_file():
            types = matrix_types(open_gguf(source))
            tmp = rec.with_name(f".{rec.name}.{os.getpid()}")
            tmp.write_text(json.dumps({**record, "matrix_types": types}, indent=1) + "\n")
            os.replace(tmp, rec)
    elif p.is_file() and p.suffix.lower() == ".gguf":
        types = matrix_types(open_gguf(p))
    else:
        return None
    return _FORMATS.get(max(types, key=types.get)) if types else None


def converted_ok(folder: Path, digest: str, weights: bool = True) -> bool:
    """Whether ``folder`` holds the conversion of the file with this digest (with its fp32 weights, or without)."""
    rec = folder / SOURCE_RECORD
    if not rec.is_file() or (weights and not (folder / "model.safetensors").is_file()):
        return False
    try:
        return json.loads(rec.read_text()).get("sha256") == digest
    except (OSError, ValueError):
        return False


def convert_gguf(gguf_path: str | Path, out_dir: str | Path | None = None,
                 expected_sha256: str | None = None, weights: bool = True) -> Path:
    """Convert ``gguf_path`` into the HF folder ``out_dir`` (atomically), unless it already holds this file.

    ``out_dir`` defaults to the cache folder for this file's content. ``expected_sha256`` checks the file first
    (a mismatch is a ``ModelLoadError``). ``weights=False`` writes everything but the fp32 weights (seconds, not
    minutes); a later call that needs them adds them to the same folder.
    """
    from spec_core.model_paths import gguf_cache_folder

    src = Path(gguf_path)
    if not src.is_file():
        raise ModelLoadError(f"GGUF file not found: {src}")
    digest = sha256_file(src)
    if expected_sha256 is not None and digest != expected_sha256:
        raise ModelLoadError(f"{src}: sha256 {digest} does not match the expected {expected_sha256}")
    out = Path(out_dir) if out_dir is not None else gguf_cache_folder(src, digest)
    if converted_ok(out, digest, weights):
        return out
    if weights and converted_ok(out, digest, weights=False):
        logger.info("writing the fp32 weights of %s into %s", src, out)
        _write_weights(open_gguf(src), out, digest)
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        logger.info("converting %s -> %s", src, out)
        _write_folder(src, tmp, digest, weights)
        tmp.chmod(0o755)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
