"""The engine, scheduler, proposers and drafters see the model only through the backend protocol
(:class:`spec_core.backends.Backend`): they import no runner and no CPU-kernel module, and every attribute they read
off their backend is one of the protocol's."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import torch

from spec_core.backends import Backend
from spec_core.backends.default import as_backend
from spec_core.backends.static_step import Buckets
from spec_core.backends.torch_runner import RunnerBackend

ROOT = Path(__file__).resolve().parents[1]
#: What holds or drives a model on either side.
ENGINE_MODULES = ("verifier_service/engine.py", "verifier_service/scheduler.py", "verifier_service/ssd_proposer.py",
                  "verifier_service/run_ahead_proposer.py", "spec_core/draft_engine.py", "spec_core/tree_draft.py",
                  "spec_core/packing.py", "drafter_service/ssd_drafter.py", "drafter_service/run_ahead.py")
#: The runner and the CPU backend's modules, and the backend implementations: none is the protocol.
FORBIDDEN = ("spec_core.runner", "spec_core.backends.cpu", "spec_core.gguf_weights", "spec_core.backends.torch_runner",
             "spec_core.backends.cuda_graphs")


def _tree(rel: str) -> ast.Module:
    return ast.parse((ROOT / rel).read_text(encoding="utf-8"))


def imported(tree: ast.Module) -> set[str]:
    """Every module name ``tree`` imports, at any depth (with ``from m import n``: ``m`` and ``m.n``)."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def backend_attributes(tree: ast.Module) -> set[str]:
    """The attributes read off ``self.backend`` in ``tree``."""
    return {node.attr for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
            and node.value.attr == "backend" and isinstance(node.value.value, ast.Name)
            and node.value.value.id == "self"}


def protocol_members() -> set[str]:
    members = set(Backend.__annotations__)
    members.update(name for name, _ in inspect.getmembers(Backend, inspect.isfunction) if not name.startswith("_"))
    return members


@pytest.mark.parametrize("rel", ENGINE_MODULES)
def test_the_engine_side_imports_only_the_protocol(rel):
    names = imported(_tree(rel))
    bad = sorted(n for n in names if n.startswith(FORBIDDEN))
    assert not bad, f"{rel} imports {bad}"


@pytest.mark.parametrize("rel", [m for m in ENGINE_MODULES if "self.backend" in (ROOT / m).read_text(encoding="utf-8")])
def test_the_engine_side_reads_only_protocol_members(rel):
    used = backend_attributes(_tree(rel))
    assert used, f"{rel} mentions a backend but the scan found no use"  # the scan sees what it checks
    assert used <= protocol_members(), f"{rel} reads {sorted(used - protocol_members())} off its backend"


def test_the_scans_catch_a_runner_import_and_a_private_read():
    """Negative controls: the checks above fail on code that reaches past the protocol."""
    code = ast.parse("from spec_core.runner import ModelRunner\n"
                     "class E:\n    def f(self):\n        return self.backend.runner.kernels\n")
    assert "spec_core.runner.ModelRunner" in imported(code)
    assert backend_attributes(code) == {"runner"} and "runner" not in protocol_members()


def test_engines_wrap_a_runner_in_its_default_backend(toy_pair):
    from spec_core.config import ModelConfig
    from spec_core.models import load_runner
    from verifier_service.engine import EngineConfig, VerifierEngine
    from verifier_service.scheduler import SchedulerConfig

    runner = load_runner(ModelConfig(toy_pair["target"]))
    assert not runner.cuda_graphs  # a CPU runner never asks for graphs
    engine = VerifierEngine(runner, EngineConfig(64, 16, SchedulerConfig()))
    assert isinstance(engine.backend, RunnerBackend) and not engine.backend.static
    assert isinstance(engine.backend, Backend) and engine.backend.max_positions == runner.spec.max_positions
    static = RunnerBackend(runner, static=True, buckets=Buckets(context_step=1))
    assert as_backend(static) is static  # a backend passes through as it is
    assert engine.backend.capabilities().dtype == torch.float32
