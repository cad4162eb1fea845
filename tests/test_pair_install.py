"""``ssd install-models --pair``: part wheels made here (no network) are installed through the real pip path, joined
in order and checked; corrupted, missing or wrong parts fail with one line; nothing from the wheels is imported."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import sys
import zipfile
from pathlib import Path

import pytest

from spec_core import pairs
from spec_core.model_paths import model_name
from spec_core.pair_install import WheelSource, install_pair
from spec_core.pairs import PAIRS, Pair, PartWheel, SlicedGguf, get_pair, pair_paths, sliced_wheels
from ssd_cli.main import main

VERSION = "0.1.0"
#: Distinct slices of distinct sizes: any other order or a dropped slice changes the joined digest.
TARGET_SLICES = (b"GGUF" + bytes(range(256)) * 3, b"\x01" * 777, b"tail")
DRAFT_SLICES = (b"GGUF-draft-" * 40, b"\x02" * 33)


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def write_wheel(folder: Path, dist: str, files: dict[str, bytes]) -> Path:
    """A minimal pure-Python wheel of ``dist`` holding ``files``."""
    pkg = dist.replace("-", "_")
    info = f"{pkg}-{VERSION}.dist-info"
    entries = {**files,
               f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: {VERSION}\n".encode(),
               f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{name},{_record_hash(data)},{len(data)}\n" for name, data in entries.items())
    entries[f"{info}/RECORD"] = (record + f"{info}/RECORD,,\n").encode()
    path = folder / f"{pkg}-{VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for name, data in entries.items():
            z.writestr(name, data)
    return path


def make_parts(folder: Path, prefix: str, slices: tuple[bytes, ...], marker: Path) -> SlicedGguf:
    """One wheel per slice (each with an ``__init__.py`` that would leave ``marker`` if imported), and its entry."""
    folder.mkdir(parents=True, exist_ok=True)
    trap = f"open({str(marker)!r}, 'a').write(__name__)\nraise RuntimeError('imported')\n".encode()
    hashes = []
    for i, data in enumerate(slices, start=1):
        pkg = f"{prefix}{i}".replace("-", "_")
        wheel = write_wheel(folder, f"{prefix}{i}", {f"{pkg}/__init__.py": trap, f"{pkg}/data/part{i:02d}.bin": data})
        hashes.append(hashlib.sha256(wheel.read_bytes()).hexdigest())
    joined = b"".join(slices)
    return SlicedGguf(f"{prefix}joined.gguf", len(joined), hashlib.sha256(joined).hexdigest(),
                      sliced_wheels(prefix, VERSION, tuple(hashes)), model="fake")


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A fake pair in the registry, its wheels in a local folder, the model cache in ``tmp_path``."""
    monkeypatch.setenv("SSD_CACHE_DIR", str(tmp_path / "cache"))
    wheels, marker = tmp_path / "wheels", tmp_path / "imported.marker"
    pair = Pair("fake-pair", make_parts(wheels, "fake-target-part", TARGET_SLICES, marker),
                make_parts(wheels, "fake-draft-part", DRAFT_SLICES, marker), licence="none", provenance="this test")
    monkeypatch.setattr(pairs, "PAIRS", {**PAIRS, pair.name: pair})
    return pair, wheels, marker


def _install(wheels: Path, capsys) -> tuple[int, str, str]:
    rc = main(["install-models", "--pair", "fake-pair", "--find-links", str(wheels)])
    out, err = capsys.readouterr()
    return rc, out, err


def _one_line_error(rc: int, err: str) -> str:
    assert rc == 2 and err.startswith("ssd: error: ") and err.count("\n") == 1, err
    return err


def test_installs_joins_in_order_and_imports_nothing(fake, capsys) -> None:
    pair, wheels, marker = fake
    rc, out, err = _install(wheels, capsys)
    assert rc == 0, err
    paths = json.loads(out)
    assert paths == pair_paths(pair)
    assert Path(paths["target"]).read_bytes() == b"".join(TARGET_SLICES)
    assert Path(paths["draft"]).read_bytes() == b"".join(DRAFT_SLICES)
    assert not marker.exists()
    assert not any(name.startswith(("fake_target_part", "fake_draft_part")) for name in sys.modules)
    assert sorted(p.name for p in Path(paths["target"]).parent.iterdir()) == sorted(
        [pair.target.file_name, pair.draft.file_name])  # the private wheel folder is gone
    assert main(["models", "--pair", "fake-pair"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out) == paths and err == ""
    assert _install(wheels, capsys)[0] == 0  # installed already: kept


def test_models_says_how_to_install(fake, capsys) -> None:
    assert main(["models", "--pair", "fake-pair"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out) == pair_paths(fake[0])
    assert err.count("\n") == 1 and "ssd install-models --pair fake-pair" in err
    rc = main(["generate", "--pair", "fake-pair", "--prompt", "x"])
    assert "not installed" in _one_line_error(rc, capsys.readouterr().err)


def test_corrupted_wheel_refused(fake, capsys) -> None:
    pair, wheels, marker = fake
    write_wheel(wheels, "fake-target-part2", {"fake_target_part2/data/part02.bin": b"\x01" * 776 + b"\x00"})
    err = _one_line_error(*_install(wheels, capsys)[::2])
    assert "fake-target-part2==0.1.0" in err and "does not match the pinned hash" in err
    assert not Path(pair_paths(pair)["target"]).exists() and not marker.exists()


def test_missing_wheel_refused(fake, capsys) -> None:
    pair, wheels, _ = fake
    (wheels / f"fake_draft_part2-{VERSION}-py3-none-any.whl").unlink()
    err = _one_line_error(*_install(wheels, capsys)[::2])
    assert "fake-draft-part2" in err and not Path(pair_paths(pair)["draft"]).exists()


def test_missing_slice_refused(fake, tmp_path, capsys) -> None:
    pair, wheels, marker = fake
    empty = write_wheel(wheels, "fake-target-part3", {"fake_target_part3/data/other.bin": b"tail"})
    wheel = dataclasses.replace(pair.target.wheels[2], sha256=hashlib.sha256(empty.read_bytes()).hexdigest())
    target = dataclasses.replace(pair.target, wheels=(*pair.target.wheels[:2], wheel))
    pairs.PAIRS["fake-pair"] = dataclasses.replace(pair, target=target)
    err = _one_line_error(*_install(wheels, capsys)[::2])
    assert "part 3 of 3 is missing" in err and not Path(pair_paths(pair)["target"]).exists()


@pytest.mark.parametrize("field, value, expected", [("size", 1, "bytes, expected 1"),
                                                    ("sha256", "0" * 64, "sha256 of the joined parts")])
def test_wrong_size_or_digest_refused(fake, capsys, field, value, expected) -> None:
    pair, wheels, _ = fake
    pairs.PAIRS["fake-pair"] = dataclasses.replace(pair, draft=dataclasses.replace(pair.draft, **{field: value}))
    err = _one_line_error(*_install(wheels, capsys)[::2])
    assert expected in err
    assert not Path(pair_paths(pair)["draft"]).exists()
    assert not list(Path(pair_paths(pair)["draft"]).parent.glob("*.partial"))


def test_wrong_order_is_caught_by_the_digest(fake) -> None:
    pair, wheels, _ = fake
    swapped = dataclasses.replace(pair.target, wheels=(pair.target.wheels[1], pair.target.wheels[0],
                                                       pair.target.wheels[2]))
    with pytest.raises(ValueError, match="sha256 of the joined parts"):
        install_pair(dataclasses.replace(pair, target=swapped), WheelSource(wheels))


def test_unknown_pair_is_one_line(capsys) -> None:
    for argv in (["install-models", "--pair", "nope"], ["models", "--pair", "nope"],
                 ["generate", "--pair", "nope", "--prompt", "x"]):
        assert "unknown pair 'nope'" in _one_line_error(main(argv), capsys.readouterr().err)


def test_registry_pins_every_wheel() -> None:
    qwen = get_pair("qwen2.5-coder-1.5b")
    assert get_pair(pairs.DEFAULT_PAIR).files() == {}
    assert (len(qwen.target.wheels), qwen.target.size) == (22, 1_117_320_768)
    assert (len(qwen.draft.wheels), qwen.draft.size) == (6, 491_400_064)
    for f in qwen.files().values():
        assert len(f.sha256) == 64 and f.file_name.endswith(".gguf")
        for i, w in enumerate(f.wheels, start=1):
            assert isinstance(w, PartWheel) and len(w.sha256) == 64 and int(w.sha256, 16) >= 0
            assert w.part.endswith(f"/data/part{i:02d}.bin") and w.name.endswith(f"part{i}")
    hashes = [w.sha256 for f in qwen.files().values() for w in f.wheels]
    assert len(set(hashes)) == len(hashes) == 28
    assert model_name(pair_paths(qwen)["target"]) == "qwen2.5-coder-1.5b-instruct-q4_k_m"
    assert model_name("SmolLM2-135M-Instruct.Q4_1.gguf") == "SmolLM2-135M-Instruct"


def test_serve_settings_take_the_pair(fake, capsys) -> None:
    from spec_core.settings import ServiceConfig

    pair, wheels, _ = fake
    with pytest.raises(ValueError, match="ssd install-models --pair fake-pair"):
        ServiceConfig.load(None, {"pair": "fake-pair"}).model_paths()
    assert _install(wheels, capsys)[0] == 0
    paths = ServiceConfig.load(None, {"pair": "fake-pair"}).model_paths()
    assert paths == (pair_paths(pair)["target"], pair_paths(pair)["draft"])
    with pytest.raises(ValueError, match="unknown pair 'nope'"):
        ServiceConfig.load(None, {"pair": "nope"}).model_paths()
