"""Offline validation of the KubeRay / Kubernetes manifests in this directory (no cluster needed).

Usage: ``python k8s/validate.py [FILE...]`` (default: every ``k8s/*.yaml``). Exit status 0 when every
document is valid (silent), 1 otherwise, with one line per error on stderr.

* Core kinds: ``kubernetes_validate`` (Kubernetes 1.34 schemas, strict).
* ``ray.io`` kinds: ``jsonschema`` against each CRD's own ``openAPIV3Schema`` (the copies under
  ``tests/data/kuberay/crds``). No installed package converts a CRD schema, so :func:`strict_crd_schema` keeps only
  what kubeconform's ``openapi2jsonschema`` does for CRDs plus the API server's defaulting: unknown fields are errors
  (``additionalProperties: false``), a required field that has a default may be left out, nulls are pruned.
* What no schema sees, using Ray's own code: ``serveConfigV2`` (Serve's ``ServeDeploySchema``, which drops
  unknown keys silently, so those are reported; each application built from its ``import_path`` and ``args`` as
  Serve does), RayJob ``runtimeEnvYAML`` (``ray.runtime_env.RuntimeEnv``) and ``submissionMode`` (not an enum in
  the CRD).
"""

from __future__ import annotations

import functools
import logging
import lzma
import sys
from pathlib import Path
from typing import Any

import yaml
from jsonschema import Draft202012Validator

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[1]
CRD_DIR = REPO_ROOT / "tests" / "data" / "kuberay" / "crds"
K8S_VERSION = "1.34"
SUBMISSION_MODES = frozenset({"K8sJobMode", "HTTPMode", "SidecarMode", "InteractiveMode"})
_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def strict_crd_schema(schema: dict, api_version: str, kind: str) -> dict:
    """``schema`` (a CRD version's ``openAPIV3Schema``, changed in place) as strict JSON Schema: every object with
    ``properties`` rejects other keys unless ``x-kubernetes-preserve-unknown-fields``; fields with a ``default``
    are not required (the API server defaults before it validates); ``apiVersion`` and ``kind`` are pinned."""
    stack: list[Any] = [schema]
    while stack:
        node = stack.pop()
        props = node.get("properties")
        if node.get("type") == "object" and isinstance(props, dict):
            if not node.get("x-kubernetes-preserve-unknown-fields"):
                node.setdefault("additionalProperties", False)
            if "required" in node:
                node["required"] = [r for r in node["required"] if "default" not in props.get(r, {})]
        for key in ("properties", "patternProperties"):
            stack.extend(node.get(key, {}).values())
        stack.extend(node[k] for k in ("items", "additionalProperties", "not") if isinstance(node.get(k), dict))
        for key in ("anyOf", "allOf", "oneOf"):
            stack.extend(node.get(key, []))
    schema["properties"]["apiVersion"] = {"const": api_version}
    schema["properties"]["kind"] = {"const": kind}
    return schema


def prune_nulls(doc: Any) -> Any:
    """Drop ``null`` map values recursively, as the API server does for non-nullable fields."""
    if isinstance(doc, dict):
        return {k: prune_nulls(v) for k, v in doc.items() if v is not None}
    if isinstance(doc, list):
        return [prune_nulls(v) for v in doc]
    return doc


def load_crd_validators(crd_dir: str | Path | None = None) -> dict[tuple[str, str], Draft202012Validator]:
    """Validators keyed by ``(apiVersion, kind)`` for every version of every CRD in ``crd_dir`` (default: the
    copies under ``tests/data/kuberay/crds``); parsed once per directory."""
    return _load_crd_validators(str(Path(crd_dir or CRD_DIR).resolve()))


@functools.lru_cache(maxsize=4)
def _load_crd_validators(crd_dir: str) -> dict[tuple[str, str], Draft202012Validator]:
    validators = {}
    for path in sorted([*Path(crd_dir).glob("*.yaml"), *Path(crd_dir).glob("*.yaml.xz")]):
        with (lzma.open if path.suffix == ".xz" else open)(path, "rt", encoding="utf-8") as f:
            crd = yaml.load(f, Loader=_Loader)
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for version in crd["spec"]["versions"]:
            api_version = f"{group}/{version['name']}"
            schema = strict_crd_schema(version["schema"]["openAPIV3Schema"], api_version, kind)
            validators[(api_version, kind)] = Draft202012Validator(schema)
    if not validators:
        raise FileNotFoundError(f"no CRD yaml files in {crd_dir}")
    return validators


def _where(path: Any) -> str:
    return ".".join(str(p) for p in path) or "<root>"


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def app_error(import_path: str, args: dict) -> str | None:
    """Build the application as Serve does (import ``import_path`` from the repository root, call a builder with
    ``args``); an error message, or None."""
    from ray._common.utils import import_attr
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary

    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    try:
        call_user_app_builder_with_args_if_necessary(import_attr(import_path), args)
    except Exception as exc:  # any failure here makes the application undeployable
        return f"import_path {import_path!r}: {type(exc).__name__}: {_one_line(exc)}"
    return None


def dropped_keys(raw: Any, kept: Any, where: str = "") -> list[str]:
    """Keys of ``raw`` missing from ``kept`` (the validated model dumped with ``exclude_unset``), recursively."""
    if isinstance(raw, dict) and isinstance(kept, dict):
        return [e for k, v in raw.items()
                for e in (dropped_keys(v, kept[k], f"{where}{k}.") if k in kept else [f"{where}{k}: unknown field"])]
    if isinstance(raw, list) and isinstance(kept, list):
        return [e for i, (a, b) in enumerate(zip(raw, kept)) for e in dropped_keys(a, b, f"{where}{i}.")]
    return []


def serve_config_errors(text: Any) -> list[str]:
    from pydantic import ValidationError
    from ray.serve.schema import ServeDeploySchema

    try:
        raw = yaml.safe_load(text)
        config = ServeDeploySchema.model_validate(raw)
    except (yaml.YAMLError, ValidationError) as exc:
        return [f"spec.serveConfigV2: {_one_line(exc)}"]
    errors = dropped_keys(raw, config.model_dump(exclude_unset=True))
    errors += [e for e in (app_error(app.import_path, app.args) for app in config.applications) if e]
    return [f"spec.serveConfigV2: {e}" for e in errors]


def rayjob_errors(spec: dict) -> list[str]:
    from ray.runtime_env import RuntimeEnv

    errors = []
    mode = spec.get("submissionMode", "K8sJobMode")
    if mode not in SUBMISSION_MODES:
        errors.append(f"spec.submissionMode: {mode!r} is not one of {sorted(SUBMISSION_MODES)}")
    if "runtimeEnvYAML" in spec:
        try:
            RuntimeEnv(**yaml.safe_load(spec["runtimeEnvYAML"]))
        except Exception as exc:  # YAML errors, a non-map (TypeError), Ray's own field checks
            errors.append(f"spec.runtimeEnvYAML: {type(exc).__name__}: {_one_line(exc)}")
    return errors


def _ray_errors(doc: dict, crd_dir: str | Path | None) -> list[str]:
    validator = load_crd_validators(crd_dir).get((doc["apiVersion"], doc["kind"]))
    if validator is None:
        return [f"<root>: no CRD schema for {doc['apiVersion']} {doc['kind']}"]
    found = sorted(validator.iter_errors(doc), key=lambda e: list(map(str, e.absolute_path)))
    errors = [f"{_where(e.absolute_path)}: {e.message}" for e in found]
    spec = doc.get("spec") if isinstance(doc.get("spec"), dict) else {}
    if doc["kind"] == "RayJob":
        errors += rayjob_errors(spec)
    if doc["kind"] == "RayService" and "serveConfigV2" in spec:
        errors += serve_config_errors(spec["serveConfigV2"])
    return errors


def validate_document(doc: Any, crd_dir: str | Path | None = None) -> list[str]:
    """Errors for one parsed manifest document (empty list when valid)."""
    if not isinstance(doc, dict) or "kind" not in doc or "apiVersion" not in doc:
        return ["<document>: not a Kubernetes object (needs apiVersion and kind)"]
    doc = prune_nulls(doc)
    if str(doc["apiVersion"]).startswith("ray.io/"):
        return _ray_errors(doc, crd_dir)
    import kubernetes_validate

    try:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        return [f"{_where(exc.absolute_path)}: {exc.message}"]
    except (kubernetes_validate.SchemaNotFoundError, kubernetes_validate.InvalidSchemaError) as exc:
        return [f"<root>: {exc.message}"]
    return []


def validate_documents(path: str | Path, crd_dir: str | Path | None = None) -> list[str]:
    """Errors for every document of the YAML file ``path``, each as ``FILE: KIND/NAME: FIELD: message``."""
    try:
        with open(path, encoding="utf-8") as f:
            docs = [d for d in yaml.load_all(f, Loader=_Loader) if d is not None]
    except (OSError, yaml.YAMLError) as exc:
        return [f"{path}: {_one_line(exc)}"]
    errors = []
    for doc in docs:
        name = f"{doc.get('kind')}/{(doc.get('metadata') or {}).get('name')}" if isinstance(doc, dict) else "?"
        errors += [f"{path}: {name}: {e}" for e in validate_document(doc, crd_dir)]
    log.info("%s: %d document(s), %d error(s)", path, len(docs), len(errors))
    return errors


def main(argv: list[str] | None = None) -> int:
    """Validate the given files (default ``k8s/*.yaml``); 0 if all valid, else 1."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    files = (sys.argv[1:] if argv is None else argv) or sorted(str(p) for p in Path(__file__).parent.glob("*.yaml"))
    errors = [e for path in files for e in validate_documents(path)]
    for line in errors:
        sys.stderr.write(line + "\n")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
