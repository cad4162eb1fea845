"""The one configuration model: ``ssd serve``'s flags, its ``--config`` file, the Ray job's, the Serve app's
arguments, the KubeRay manifest and ``docs/configuration.md`` all have its keys; unknown keys and bad values fail
with one line naming them."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from spec_core.settings import ServeAppConfig, ServiceConfig

#: A value for every setting, none of them the default.
EVERY = {
    "address": "10.0.0.1:6379", "host": "0.0.0.0", "port": 6000, "http-port": 8001, "metrics-port": 9100,
    "num-cpus": 3, "pair": "qwen2.5-coder-1.5b", "target": "/models/t", "draft": "/models/d", "dtype": "bfloat16", "draft-dtype": "int4",
    "device": "cpu",
    "served-model-name": "my-model", "k": 4, "budget": 5, "ssd-strategy": "run-ahead", "run-ahead-schedule": "alternating", "saguaro-c": 0.5, "tree": "3x1", "fixed-k": True,
    "backup-policy": "fast", "backup": "none", "wait-fraction": 0.25, "fit-fanout": 0.5, "sampling": "coupled", "max-num-seqs": 8, "max-num-batched-tokens": 1024, "max-model-len": 4096,
    "max-queue": 32, "kv-memory-fraction": 0.3, "gpu": "no", "gpu-fraction": 0.5, "strategy": "SPREAD",
    "drain-grace": 5.0, "auth-token-file": "/tmp/token", "auth-token-env": "TOKEN", "tls-cert": None,
    "tls-key": None, "stats-log-interval": 30.0, "max-body-bytes": 1048576, "drafter-host": "node-ip", "lend-cores": False,
    "enforce-eager": True,
}


def _serve_flags() -> set[str]:
    from ssd_cli.main import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return {a.dest for a in sub.choices["serve"]._actions if a.dest not in ("help", "config", "verbose")}


def test_every_flag_is_a_setting_and_the_file_sets_it(tmp_path) -> None:
    from cluster.launch import drafter_config, verifier_config

    assert _serve_flags() == set(ServiceConfig.model_fields)
    assert {k.replace("-", "_") for k in EVERY} == set(ServiceConfig.model_fields)
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(EVERY))
    cfg = ServiceConfig.load(str(path), {})
    for key, value in EVERY.items():
        assert getattr(cfg, key.replace("-", "_")) == value, key
        if value is not None:
            assert value != ServiceConfig.model_fields[key.replace("-", "_")].default, f"{key} is its default"
    v = verifier_config(cfg, "/models/t")
    d = drafter_config(cfg, "/models/t", "/models/d")
    assert (v.port, v.http_port, v.metrics_port, v.served_model_name, v.max_model_len) == (6000, 8001, 9100,
                                                                                           "my-model", 4096)
    assert v.scheduler.max_num_batched_tokens == 1024 and v.scheduler.max_num_seqs == 8
    assert v.spec.k == 4 and v.spec.budget == 5 and v.spec.saguaro_c == 0.5 and not v.spec.adaptive_k
    assert str(v.spec.tree) == "3x1" and d.ssd.tree == v.spec.tree and v.spec.sampling == "coupled"
    assert d.ssd.strategy == "run-ahead" and d.draft.dtype == "int4" and d.ssd.fit_fanout == 0.5
    assert (v.spec.backup, v.spec.wait_fraction) == ("none", 0.25)  # the drafter hears them in the handshake
    assert v.spec.k + sum(v.spec.tree.leaves(v.spec.k)) == d.ssd.max_nodes == 6
    assert v.cache.kv_memory_fraction == 0.3 and v.target.dtype == "bfloat16"
    assert not v.target.cuda_graphs and not d.draft.cuda_graphs  # enforce-eager reaches both models
    assert v.auth_token_file == "/tmp/token" and v.stats_log_interval_s == 30.0
    assert v.max_body_bytes == 1048576 and cfg.drafter_host == "node-ip"
    assert cfg.use_gpu is False and cfg.gpu_fraction == 0.5 and cfg.strategy == "SPREAD"


def test_flags_override_the_file(tmp_path) -> None:
    path = tmp_path / "serve.yaml"
    path.write_text("port: 7000\nk: 4\n")
    s = ServiceConfig.load(str(path), {"k": 2})
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
        ServiceConfig.load(str(path), {})


def test_cli_unknown_key_is_one_line_and_exit_2(tmp_path) -> None:
    path = tmp_path / "serve.yaml"
    path.write_text("max_num_seqs: 4\nmax_num_sequences: 4\n")
    out = subprocess.run([sys.executable, "-m", "ssd_cli", "serve", "--config", str(path)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and "unknown setting 'max_num_sequences'" in out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1


#: The Serve app's own keys, none of them the default.
APP_ONLY = {"num-replicas": 3, "pair-cpus": 0.3, "replica-cpus": 0.2, "max-ongoing-requests": 80}


def test_the_serve_app_accepts_every_key() -> None:
    """``build_app`` (what KubeRay's ``serveConfigV2`` runs) takes every key of the one model, and each replica's
    pair gets every one of them (but the two that only start a Ray: ``address``, ``num-cpus``)."""
    from cluster.serve_app import NOT_IN_A_REPLICA, build_app, replica_config

    assert {k.replace("-", "_") for k in {**EVERY, **APP_ONLY}} == set(ServeAppConfig.model_fields)
    deployment = build_app({**EVERY, **APP_ONLY})._bound_deployment
    (pair,) = deployment._replica_config.init_args
    replica = replica_config(pair)
    for key, value in EVERY.items():
        name = key.replace("-", "_")
        if name == "max_queue":
            assert replica.max_queue == 80  # the replica admits what Serve sends it
        elif name in NOT_IN_A_REPLICA:
            assert name not in pair
        else:
            assert getattr(replica, name) == value, key
    assert deployment.num_replicas == 3 and deployment.max_ongoing_requests == 80
    assert deployment._replica_config.placement_group_bundles == [{"CPU": 0.2}, {"CPU": 0.3}, {"CPU": 0.3}]
    assert deployment._replica_config.placement_group_strategy == "SPREAD"


def test_a_replica_takes_any_free_port_unless_told() -> None:
    from cluster.serve_app import build_app, replica_config

    (pair,) = build_app({"k": 3})._bound_deployment._replica_config.init_args
    cfg = replica_config(pair)
    assert (cfg.port, cfg.metrics_port, cfg.http_port, cfg.k, cfg.gpu) == (0, 0, None, 3, "yes")


@pytest.mark.parametrize("args, message", [({"bogus": 1}, "unknown setting 'bogus'"), ({"k": 0}, "^k:"),
                                           ({"gpu": "maybe"}, "^gpu:")])
def test_the_serve_app_refuses_bad_keys_naming_them(args, message) -> None:
    from cluster.serve_app import build_app

    with pytest.raises(ValueError, match=message):
        build_app(args)


def test_the_kuberay_manifest_uses_the_models_keys() -> None:
    from pathlib import Path

    docs = list(yaml.safe_load_all(Path(__file__).parents[1].joinpath("k8s/rayservice.yaml").read_text()))
    service = next(d for d in docs if d and d.get("kind") == "RayService")
    (app,) = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"]
    assert set(app["args"]) <= set(ServeAppConfig.model_fields)
    ServeAppConfig.load(None, app["args"])


def test_the_configuration_docs_are_generated_from_the_model() -> None:
    from pathlib import Path

    from spec_core.settings import docs_block, markdown

    block = docs_block(Path(__file__).parents[1].joinpath("docs/configuration.md").read_text())
    assert block == markdown(), "docs/configuration.md is stale: put `ssd config --markdown` between its markers"
    for name in ServeAppConfig.model_fields:
        assert f"| `{name.replace('_', '-')}` |" in block


def test_a_batch_job_places_its_config_with_its_own_needs(tmp_path) -> None:
    from cluster.batch_job import job_config
    from verifier_service.batch_requests import BatchSettings

    path = tmp_path / "job.yaml"
    path.write_text("tree: chain\nsampling: coupled\nk: 2\nmax-queue: 8\n")
    cfg = job_config(ServiceConfig.load(str(path), {"dtype": "int4"}), BatchSettings(mode="ssd", concurrency=16, k=4,
                                                                                     draft_path="/d"))
    assert (cfg.tree, cfg.sampling, cfg.dtype, cfg.k) == ("chain", "coupled", "int4", 4)
    assert (cfg.host, cfg.port, cfg.max_num_seqs, cfg.max_queue) == ("node-ip", 0, 16, 16)


def test_the_local_and_served_ssd_rows_run_the_same_settings() -> None:
    """``ssd bench``'s local ``ssd`` row and its ``ssd-service`` row derive from one config: the drafter and the
    verifier get the same K, tree, budget, C, strategy, sampling, backup policy and draft dtype either way."""
    from benchmarks.bench import BenchSettings
    from cluster.launch import drafter_config, verifier_config
    from cluster.local_ssd import LocalSSD

    bench = BenchSettings(modes=("ssd", "ssd-service"), num_prompts=1, max_new_tokens=8, k=4, repeats=1,
                          temperatures=(0.0,), prompts_file=None, ignore_eos=True, target_threads=1, budget=7,
                          saguaro_c=0.5, tree="2x1", sampling="coupled", ssd_strategy="fanout")
    cfg = bench.service_config("/t", "/d", "int4", "int4")
    local = LocalSSD(None, cfg)  # not entered: nothing loads or starts
    served, spec = drafter_config(cfg, "/t", "/d"), verifier_config(cfg, "/t").spec
    assert local.ssd == served.ssd and local.speculation == spec
    assert local.draft_path == served.draft.path and local.config.draft_dtype == served.draft.dtype == "int4"
    assert (spec.k, spec.budget, str(spec.tree), local.ssd.strategy) == (4, 7, "2x1", "fanout")
    assert bench.service_config("/t", "/d", "int4", mode="ssd-chain").tree == "chain"
