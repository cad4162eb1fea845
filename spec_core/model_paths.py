"""Where models live and whether a folder is one: the shipped pair's paths and a folder check.

Imports nothing heavy (no torch, no transformers), so commands can check paths before loading anything.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path


class ModelLoadError(ValueError):
    """A model folder is missing, malformed, or incompatible with its partner."""


def assets_dir() -> Path:
    return Path(str(resources.files("spec_core") / "assets"))


def default_pair() -> dict[str, str]:
    """Paths of the shipped target/draft pair (HF folders installed as package data)."""
    base = assets_dir() / "models"
    return {"target": str(base / "target"), "draft": str(base / "draft")}


def check_model_dir(path: str | Path) -> Path:
    p = Path(path)
    if not p.is_dir():
        raise ModelLoadError(f"model path not found: {p}")
    if not (p / "config.json").is_file():
        raise ModelLoadError(f"not a Hugging Face model folder (no config.json): {p}")
    if not any(p.glob("*.safetensors")):
        raise ModelLoadError(f"no .safetensors weights in {p}")
    return p
