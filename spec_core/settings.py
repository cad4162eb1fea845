"""The service's one configuration model: every setting of a deployed drafter–verifier pair.

Everything else derives from :class:`ServiceConfig`: the flags of ``ssd serve`` (:mod:`ssd_cli.config_flags`), its
``--config`` YAML file, the Ray job's ``--config``, the Ray Serve application's arguments (:mod:`cluster.serve_app`,
which KubeRay's ``serveConfigV2`` passes) and ``docs/configuration.md`` (:func:`markdown`). Keys are the flag names
without the dashes; ``max-model-len`` and ``max_model_len`` both work. An unknown key or a bad value is a
``ValueError`` that names it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from spec_core.config import DEFAULT_K, SSD_DEFAULT_TREE, SpeculationConfig, SSDConfig, TreeShape
from spec_core.fanout import FanoutConfig

#: Sections of ``docs/configuration.md``, in order.
GROUPS = ("where", "models", "speculation", "engine", "placement", "security and lifecycle", "serve app")


def setting(default: Any, help: str, group: str, **constraints: Any) -> Any:  # noqa: A002 - argparse's word
    """A field of the model: its default, its one-line help (the flag's and the docs'), and its docs section."""
    return Field(default, description=help, json_schema_extra={"group": group}, **constraints)


class ServiceConfig(BaseModel):
    """What ``ssd serve``, the Ray job and the Serve app deploy. Immutable; ``load`` reads a YAML file."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    address: str | None = setting(None, "join this Ray cluster (default: start an embedded local Ray)", "where")
    host: str = setting("127.0.0.1", "public bind host", "where")
    port: int = setting(50051, "public gRPC port (0: any free)", "where", ge=0, le=65535)
    http_port: int | None = setting(
        None, "also serve OpenAI-compatible HTTP (/v1/chat/completions, /v1/completions, /v1/models, /health, "
        "/metrics) on this port, over the same engine (0: any free; default off)", "where", ge=0, le=65535)
    metrics_port: int | None = setting(None, "serve Prometheus metrics on this port, on the public host (0: any "
                                       "free; default off)", "where", ge=0, le=65535)
    num_cpus: int | None = setting(None, "CPUs of the embedded local Ray (default: all)", "where", ge=1)
    drafter_host: str = setting(
        "auto", "where the drafter listens: auto (127.0.0.1 when it shares the verifier's node, else the node IP, "
        "then with the public API's TLS and token), node-ip, or an address", "where")

    pair: str | None = setting(None, "a named model pair for target and draft when they are not given: "
                               "smollm2-135m (the default) or qwen2.5-coder-1.5b (`ssd install-models --pair` "
                               "first)", "models")
    target: str | None = setting(None, "target: an HF model folder or a .gguf file (default: `ssd models`)",
                                 "models")
    draft: str | None = setting(None, "draft: an HF model folder or a .gguf file (default: `ssd models`)",
                                "models")
    dtype: str = setting("auto", "auto | float32 | bfloat16 | float16 | int8 | int4 | w8a8 | gguf (the draft "
                         "follows the target's as it resolves on a CPU)", "models")
    draft_dtype: str | None = setting(None, "the draft's dtype (default: the target's as it resolves on the "
                                      "device; under a weight format on a CPU, int4 or the draft GGUF's own)",
                                      "models")
    device: str = setting("auto", "auto (the actor's GPU if it has one, else cpu) | cpu | cuda | cuda:N", "models")
    enforce_eager: bool = setting(False, "run every forward eagerly (default: on a GPU, decode, verify and draft "
                                  "steps replay CUDA graphs captured per batch bucket)", "models")
    served_model_name: str | None = setting(None, "the `model` name HTTP clients use (default: the target's "
                                            "name)", "models")

    k: int = setting(DEFAULT_K, "lookahead K: the most tokens a round speculates", "speculation", ge=1)
    budget: int | None = setting(None, "pre-drafted branches per request (fan-out budget; default "
                                 f"{FanoutConfig().budget})", "speculation", ge=1)
    ssd_strategy: Literal["auto", "fanout", "run-ahead"] = setting(
        "auto", "how the drafter drafts: fanout (a tree per likely outcome of every round), run-ahead (one chain "
        "per request, ahead of the verifier), auto (run-ahead where the draft reads a quarter of the target's "
        "weights per token or more)", "speculation")
    run_ahead_schedule: Literal["auto", "pipelined", "alternating"] = setting(
        "auto", "how a run-ahead drafter and the verifier share their two cores when both are pinned on one CPU "
        "machine: pipelined (the drafter drafts the next round during the verify), alternating (each side runs on "
        "both cores while the other waits), auto (the one measured faster)", "speculation")
    saguaro_c: float = setting(1.0, "Saguaro down-weighting C in (0, 1]", "speculation", gt=0, le=1)
    tree: str = setting(str(SSD_DEFAULT_TREE), "SSD's candidate tree per outcome: auto (the drafter picks the leaves "
                        "per depth from measured acceptance), chain, WIDTHxLEVELS (the draft's next WIDTH-1 choices "
                        "beside the spine at its first LEVELS depths) or W1,W2,...; +lookup adds a prompt-lookup "
                        "branch to a fixed shape, auto+nolookup drops it", "speculation")
    fixed_k: bool = setting(False, "always speculate K tokens (default: adaptive K per step, down to 0, from "
                            "measured costs)", "speculation")
    backup_policy: Literal["auto", "neural", "fast"] = setting(
        "auto", "on a miss: wait for a just-in-time draft (neural), n-gram at once (fast), or by batch size from "
        "measured timings (auto: the paper's b*)", "speculation")
    backup: Literal["ngram", "none"] = setting(
        "ngram", "what a round speculates when the drafter's speculation is missing or late: the prompt's n-gram "
        "continuation, or nothing (a plain step)", "speculation")
    wait_fraction: float = setting(0.5, "the longest a verifier waits for a just-in-time draft on a miss, as a "
                                   "fraction of its measured verify time", "speculation", ge=0)
    fit_fanout: float = setting(1.0, "fit each bundle's fan-out to be built within this fraction of the verifier's "
                                "measured step (0: always the whole budget)", "speculation", ge=0)
    sampling: Literal["auto", "residual", "coupled"] = setting(
        "auto", "how sampled requests draw: residual (accept or resample), coupled (each token an exact race "
        "keyed by seed and position: reproducible at any K), auto (coupled for requests with a seed)",
        "speculation")

    max_num_seqs: int = setting(16, "requests batched per verify step", "engine", ge=1)
    max_num_batched_tokens: int = setting(2048, "tokens per verify step, prefill chunks included", "engine", ge=1)
    max_model_len: int | None = setting(None, "a request's context limit, prompt plus output (default: the "
                                        "model's)", "engine", ge=2)
    max_queue: int = setting(64, "admitted requests before RESOURCE_EXHAUSTED (HTTP 429)", "engine", ge=1)
    kv_memory_fraction: float | None = setting(None, "each KV pool's share of its device's free memory (default: "
                                               "0.4 on a GPU; fixed on a CPU)", "engine", gt=0, lt=1)
    stats_log_interval: float | None = setting(10.0, "seconds between the verifier's one-line stats log "
                                               "(throughput, acceptance, hit rate, KV usage)", "engine", gt=0)
    max_body_bytes: int = setting(4 * 1024 * 1024, "the largest HTTP request body; a larger one gets 413 before "
                                  "it is read", "engine", ge=1)

    gpu: Literal["auto", "yes", "no"] = setting("auto", "GPUs for the actors (auto: if the cluster has 2 x "
                                                "gpu-fraction of them)", "placement")
    gpu_fraction: float = setting(1.0, "each actor's share of a GPU: 1 = a GPU each, 0.5 = both actors on one GPU",
                                  "placement", gt=0, le=1)
    strategy: str = setting("PACK", "placement strategy: PACK | SPREAD | STRICT_SPREAD | STRICT_PACK",
                            "placement")
    lend_cores: bool = setting(True, "on CPUs, with the drafter and the verifier pinned to cores of one node: a step "
                               "where nothing speculates runs the verifier on the drafter's core too (never fp32, "
                               "whose matmuls round differently on two threads)", "placement")

    drain_grace: float = setting(30.0, "seconds in-flight streams get on SIGTERM", "security and lifecycle", ge=0)
    auth_token_file: str | None = setting(None, "require `authorization: Bearer <token>` (the token read from "
                                          "this file)", "security and lifecycle")
    auth_token_env: str | None = setting(None, "... or from this environment variable", "security and lifecycle")
    tls_cert: str | None = setting(None, "TLS certificate (PEM) for the public API", "security and lifecycle")
    tls_key: str | None = setting(None, "TLS private key (PEM) for the public API", "security and lifecycle")

    @field_validator("gpu", mode="before")
    @classmethod
    def _gpu_switch(cls, v: Any) -> Any:
        """YAML's ``true``/``false`` (and ``yes``/``no``, which YAML reads as booleans) mean yes and no."""
        return {True: "yes", False: "no"}.get(v, v) if isinstance(v, bool) else v

    @field_validator("tree")
    @classmethod
    def _tree_shape(cls, v: str) -> str:
        return str(TreeShape.parse(v))

    @classmethod
    def load(cls, path: str | None = None, overrides: dict | None = None):
        """The file's settings (if any) with ``overrides`` on top (keys with dashes or underscores). ValueError
        names the bad key."""
        values = read_yaml(path) if path else {}
        values.update(_keys(overrides or {}))
        try:
            return cls(**values)
        except ValidationError as exc:
            raise ValueError(_first_error(exc, path)) from None

    @property
    def adaptive_k(self) -> bool:
        return not self.fixed_k

    @property
    def fanout_budget(self) -> int:
        return self.budget or FanoutConfig().budget

    @property
    def use_gpu(self) -> bool | None:
        """None: decide from the cluster's GPUs."""
        return {"auto": None, "yes": True, "no": False}[self.gpu]

    def ssd_config(self, **pool: Any) -> SSDConfig:
        """The drafter's side of these settings (``pool``: its KV pool's size, where not from device memory)."""
        return SSDConfig(k=self.k, fanout=FanoutConfig(budget=self.fanout_budget), saguaro_c=self.saguaro_c,
                         tree=TreeShape.parse(self.tree), strategy=self.ssd_strategy, fit_fanout=self.fit_fanout or None,
                         **pool)

    def speculation(self) -> SpeculationConfig:
        """The verifier's side of these settings."""
        return SpeculationConfig(mode="ssd", k=self.k, budget=self.fanout_budget, saguaro_c=self.saguaro_c,
                                 adaptive_k=self.adaptive_k, backup=self.backup, wait_fraction=self.wait_fraction,
                                 backup_policy=self.backup_policy,
                                 tree=TreeShape.parse(self.tree), sampling=self.sampling,
                                 run_ahead_schedule=self.run_ahead_schedule)

    def model_paths(self) -> tuple[str, str]:
        """Absolute target and draft paths: the given ones, else ``pair``'s, else ``ssd models``'."""
        from spec_core.model_paths import default_pair
        from spec_core.pairs import check_installed, get_pair, pair_paths

        pair: dict = {}
        if not (self.target and self.draft):
            if self.pair is not None:
                named = get_pair(self.pair)
                check_installed(named)
                pair = pair_paths(named)
            else:
                pair = default_pair()
        elif self.pair is not None:
            get_pair(self.pair)  # still a known name
        return _absolute(self.target or pair["target"]), _absolute(self.draft or pair["draft"])

    def public_security(self) -> dict:
        """The public API's TLS and token settings, paths absolute (the actors may run elsewhere)."""
        return {"auth_token_file": _absolute(self.auth_token_file), "auth_token_env": self.auth_token_env,
                "tls_cert": _absolute(self.tls_cert), "tls_key": _absolute(self.tls_key)}


class ServeAppConfig(ServiceConfig):
    """The Ray Serve application's arguments (``cluster.serve_app:build_app``, KubeRay's ``serveConfigV2``): every
    key of :class:`ServiceConfig`, for each replica's pair, and how many replicas on what. In a replica, ``port``,
    ``http_port`` and ``metrics_port`` default to 0 (any free): Serve's proxy is the public ingress."""

    num_replicas: int = setting(1, "replicas, each with its own drafter and verifier", "serve app", ge=1)
    pair_cpus: float = setting(0.4, "CPUs reserved for each of a replica's drafter and verifier", "serve app", gt=0)
    replica_cpus: float = setting(0.1, "CPUs reserved for the replica itself (its proxy calls)", "serve app", gt=0)
    max_ongoing_requests: int | None = setting(None, "requests one replica takes at once (default: max-queue, "
                                               "and at least max-num-seqs)", "serve app", ge=1)


def markdown() -> str:
    """The key tables of ``docs/configuration.md``: every key of the one model, by section, with default and help."""
    lines: list[str] = []
    fields = ServeAppConfig.model_fields
    for group in GROUPS:
        lines += [f"### {group.capitalize()}", "", "| key | default | meaning |", "|---|---|---|"]
        for name, f in fields.items():
            if group_of(f) == group:
                default = "—" if f.default is None else f"`{f.default}`"
                lines.append(f"| `{name.replace('_', '-')}` | {default} | {f.description.replace('|', chr(92) + '|')} |")
        lines.append("")
    return "\n".join(lines)


#: The generated block of ``docs/configuration.md`` lies between these lines.
DOC_BEGIN, DOC_END = "<!-- generated by `ssd config --markdown`: begin -->\n", "<!-- generated: end -->"


def docs_block(doc: str) -> str:
    """The generated block of ``doc`` (empty when the markers are missing)."""
    a, b = doc.find(DOC_BEGIN), doc.find(DOC_END)
    return doc[a + len(DOC_BEGIN):b] if 0 <= a < b else ""


def _absolute(path: str | None) -> str | None:
    return os.path.abspath(path) if path else path


def _keys(values: dict) -> dict:
    return {str(k).replace("-", "_"): v for k, v in values.items()}


def _first_error(exc: ValidationError, path: str | None) -> str:
    err = exc.errors()[0]
    key = ".".join(str(x) for x in err.get("loc", ()))
    where = f" in {path}" if path else ""
    if err.get("type") == "extra_forbidden":
        return f"unknown setting {key!r}{where}"
    return f"{key}: {err.get('msg')}, got {err.get('input')!r}{where}"


def read_yaml(path: str) -> dict:
    """A YAML mapping of settings (keys normalized to underscores); ValueError for a missing or bad file."""
    import yaml

    p = Path(path)
    if not p.is_file():
        raise ValueError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise ValueError(f"{path} is not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a mapping of settings, got {type(data).__name__}")
    return _keys(data)


def group_of(field) -> str:
    return (field.json_schema_extra or {}).get("group", "")
