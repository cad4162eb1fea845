"""Offline checks of the KubeRay manifests in k8s/ (no cluster, no Ray start).

The CRD schemas are parsed once per session (``load_crd_validators`` is cached); each broken-manifest
test edits a copy of a shipped manifest and asserts the specific error ``k8s/validate.py`` reports.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "k8s"
MANIFESTS = sorted(K8S.glob("*.yaml"))
GRPC_PORT = 9000
# Importing ray.serve.schema emits pydantic v2 deprecation warnings from Ray's own code.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _load_validate_module():
    spec = importlib.util.spec_from_file_location("ssd_k8s_validate", K8S / "validate.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def kv():
    module = _load_validate_module()
    module.load_crd_validators()  # parse the 3.3 MB of CRDs once for the whole module
    return module


def _docs(name: str) -> list[dict]:
    with open(K8S / name, encoding="utf-8") as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def _by_kind(docs: list[dict], kind: str) -> dict:
    (doc,) = [d for d in docs if d["kind"] == kind]
    return doc


def _errors(kv, tmp_path: Path, docs: list[dict]) -> list[str]:
    path = tmp_path / "broken.yaml"
    path.write_text(yaml.safe_dump_all(docs, sort_keys=False), encoding="utf-8")
    return kv.validate_documents(path)


def _has(errors: list[str], *parts: str) -> bool:
    return any(all(p in e for p in parts) for e in errors)


def _cluster(doc: dict) -> dict:
    return doc["spec"]["rayClusterConfig" if doc["kind"] == "RayService" else "rayClusterSpec"]


def _serve_config(doc: dict) -> dict:
    return yaml.safe_load(doc["spec"]["serveConfigV2"])


def test_crd_copies_present():
    crds = ROOT / "tests" / "data" / "kuberay" / "crds"
    for kind in ("rayclusters", "rayjobs", "rayservices"):
        assert (crds / f"ray.io_{kind}.yaml").is_file()
    assert (crds / "SOURCE.md").is_file()


def test_manifests_exist():
    assert {p.name for p in MANIFESTS} >= {"rayservice.yaml", "rayjob.yaml"}


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_shipped_manifest_is_valid(kv, path):
    assert kv.validate_documents(path) == []


def test_typo_field_rejected(kv, tmp_path):
    job = _docs("rayjob.yaml")[0]
    job["spec"]["rayClusterSpecc"] = job["spec"].pop("rayClusterSpec")
    errors = _errors(kv, tmp_path, [job])
    assert _has(errors, "RayJob/ssd-batch", "spec:", "'rayClusterSpecc' was unexpected"), errors


def test_replicas_wrong_type_rejected(kv, tmp_path):
    docs = _docs("rayservice.yaml")
    _cluster(_by_kind(docs, "RayService"))["workerGroupSpecs"][0]["replicas"] = "two"
    errors = _errors(kv, tmp_path, docs)
    assert _has(errors, "workerGroupSpecs.0.replicas", "'two' is not of type 'integer'"), errors


def test_gpu_quantity_rejected(kv, tmp_path):
    job = _docs("rayjob.yaml")[0]
    _cluster(job)["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["resources"]["limits"][
        "nvidia.com/gpu"] = "one"
    errors = _errors(kv, tmp_path, [job])
    assert _has(errors, "resources.limits.nvidia.com/gpu", "'one' does not match"), errors


def test_bad_submission_mode_rejected(kv, tmp_path):
    job = _docs("rayjob.yaml")[0]
    job["spec"]["submissionMode"] = "K8sJob"
    errors = _errors(kv, tmp_path, [job])
    assert _has(errors, "spec.submissionMode", "'K8sJob' is not one of"), errors


def test_runtime_env_not_a_map_rejected(kv, tmp_path):
    job = _docs("rayjob.yaml")[0]
    job["spec"]["runtimeEnvYAML"] = "- just\n- a list\n"
    assert _has(_errors(kv, tmp_path, [job]), "spec.runtimeEnvYAML", "not a YAML map")


@pytest.mark.parametrize("import_path, expected", [
    ("cluster.no_such_module:app", "cannot import module 'cluster.no_such_module'"),
    ("ssd_cli.main:no_such_app", "has no attribute 'no_such_app'"),
])
def test_unimportable_serve_app_rejected(kv, tmp_path, import_path, expected):
    docs = _docs("rayservice.yaml")
    service = _by_kind(docs, "RayService")
    config = _serve_config(service)
    config["applications"][0]["import_path"] = import_path
    service["spec"]["serveConfigV2"] = yaml.safe_dump(config, sort_keys=False)
    errors = _errors(kv, tmp_path, docs)
    assert _has(errors, "spec.serveConfigV2", expected), errors


def test_serve_config_schema_and_unknown_keys_rejected(kv, tmp_path):
    docs = _docs("rayservice.yaml")
    service = _by_kind(docs, "RayService")
    config = _serve_config(service)
    config["grpc_option"] = config.pop("grpc_options")  # Ray Serve would silently drop this
    config["applications"][0]["deployments"][0]["num_replicas"] = "lots"
    service["spec"]["serveConfigV2"] = yaml.safe_dump(config, sort_keys=False)
    errors = _errors(kv, tmp_path, docs)
    assert _has(errors, "spec.serveConfigV2", "num_replicas"), errors
    config["applications"][0]["deployments"][0]["num_replicas"] = 1
    service["spec"]["serveConfigV2"] = yaml.safe_dump(config, sort_keys=False)
    errors = _errors(kv, tmp_path, docs)
    assert _has(errors, "spec.serveConfigV2", "grpc_option: unknown field"), errors


def test_core_service_target_port_wrong_type_rejected(kv, tmp_path):
    docs = _docs("rayservice.yaml")
    _by_kind(docs, "Service")["spec"]["ports"][0]["targetPort"] = [GRPC_PORT]
    errors = _errors(kv, tmp_path, docs)
    assert _has(errors, "Service/ssd-grpc", "spec.ports.0.targetPort", "is not valid"), errors


def test_grpc_port_consistent():
    docs = _docs("rayservice.yaml")
    service, svc = _by_kind(docs, "RayService"), _by_kind(docs, "Service")
    head = _cluster(service)["headGroupSpec"]["template"]
    container = head["spec"]["containers"][0]
    named = [p["containerPort"] for p in container["ports"] if p["name"] == "grpc"]
    ports = [p for p in svc["spec"]["ports"] if p["name"] == "grpc"]
    seen = {
        "readinessProbe": container["readinessProbe"]["grpc"]["port"],
        "livenessProbe": container["livenessProbe"]["grpc"]["port"],
        "containerPort grpc": named[0] if len(named) == 1 else named,
        "Service port": ports[0]["port"],
        "Service targetPort": ports[0]["targetPort"],
        "grpc_options.port": _serve_config(service)["grpc_options"]["port"],
    }
    assert set(seen.values()) == {GRPC_PORT}, seen
    # The Service must select the head pod, whose template carries every non-KubeRay selector label.
    selector = svc["spec"]["selector"]
    assert selector.pop("ray.io/node-type") == "head"
    assert selector.items() <= head["metadata"]["labels"].items()
    # Pods must outlive the gRPC server's drain grace.
    assert head["spec"]["terminationGracePeriodSeconds"] >= 60


@pytest.mark.parametrize("name", ["rayservice.yaml", "rayjob.yaml"])
def test_drafter_and_verifier_each_get_one_gpu(name):
    doc = [d for d in _docs(name) if d["kind"] in ("RayService", "RayJob")][0]
    cluster = _cluster(doc)
    head = cluster["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in head.get("resources", {}).get("limits", {})
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    gpu_groups = [g for g in cluster["workerGroupSpecs"]
                  if "nvidia.com/gpu" in g["template"]["spec"]["containers"][0]["resources"]["limits"]]
    assert len(gpu_groups) == 1
    group = gpu_groups[0]
    resources = group["template"]["spec"]["containers"][0]["resources"]
    assert resources["requests"]["nvidia.com/gpu"] == "1"
    assert resources["limits"]["nvidia.com/gpu"] == "1"
    assert group["replicas"] >= 2 and group["minReplicas"] >= 2
    if doc["kind"] == "RayService":
        (deployment,) = _serve_config(doc)["applications"][0]["deployments"]
        assert deployment["name"] == "SSDServer" and deployment["num_replicas"] == 1
        assert deployment["ray_actor_options"].get("num_gpus", 0) == 0


def test_serve_app_import_path_importable(kv):
    """The lead's ``cluster/serve_app.py`` must exist and define ``app``."""
    (app,) = _serve_config(_by_kind(_docs("rayservice.yaml"), "RayService"))["applications"]
    assert app["import_path"] == "cluster.serve_app:app"
    assert kv.check_import_path(app["import_path"]) is None


def test_cli_exit_codes(tmp_path):
    script = [sys.executable, str(K8S / "validate.py")]
    good = subprocess.run(script + [str(p) for p in MANIFESTS], capture_output=True, text=True, cwd=ROOT)
    assert good.returncode == 0, good.stderr
    job = _docs("rayjob.yaml")[0]
    job["spec"]["submissionMode"] = "Nope"
    broken = tmp_path / "broken.yaml"
    broken.write_text(yaml.safe_dump(job), encoding="utf-8")
    bad = subprocess.run(script + [str(broken)], capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode == 1
    assert [line for line in bad.stderr.splitlines() if "spec.submissionMode" in line], bad.stderr
