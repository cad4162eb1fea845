"""The training corpus: the Python standard library's own source, which every machine has.

Test folders are excluded, and a fixed list of modules is held out for evaluation (never trained on).
Documents are joined with the EOS token, so the models learn where a file ends.
"""

from __future__ import annotations

import logging
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

EOS_TOKEN = "<|endoftext|>"

#: Folders skipped anywhere in the tree: tests, caches, third-party code.
EXCLUDED_DIRS = frozenset(
    {"test", "tests", "idle_test", "__pycache__", "site-packages", "dist-packages", "lib2to3", "ensurepip"}
)

#: Held-out files (relative to the stdlib root), excluded from training and used for the quality report.
HELDOUT_FILES = (
    "argparse.py",
    "textwrap.py",
    "csv.py",
    "fractions.py",
    "heapq.py",
    "shlex.py",
    "difflib.py",
    "statistics.py",
    "json/decoder.py",
    "json/encoder.py",
)


@dataclass(frozen=True, slots=True)
class Corpus:
    """Source texts split into training and held-out documents, in a stable (sorted) order."""

    root: Path
    train: tuple[tuple[str, str], ...]
    heldout: tuple[tuple[str, str], ...]

    @property
    def train_chars(self) -> int:
        return sum(len(text) for _, text in self.train)


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _is_excluded(rel_dir: str) -> bool:
    parts = Path(rel_dir).parts
    return any(p in EXCLUDED_DIRS or p.startswith("test") for p in parts)


def load_corpus(root: Path | None = None, max_files: int | None = None) -> Corpus:
    """Read every ``.py`` file under the stdlib root, minus test folders, split train / held-out.

    ``max_files`` keeps the first N training files (sorted), for smoke tests on a tiny slice.
    """
    root = root or stdlib_root()
    heldout_set = set(HELDOUT_FILES)
    train: list[tuple[str, str]] = []
    heldout: list[tuple[str, str]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        dirnames[:] = sorted(d for d in dirnames if not _is_excluded(os.path.join(rel_dir, d)))
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            rel = os.path.normpath(os.path.join(rel_dir, name))
            try:
                text = Path(dirpath, name).read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                logger.debug("skipping unreadable %s", rel)
                continue
            (heldout if rel in heldout_set else train).append((rel, text))
    train.sort()
    heldout.sort()
    if max_files is not None:
        train = train[:max_files]
    if not train:
        raise ValueError(f"no training files found under {root}")
    return Corpus(root=root, train=tuple(train), heldout=tuple(heldout))
