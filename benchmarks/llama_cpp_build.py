"""Build the peer's binaries: llama.cpp as vendored in the ``llama-cpp-python`` sdist, into the model cache.

``make llama-cpp`` (``python -m benchmarks.llama_cpp_build``) downloads the sdist with pip, builds
``llama-speculative-simple`` (the bench mode ``llama-cpp-spec``), ``llama-completion`` (the ``llama-cpp`` AR modes
when ``llama-cpp-python`` is not installed) and ``llama-bench`` with ``-DGGML_NATIVE=ON``, statically linked, and
copies them to :func:`bin_dir` (``$SSD_LLAMA_CPP_DIR/bin`` when that is set). :data:`BUILD_RECORD` beside them records what was built: the sdist's version and
sha256, the llama.cpp commit its changelog names, the CMake flags and the compiler. About 6 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from spec_core.model_paths import cache_dir

logger = logging.getLogger(__name__)

SDIST_VERSION = "0.3.36"
SDIST = f"llama-cpp-python=={SDIST_VERSION}"
TARGETS = ("llama-speculative-simple", "llama-completion", "llama-bench")
CMAKE_FLAGS = ("-DGGML_NATIVE=ON", "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_CURL=OFF",
               "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_TESTS=OFF")
BUILD_RECORD = "build.json"


@dataclass(frozen=True, slots=True)
class BuildRecord:
    """What :func:`build` built, written to ``build.json`` beside the binaries and copied into bench rows."""

    llama_cpp_python: str  #: the sdist's version
    sdist_sha256: str
    llama_cpp_commit: str  #: the upstream commit the sdist's changelog names for this version
    cmake_flags: tuple[str, ...]
    compiler: str  #: the C compiler CMake found, e.g. ``GNU 12.2.0``
    binaries: tuple[str, ...]
    built_at: str
    build_s: float


def llama_cpp_dir() -> Path:
    """The build's folder: ``$SSD_LLAMA_CPP_DIR`` (a build of your own: its ``bin/`` and ``build.json``), else the
    model cache's, one per sdist version."""
    if os.environ.get("SSD_LLAMA_CPP_DIR"):
        return Path(os.environ["SSD_LLAMA_CPP_DIR"])
    return cache_dir() / "llama.cpp" / f"llama-cpp-python-{SDIST_VERSION}"


def bin_dir() -> Path:
    return llama_cpp_dir() / "bin"


def binary(name: str) -> Path | None:
    """A built binary's path, or ``None`` when it is not built."""
    p = bin_dir() / name
    return p if p.is_file() else None


def read_record() -> dict | None:
    """The build record as a dict, or ``None`` when nothing is built."""
    p = llama_cpp_dir() / BUILD_RECORD
    return json.loads(p.read_text()) if p.is_file() else None


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def download_sdist(dest: Path) -> Path:
    """The sdist, downloaded with pip (no binary, no dependencies)."""
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-q", "-d",
                    str(dest), SDIST], check=True)
    (sdist,) = dest.glob("llama_cpp_python-*.tar.gz")
    return sdist


def unpack(sdist: Path, dest: Path) -> Path:
    """The sdist's vendored llama.cpp source folder."""
    with tarfile.open(sdist) as tar:
        tar.extractall(dest, filter="data")
    return dest / f"llama_cpp_python-{SDIST_VERSION}" / "vendor" / "llama.cpp"


def upstream_commit(changelog: Path) -> str:
    """The llama.cpp commit the changelog's entry for :data:`SDIST_VERSION` names (``unknown`` if none)."""
    section = changelog.read_text().split(f"## [{SDIST_VERSION}]", 1)[-1].split("\n## [", 1)[0]
    m = re.search(r"llama\.cpp@([0-9a-f]{7,40})", section)
    return m.group(1) if m else "unknown"


def compiler(build: Path) -> str:
    """The C compiler CMake configured, from its cache."""
    cache = (build / "CMakeCache.txt").read_text()
    path = re.search(r"^CMAKE_C_COMPILER:\w+=(.+)$", cache, re.M)
    if path is None:
        return "unknown"
    version = subprocess.run([path.group(1), "--version"], capture_output=True, text=True).stdout.splitlines()
    return version[0] if version else path.group(1)


def cmake(src: Path, build: Path, jobs: int) -> None:
    subprocess.run(["cmake", "-S", str(src), "-B", str(build), *CMAKE_FLAGS], check=True)
    subprocess.run(["cmake", "--build", str(build), "-j", str(jobs), "--target", *TARGETS], check=True)


def install_binaries(build: Path) -> tuple[str, ...]:
    """Copy the built targets to :func:`bin_dir`; their paths."""
    bin_dir().mkdir(parents=True, exist_ok=True)
    out = []
    for name in TARGETS:
        dst = bin_dir() / name
        shutil.copy2(build / "bin" / name, dst)
        out.append(str(dst))
    return tuple(out)


def build(jobs: int = 2) -> BuildRecord:
    """Download, configure, build and install; write and return the record."""
    t0 = time.monotonic()
    llama_cpp_dir().mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=llama_cpp_dir()) as tmp:
        work = Path(tmp)
        sdist = download_sdist(work)
        src = unpack(sdist, work)
        cmake(src, work / "build", jobs)
        record = BuildRecord(
            llama_cpp_python=SDIST_VERSION, sdist_sha256=sha256_of(sdist),
            llama_cpp_commit=upstream_commit(src.parent.parent / "CHANGELOG.md"), cmake_flags=CMAKE_FLAGS,
            compiler=compiler(work / "build"), binaries=install_binaries(work / "build"),
            built_at=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), build_s=round(time.monotonic() - t0, 1))
    (llama_cpp_dir() / BUILD_RECORD).write_text(json.dumps(asdict(record), indent=1) + "\n")
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.llama_cpp_build", description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=2, help="parallel compile jobs (default 2)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    record = build(args.jobs)
    logger.info("built llama.cpp %s (llama-cpp-python %s) in %.0f s: %s", record.llama_cpp_commit,
                record.llama_cpp_python, record.build_s, ", ".join(record.binaries))
    return 0


if __name__ == "__main__":
    sys.exit(main())
