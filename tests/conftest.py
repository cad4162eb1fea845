"""Shared fixtures: seeded RNGs, tiny random HF models on disk, the toy pair and the real default pair."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One thread: deterministic kernels, and no oversubscription of CI's two cores.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


_REPORTS: list[str] = []


@pytest.fixture(scope="session")
def report():
    """``report(line)``: a measured number a test reports without asserting (printed after the run)."""
    return _REPORTS.append


def pytest_terminal_summary(terminalreporter) -> None:
    if _REPORTS:
        terminalreporter.section("reported (not asserted)")
        for line in _REPORTS:
            terminalreporter.write_line(line)


class DrafterDown:
    """A drafter link whose drafter is gone: every SSD round is served by the backup (the forced-backup regime; a
    seeded residual request only waits for a neural draft while its drafter lives)."""

    alive = False

    def send(self, msg: object) -> None: ...

    def poll(self, timeout: float | None = 0.0) -> bool:
        return False

    def recv(self) -> object:
        raise EOFError

    def flush(self) -> None: ...

    def close(self) -> None: ...


def random_dists(gen: torch.Generator, k: int, vocab: int, sparse: bool = False) -> torch.Tensor:
    """``k`` random distributions over ``vocab`` tokens, peaked (cubed uniforms); ``sparse``: about half the tokens
    of each row at zero (token 0 never), so residuals and draws meet zero-mass tokens."""
    x = torch.rand(k, vocab, generator=gen) ** 3
    if sparse:
        x = x * (torch.rand(k, vocab, generator=gen) > 0.5)
        x[:, 0] += 1e-3
    return x / x.sum(-1, keepdim=True)


def tiny_config(family: str, vocab_size: int = 256, **overrides):
    """A random tiny config; ``initializer_range`` 0.2 keeps argmax ties away (see the Foundation issue)."""
    from transformers import LlamaConfig, Qwen3Config

    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2,
                  max_position_embeddings=512, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    common.update(overrides)
    if family == "llama":
        return LlamaConfig(**common)
    if family == "qwen3":
        return Qwen3Config(head_dim=32, **common)
    raise ValueError(family)


NOISY_SCALE = 0.05


def save_tiny_model(path: Path, family: str, seed: int, **overrides) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **overrides))
    model.save_pretrained(str(path))
    return path


def save_noisy_copy(src: Path, path: Path, scale: float, seed: int) -> Path:
    """``src`` with Gaussian noise (``scale`` × each tensor's std) on every weight: a draft that agrees with its
    target often, not always (what tree and outcome speculation need to be exercised)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(src))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * p.float().std().nan_to_num() * scale)
    model.save_pretrained(str(path))
    return path


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """Random tiny Llama and Qwen3 targets, plus a smaller draft for each (same vocabulary), and a noisy copy of
    the Llama target (a draft that mostly agrees with it)."""
    base = tmp_path_factory.mktemp("tiny")
    llama = save_tiny_model(base / "llama", "llama", 1)
    return {
        "llama": llama,
        "llama-noisy": save_noisy_copy(llama, base / "llama-noisy", NOISY_SCALE, 6),
        "llama-draft": save_tiny_model(base / "llama-draft", "llama", 2, hidden_size=32, num_hidden_layers=1,
                                       num_attention_heads=2, num_key_value_heads=1, intermediate_size=64),
        "qwen3": save_tiny_model(base / "qwen3", "qwen3", 3),
        "qwen3-draft": save_tiny_model(base / "qwen3-draft", "qwen3", 4, num_hidden_layers=1),
        "llama-vocab300": save_tiny_model(base / "llama-vocab300", "llama", 5, vocab_size=300),
    }


@pytest.fixture(scope="session")
def toy_pair() -> dict[str, str]:
    """The 17M/1M toy pair (its own 8k tokenizer): fast, for tests of the machinery."""
    from spec_core.model_paths import toy_pair as pair

    paths = pair()
    for p in paths.values():
        assert Path(p, "config.json").is_file(), f"shipped model missing: {p}"
    return paths


@pytest.fixture(scope="session")
def real_pair() -> dict[str, str]:
    """The default pair: SmolLM2-135M-Instruct (installed by ``make install``) and the draft trained for it."""
    from spec_core.model_paths import default_pair

    paths = default_pair()
    for p in paths.values():
        assert Path(p, "config.json").is_file(), f"default model missing: {p} (run make install)"
    return paths


def start_served(*args: str, timeout_s: float = 240):
    """``ssd -v serve ARGS`` as a subprocess with its own embedded Ray on free ports (gRPC, HTTP, metrics), once it
    logged its deployment: ``(process, info)``, ``info`` being that deployment (JSON). Its log is drained for the
    process's life (a full pipe would block the server's logging)."""
    import json
    import os
    import subprocess
    import sys
    import threading
    from collections import deque

    env = dict(os.environ, RAY_AUTH_MODE="disabled")
    proc = subprocess.Popen([sys.executable, "-m", "ssd_cli.main", "-v", "serve", "--port", "0", "--metrics-port", "0",
                             "--http-port", "0", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    tail: deque[str] = deque(maxlen=40)
    found = threading.Event()
    info: dict = {}

    def read_log() -> None:
        for line in proc.stderr:
            tail.append(line)
            if not found.is_set() and " ssd: deployment: {" in line:
                info.update(json.loads(line.split(" ssd: deployment: ", 1)[1]))
                found.set()
        found.set()

    threading.Thread(target=read_log, daemon=True).start()
    if not found.wait(timeout_s) or not info:
        proc.kill()
        pytest.fail(f"ssd serve did not start: {''.join(tail)[-2000:]}")
    return proc, info


@pytest.fixture(scope="session")
def served():
    """``ssd -v serve`` in fp32 for the exactness checks (:func:`start_served`), shared by the whole session; the
    one test that stops it is marked ``stops_served`` and runs last."""
    proc, info = start_served("--dtype", "float32")
    yield proc, info
    if proc.poll() is None:
        proc.kill()


def pytest_collection_modifyitems(items) -> None:
    """Tests that stop the shared ``served`` process run after every other test."""
    items.sort(key=lambda item: item.get_closest_marker("stops_served") is not None)


@pytest.fixture(scope="session")
def ray_session():
    """One embedded Ray for the whole test session: 2 CPUs and 2 logical GPUs (they work on CPU machines)."""
    import ray

    ray.init(num_cpus=2, num_gpus=2, include_dashboard=False, log_to_driver=False, address="local")
    yield ray
    ray.shutdown()


def _ar_reference(target_path: str):
    from spec_core.config import ModelConfig, SamplingParams
    from verifier_service.api import Generator

    gen = Generator(ModelConfig(target_path), None)
    cache: dict = {}

    def reference(prompt, n: int) -> list[int]:
        key = (tuple(prompt) if isinstance(prompt, list) else prompt, n)
        if key not in cache:
            res = gen.generate(prompt, SamplingParams(max_new_tokens=n, ignore_eos=True), mode="ar")
            cache[key] = res.token_ids
        return cache[key]

    return reference


@pytest.fixture(scope="session")
def real_reference(real_pair):
    """``reference(prompt, n)``: the real target's own greedy tokens (fp32 AR; equal to transformers, see
    test_real_pair), memoised."""
    return _ar_reference(real_pair["target"])


@pytest.fixture(scope="session")
def greedy_reference(toy_pair):
    """``reference(prompt, n)``: the toy target's own greedy tokens (plain AR with our engine), memoised."""
    return _ar_reference(toy_pair["target"])
