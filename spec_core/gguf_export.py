"""Export a Llama HF folder (our shipped ``smollm2-draft``) to a GGUF file llama.cpp loads as a draft.

The file carries the target GGUF's own tokenizer fields, copied as they are, so llama.cpp accepts the two as a
speculative pair (it compares the vocabularies token by token). Matrices are stored as Q8_0 (norms in F32), Q and K
permuted as llama.cpp's own converter does for Llama (the inverse of :func:`spec_core.gguf_checkpoint.unpermute_rope`).

A draft with a reduced output vocabulary (``token_map.json``) gets an explicit output matrix: the tied embedding with
the rows outside its map zeroed. Those ids score 0, so llama.cpp proposes them only where every mapped id scores
below 0; our runner never proposes them.

``make draft-gguf`` (``python -m spec_core.gguf_export``) exports the default draft next to the model cache's other
files (:func:`exported_path`).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import numpy as np

from spec_core.arch import TOKEN_MAP_FILE
from spec_core.gguf_checkpoint import _BLOCK_NAMES, _GLOBAL_NAMES, open_gguf
from spec_core.model_paths import ModelLoadError, cache_dir, load_safetensors_dir

logger = logging.getLogger(__name__)

_TO_GGUF = {hf: g for g, hf in _GLOBAL_NAMES.items()}
_BLOCK_TO_GGUF = {hf: g for g, hf in _BLOCK_NAMES.items()}


def exported_path(folder: str | Path) -> Path:
    """Where the GGUF export of an HF folder lives: the model cache, by the folder's name."""
    return cache_dir() / "gguf-export" / f"{Path(folder).name}.gguf"


def gguf_name(hf: str) -> str:
    """The GGUF tensor name of a transformers Llama parameter."""
    if hf in _TO_GGUF:
        return _TO_GGUF[hf]
    parts = hf.split(".")  # model.layers.N.<module>.<proj>.weight
    if parts[:2] != ["model", "layers"] or ".".join(parts[3:-1]) not in _BLOCK_TO_GGUF:
        raise ModelLoadError(f"no GGUF name for the parameter {hf!r}")
    return f"blk.{parts[2]}.{_BLOCK_TO_GGUF['.'.join(parts[3:-1])]}.{parts[-1]}"


def permute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's Q/K row order: per head, rows ``(2, d/2)`` stored as ``(d/2, 2)``."""
    dim = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, 2, dim, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama_tensors(folder: Path, config: dict) -> dict[str, np.ndarray]:
    """The folder's weights in fp32 under GGUF names, Q/K permuted, with an explicit output matrix."""
    weights = {k: v.float().numpy() for k, v in load_safetensors_dir(folder).items()}
    heads, kv = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    out: dict[str, np.ndarray] = {}
    for hf, w in weights.items():
        if hf.endswith(("q_proj.weight", "k_proj.weight")):
            w = permute_rope(w, heads if "q_proj" in hf else kv)
        out[gguf_name(hf)] = w
    if "output.weight" not in out:
        out["output.weight"] = out["token_embd.weight"].copy()
    token_map = folder / TOKEN_MAP_FILE
    if token_map.is_file():
        keep = np.zeros(out["output.weight"].shape[0], dtype=bool)
        keep[json.loads(token_map.read_text())] = True
        out["output.weight"][~keep] = 0.0
    return out


def add_llama_config(writer, config: dict) -> None:
    heads = config["num_attention_heads"]
    rope = (config.get("rope_parameters") or {}).get("rope_theta") or config.get("rope_theta") or 10000.0
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config.get("num_key_value_heads") or heads)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(float(rope))
    writer.add_rope_dimension_count(config.get("head_dim") or config["hidden_size"] // heads)
    writer.add_vocab_size(config["vocab_size"])


def copy_tokenizer(writer, tokenizer_gguf: Path, vocab_size: int) -> None:
    """Every ``tokenizer.*`` field of ``tokenizer_gguf``, as stored."""
    from gguf import GGUFValueType

    reader = open_gguf(tokenizer_gguf)
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is None or len(tokens.data) != vocab_size:
        raise ModelLoadError(f"{tokenizer_gguf} has {0 if tokens is None else len(tokens.data)} tokens; "
                             f"the draft has {vocab_size}")
    for name, field in reader.fields.items():
        if name.startswith("tokenizer."):
            sub = field.types[1] if field.types[0] == GGUFValueType.ARRAY else None
            writer.add_key_value(name, field.contents(), field.types[0], sub_type=sub)


def write_tensors(writer, tensors: dict[str, np.ndarray]) -> None:
    """Matrices as Q8_0, vectors (norms) as F32."""
    from gguf import GGMLQuantizationType, quants

    for name, w in tensors.items():
        if w.ndim == 2:
            q = GGMLQuantizationType.Q8_0
            writer.add_tensor(name, quants.quantize(w, q), raw_dtype=q)
        else:
            writer.add_tensor(name, np.ascontiguousarray(w, dtype=np.float32))


def export_llama_gguf(folder: str | Path, tokenizer_gguf: str | Path, out: str | Path | None = None) -> Path:
    """Write ``folder`` (a Llama HF folder) as a GGUF file with ``tokenizer_gguf``'s tokenizer; its path."""
    from gguf import GGUFWriter

    folder, dest = Path(folder), Path(out) if out is not None else exported_path(folder)
    config = json.loads((folder / "config.json").read_text())
    if config.get("model_type") != "llama":
        raise ModelLoadError(f"only Llama folders export to GGUF here; {folder} is {config.get('model_type')!r}")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_suffix(".gguf.tmp")
    writer = GGUFWriter(str(tmp), "llama")
    writer.add_name(folder.name)
    add_llama_config(writer, config)
    copy_tokenizer(writer, Path(tokenizer_gguf), config["vocab_size"])
    write_tensors(writer, llama_tensors(folder, config))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(dest)
    return dest


def main(argv: list[str] | None = None) -> int:
    from spec_core.model_paths import default_pair, installed_target_gguf

    parser = argparse.ArgumentParser(prog="python -m spec_core.gguf_export", description=__doc__.split("\n")[0])
    parser.add_argument("--draft", default=default_pair()["draft"], help="an HF Llama folder (default: ours)")
    parser.add_argument("--tokenizer-gguf", help="the target's GGUF, whose tokenizer the file carries "
                        "(default: the default target's)")
    parser.add_argument("--out", help="the GGUF file to write (default: the model cache's gguf-export folder)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    tokenizer = args.tokenizer_gguf or installed_target_gguf()
    if tokenizer is None:
        parser.error("the default target's GGUF is not installed (run `make install`); pass --tokenizer-gguf")
    path = export_llama_gguf(args.draft, tokenizer, args.out)
    logger.info("wrote %s (%.1f MB)", path, path.stat().st_size / 1e6)
    return 0


if __name__ == "__main__":
    sys.exit(main())
