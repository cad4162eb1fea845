"""``ssd serve`` settings: every flag, also settable from a YAML file (``ssd serve --config serve.yaml``).

One pydantic model, :class:`ServeSettings`, holds them. Keys are the flag names without the dashes
(``max-model-len`` and ``max_model_len`` both work); an unknown key is an error that names it. Flags given on the
command line override the file. :meth:`ServeSettings.pair_config` turns the settings into the deployment's
:class:`cluster.launch.PairConfig`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from spec_core.config import SSD_DEFAULT_TREE, TreeShape
from spec_core.fanout import FanoutConfig


class ServeSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    # where
    address: str | None = None
    host: str = "127.0.0.1"
    port: int = Field(50051, ge=0, le=65535)
    http_port: int | None = Field(None, ge=0, le=65535)
    metrics_port: int | None = Field(None, ge=0, le=65535)
    num_cpus: int | None = Field(None, ge=1)
    # what
    pair: str | None = None
    target: str | None = None
    draft: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    served_model_name: str | None = None
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1)
    drafter_host: str = "auto"
    # speculation
    k: int = Field(2, ge=1)
    budget: int | None = Field(None, ge=1)
    ssd_strategy: Literal["auto", "fanout", "run-ahead"] = "auto"
    saguaro_c: float = Field(1.0, gt=0, le=1)
    tree: str = str(SSD_DEFAULT_TREE)
    fixed_k: bool = False

    @field_validator("tree")
    @classmethod
    def _tree_shape(cls, v: str) -> str:
        return str(TreeShape.parse(v))
    backup_policy: Literal["auto", "neural", "fast"] = "auto"
    sampling: Literal["auto", "residual", "coupled"] = "auto"
    # engine
    max_num_seqs: int = Field(16, ge=1)
    max_num_batched_tokens: int = Field(2048, ge=1)
    max_model_len: int | None = Field(None, ge=2)
    max_queue: int = Field(64, ge=1)
    kv_memory_fraction: float | None = Field(None, gt=0, lt=1)
    stats_log_interval: float | None = Field(10.0, gt=0)
    # placement
    gpu: Literal["auto", "yes", "no"] = "auto"
    gpu_fraction: float = Field(1.0, gt=0, le=1)
    strategy: str = "PACK"
    # lifecycle and security
    drain_grace: float = Field(30.0, ge=0)
    auth_token_file: str | None = None
    auth_token_env: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None

    @classmethod
    def load(cls, path: str | None, overrides: dict) -> ServeSettings:
        """The file's settings (if any) with ``overrides`` (the flags given) on top. ValueError names the bad key."""
        values = _read(path) if path else {}
        values.update(overrides)
        try:
            return cls(**values)
        except ValidationError as exc:
            err = exc.errors()[0]
            key = ".".join(str(x) for x in err.get("loc", ()))
            where = f" in {path}" if path else ""
            if err.get("type") == "extra_forbidden":
                raise ValueError(f"unknown setting {key!r}{where}") from None
            raise ValueError(f"{key}: {err.get('msg')}{where}") from None

    def pair_config(self):
        """The deployment these settings describe (model paths default to ``ssd models``, or to ``pair``'s)."""
        import os

        from cluster.launch import PairConfig
        from spec_core.model_paths import default_pair
        from spec_core.pairs import check_installed, get_pair, pair_paths

        pair = {}
        if self.pair is not None:
            named = get_pair(self.pair)
            if not (self.target and self.draft):
                check_installed(named)
            pair = pair_paths(named)
        elif not (self.target and self.draft):
            pair = default_pair()
        absolute = lambda p: os.path.abspath(p) if p else None  # noqa: E731 - the actors may run elsewhere
        return PairConfig(
            self.target or pair["target"], self.draft or pair["draft"], k=self.k,
            budget=self.budget or FanoutConfig().budget, ssd_strategy=self.ssd_strategy, saguaro_c=self.saguaro_c, tree=self.tree, dtype=self.dtype, host=self.host,
            port=self.port, max_num_seqs=self.max_num_seqs, max_queue=self.max_queue,
            use_gpu={"auto": None, "yes": True, "no": False}[self.gpu], strategy=self.strategy,
            gpu_fraction=self.gpu_fraction, device=self.device, kv_memory_fraction=self.kv_memory_fraction,
            metrics_port=self.metrics_port, adaptive_k=not self.fixed_k, backup_policy=self.backup_policy,
            sampling=self.sampling,
            http_port=self.http_port, served_model_name=self.served_model_name, max_model_len=self.max_model_len,
            max_num_batched_tokens=self.max_num_batched_tokens, stats_log_interval_s=self.stats_log_interval,
            drafter_host=self.drafter_host,
            extra_verifier={"max_body_bytes": self.max_body_bytes, "auth_token_file": absolute(self.auth_token_file),
                            "auth_token_env": self.auth_token_env,
                            "tls_cert": absolute(self.tls_cert), "tls_key": absolute(self.tls_key)})


def _read(path: str) -> dict:
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
    return {str(k).replace("-", "_"): v for k, v in data.items()}
