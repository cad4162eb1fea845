"""Offline validation of the KubeRay / Kubernetes manifests in this directory (no cluster needed).

Usage: ``python k8s/validate.py [FILE...]`` (default: every ``k8s/*.yaml``). Exit status 0 when every
document is valid (silent), 1 otherwise, with one line per error on stderr.

* ``ray.io`` kinds: the KubeRay CRD schemas copied under ``tests/data/kuberay/crds``, converted to strict
  JSON Schema (unknown fields rejected, ``nullable`` honoured, required-with-default dropped, nulls
  pruned, ``apiVersion``/``kind`` pinned); core kinds: ``kubernetes_validate`` (1.34, strict).
* What the schemas cannot see: RayJob ``submissionMode`` and ``runtimeEnvYAML`` (a YAML map); RayService
  ``serveConfigV2`` (Ray Serve's ``ServeDeploySchema``, unknown keys, importable ``import_path``).
"""

from __future__ import annotations

import functools
import importlib
import logging
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


def convert_schema(node: Any) -> Any:
    """Turn an OpenAPI v3 (structural CRD) schema into a strict JSON Schema."""
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in ("properties", "patternProperties"):
            out[key] = {name: convert_schema(sub) for name, sub in value.items()}
        elif key in ("items", "additionalProperties", "not") and isinstance(value, dict):
            out[key] = convert_schema(value)
        elif key in ("anyOf", "allOf", "oneOf"):
            out[key] = [convert_schema(sub) for sub in value]
        elif key != "nullable":
            out[key] = value
    props = out.get("properties")
    if props is not None and "required" in out:
        # The API server applies defaults before validating.
        out["required"] = [name for name in out["required"] if "default" not in props.get(name, {})]
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    if (out.get("type") == "object" and props is not None and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


def prune_nulls(doc: Any) -> Any:
    """Drop ``null`` map values recursively, as the API server does for non-nullable fields."""
    if isinstance(doc, dict):
        return {k: prune_nulls(v) for k, v in doc.items() if v is not None}
    if isinstance(doc, list):
        return [prune_nulls(v) for v in doc]
    return doc


def load_crd_validators(crd_dir: str | Path | None = None) -> dict[tuple[str, str], Draft202012Validator]:
    """Validators keyed by ``(apiVersion, kind)`` for every served version of every CRD in ``crd_dir``
    (default: the copies under ``tests/data/kuberay/crds``); parsed once per directory."""
    return _load_crd_validators(str(Path(crd_dir or CRD_DIR).resolve()))


@functools.lru_cache(maxsize=4)
def _load_crd_validators(crd_dir: str) -> dict[tuple[str, str], Draft202012Validator]:
    validators = {}
    for path in sorted(Path(crd_dir).glob("*.yaml")):
        with open(path, encoding="utf-8") as f:
            crd = yaml.load(f, Loader=_Loader)
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for version in crd["spec"]["versions"]:
            api_version = f"{group}/{version['name']}"
            schema = convert_schema(version["schema"]["openAPIV3Schema"])
            schema["properties"]["apiVersion"] = {"const": api_version}
            schema["properties"]["kind"] = {"const": kind}
            validators[(api_version, kind)] = Draft202012Validator(schema)
    if not validators:
        raise FileNotFoundError(f"no CRD yaml files in {crd_dir}")
    log.debug("loaded %d CRD schemas from %s", len(validators), crd_dir)
    return validators


def _where(path: Any) -> str:
    return ".".join(str(p) for p in path) or "<root>"


def check_import_path(import_path: str) -> str | None:
    """Import ``module:attr`` (or ``module.attr``) from the repository root; an error message or None."""
    module_name, sep, attr = import_path.partition(":")
    if not sep:
        module_name, _, attr = import_path.rpartition(".")
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # any failure at import time makes the application undeployable
        return f"import_path {import_path!r}: cannot import module {module_name!r}: {exc!r}"
    if not hasattr(module, attr):
        return f"import_path {import_path!r}: module {module_name!r} has no attribute {attr!r}"
    return None


def _unknown_keys(model: Any, raw: Any, where: str) -> list[str]:
    """Keys of ``raw`` that the validated pydantic ``model`` ignored (Ray Serve drops unknown keys silently)."""
    from pydantic import BaseModel

    if not isinstance(model, BaseModel) or not isinstance(raw, dict):
        return []
    fields = type(model).model_fields
    known = set(fields) | {f.alias for f in fields.values() if f.alias}
    errors = [f"{where}{key}: unknown field" for key in raw if key not in known]
    for key in known & set(raw):
        value = getattr(model, key, None)
        if isinstance(value, list) and isinstance(raw[key], list):
            for i, (sub, sub_raw) in enumerate(zip(value, raw[key])):
                errors += _unknown_keys(sub, sub_raw, f"{where}{key}.{i}.")
        else:
            errors += _unknown_keys(value, raw[key], f"{where}{key}.")
    return errors


def _serve_config_errors(text: Any) -> list[str]:
    from pydantic import ValidationError
    from ray.serve.schema import ServeDeploySchema

    try:
        raw = yaml.safe_load(text)
        config = ServeDeploySchema.model_validate(raw)
    except (yaml.YAMLError, ValidationError) as exc:
        return ["spec.serveConfigV2: " + " ".join(str(exc).split())]
    errors = _unknown_keys(config, raw, "")
    errors += [e for e in (check_import_path(app.import_path) for app in config.applications) if e]
    return [f"spec.serveConfigV2: {e}" for e in errors]


def _rayjob_errors(spec: dict) -> list[str]:
    errors = []
    mode = spec.get("submissionMode", "K8sJobMode")
    if mode not in SUBMISSION_MODES:
        errors.append(f"spec.submissionMode: {mode!r} is not one of {sorted(SUBMISSION_MODES)}")
    if "runtimeEnvYAML" in spec:
        try:
            env = yaml.safe_load(spec["runtimeEnvYAML"])
        except yaml.YAMLError as exc:
            env = exc
        if not isinstance(env, dict):
            errors.append(f"spec.runtimeEnvYAML: not a YAML map: {' '.join(str(env).split())}")
    return errors


def validate_document(doc: Any, crd_dir: str | Path | None = None) -> list[str]:
    """Errors for one parsed manifest document (empty list when valid)."""
    if not isinstance(doc, dict) or "kind" not in doc or "apiVersion" not in doc:
        return ["<document>: not a Kubernetes object (needs apiVersion and kind)"]
    doc = prune_nulls(doc)
    api_version, kind = doc["apiVersion"], doc["kind"]
    if str(api_version).startswith("ray.io/"):
        validator = load_crd_validators(crd_dir).get((api_version, kind))
        if validator is None:
            return [f"<root>: no CRD schema for {api_version} {kind}"]
        errors = [f"{_where(e.absolute_path)}: {e.message}"
                  for e in sorted(validator.iter_errors(doc), key=lambda e: list(map(str, e.absolute_path)))]
        spec = doc.get("spec") if isinstance(doc.get("spec"), dict) else {}
        if kind == "RayJob":
            errors += _rayjob_errors(spec)
        if kind == "RayService" and "serveConfigV2" in spec:
            errors += _serve_config_errors(spec["serveConfigV2"])
        return errors
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
        return [f"{path}: {' '.join(str(exc).split())}"]
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
