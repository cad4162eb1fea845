"""``ssd serve --config serve.yaml``: the file sets every flag, flags override it, unknown keys and bad values fail
with one line naming them."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from cluster.serve_config import ServeSettings

#: A value for every setting, none of them the default.
EVERY = {
    "address": "10.0.0.1:6379", "host": "0.0.0.0", "port": 6000, "http-port": 8001, "metrics-port": 9100,
    "num-cpus": 3, "pair": "qwen2.5-coder-1.5b", "target": "/models/t", "draft": "/models/d", "dtype": "bfloat16",
    "device": "cpu",
    "served-model-name": "my-model", "k": 3, "budget": 5, "ssd-strategy": "run-ahead", "saguaro-c": 0.5, "tree": "3x1", "fixed-k": True,
    "backup-policy": "fast", "sampling": "coupled", "max-num-seqs": 8, "max-num-batched-tokens": 1024, "max-model-len": 4096,
    "max-queue": 32, "kv-memory-fraction": 0.3, "gpu": "no", "gpu-fraction": 0.5, "strategy": "SPREAD",
    "drain-grace": 5.0, "auth-token-file": "/tmp/token", "auth-token-env": "TOKEN", "tls-cert": None,
    "tls-key": None, "stats-log-interval": 30.0, "max-body-bytes": 1048576, "drafter-host": "node-ip",
}


def _serve_flags() -> set[str]:
    from ssd_cli.main import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return {a.dest for a in sub.choices["serve"]._actions if a.dest not in ("help", "config", "verbose")}


def test_every_flag_is_a_setting_and_the_file_sets_it(tmp_path) -> None:
    assert _serve_flags() == set(ServeSettings.model_fields)
    assert {k.replace("-", "_") for k in EVERY} == set(ServeSettings.model_fields)
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(EVERY))
    s = ServeSettings.load(str(path), {})
    for key, value in EVERY.items():
        assert getattr(s, key.replace("-", "_")) == value, key
        if value is not None:
            assert value != ServeSettings.model_fields[key.replace("-", "_")].default, f"{key} is its default"
    cfg = s.pair_config()
    v = cfg.verifier_config()
    assert (v.port, v.http_port, v.metrics_port, v.served_model_name, v.max_model_len) == (6000, 8001, 9100,
                                                                                           "my-model", 4096)
    assert v.scheduler.max_num_batched_tokens == 1024 and v.scheduler.max_num_seqs == 8
    assert v.spec.k == 3 and v.spec.budget == 5 and v.spec.saguaro_c == 0.5 and not v.spec.adaptive_k
    assert str(v.spec.tree) == "3x1" and cfg.drafter_config().ssd.tree == v.spec.tree and v.spec.sampling == "coupled"
    assert cfg.drafter_config().ssd.strategy == "run-ahead"
    assert v.spec.k + sum(v.spec.tree.leaves(v.spec.k)) == cfg.drafter_config().ssd.max_nodes == 5
    assert v.cache.kv_memory_fraction == 0.3 and v.target.dtype == "bfloat16"
    assert v.auth_token_file == "/tmp/token" and v.stats_log_interval_s == 30.0
    assert v.max_body_bytes == 1048576 and cfg.drafter_host == "node-ip"
    assert cfg.use_gpu is False and cfg.gpu_fraction == 0.5 and cfg.strategy == "SPREAD"


def test_flags_override_the_file(tmp_path) -> None:
    path = tmp_path / "serve.yaml"
    path.write_text("port: 7000\nk: 4\n")
    s = ServeSettings.load(str(path), {"k": 2})
    assert (s.port, s.k) == (7000, 2)


@pytest.mark.parametrize("text, message", [
    ("max-model-len: 1024\nbogus_key: 3\n", "unknown setting 'bogus_key'"),
    ("port: abc\n", "port"),
    ("k: 0\n", "k"),
    ("- port\n", "mapping"),
    ("port: [1\n", "not valid YAML"),
])
def test_bad_files_fail_naming_the_key(tmp_path, text, message) -> None:
    path = tmp_path / "serve.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        ServeSettings.load(str(path), {})


def test_cli_unknown_key_is_one_line_and_exit_2(tmp_path) -> None:
    path = tmp_path / "serve.yaml"
    path.write_text("max_num_seqs: 4\nmax_num_sequences: 4\n")
    out = subprocess.run([sys.executable, "-m", "ssd_cli", "serve", "--config", str(path)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and "unknown setting 'max_num_sequences'" in out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1
