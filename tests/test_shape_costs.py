"""``ssd bench-costs --shapes``: random-weight models with real shapes (:mod:`benchmarks.shape_costs`), here the
tiny one on a CPU; the real shapes equal what the installed GGUF headers say."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks.shape_costs import SHAPES, header_shape, installed_target
from ssd_cli.main import main


def test_bench_costs_times_a_random_weight_shape(capsys):
    rc = main(["bench-costs", "--shapes", "tiny", "--device", "cpu", "--dtype", "auto", "--context", "32",
               "--k-max", "2", "--batch", "4", "--repeats", "3"])
    assert rc == 0
    (row,) = json.loads(capsys.readouterr().out)["shapes"]
    assert (row["shape"], row["dtype"], row["device"], row["batch"]) == ("tiny", "float32", "cpu", 4)
    assert row["config_source"] == "table" and row["static"]["graphs"] is False
    for part in (row["eager"], row["static"]):
        assert part["t1_s"] > 0 and part["batch_tokens_per_s"] > 0 and set(part["V"]) == {"1", "2"}


def test_bench_costs_rejects_an_unknown_shape_and_a_weight_format(capsys):
    assert main(["bench-costs", "--shapes", "gpt-5", "--device", "cpu"]) == 2
    assert main(["bench-costs", "--shapes", "tiny", "--dtype", "int4", "--device", "cpu"]) == 2
    assert "unknown shape" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["smollm2-135m", "qwen2.5-coder-1.5b"])
def test_the_table_is_what_the_gguf_headers_say(name):
    path = installed_target(name)
    if path is None or not path.is_file():
        path = None
        if name == "smollm2-135m":
            from spec_core.model_paths import installed_target_gguf

            path = installed_target_gguf()
    if path is None:
        pytest.skip(f"{name}: no GGUF installed")
    got, want = header_shape(path), SHAPES[name]
    assert set(got) == set(want)
    for key, value in want.items():
        assert math.isclose(got[key], value, rel_tol=1e-6) if isinstance(value, float) else got[key] == value, key
