"""The backend protocol (:mod:`spec_core.backends`): the runner behind it, and the layout that keeps the CUDA-graph
module and the CPU-kernel modules apart."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import torch
from work_items import work_item

from spec_core.backends import Backend
from spec_core.backends.default import static_step
from spec_core.backends.static_step import Buckets, StaticStep
from spec_core.backends.torch_runner import RunnerBackend
from spec_core.packing import pack
from spec_core.runner import ModelRunner

ROOT = Path(__file__).resolve().parents[1]
CPU_MODULES = {f"spec_core.backends.cpu.{m}" for m in ("cpu_kernels", "quant", "w8a8", "row_padding", "kquant")}
CUDA_MODULE = "spec_core.backends.cuda_graphs"


def _file(module: str) -> Path | None:
    base = ROOT.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _direct(module: str) -> set[str]:
    """spec_core modules ``module`` imports at any depth of its file (function-level and TYPE_CHECKING imports
    included), with the packages above each one (importing a module runs its packages' ``__init__``)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(_file(module).read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    out = set()
    for name in found:
        parts = name.split(".")
        out.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return {m for m in out if m.startswith("spec_core") and _file(m) is not None}


def imports_of(module: str) -> set[str]:
    """Every spec_core module importing ``module`` may run, transitively."""
    seen, todo = set(), [module]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(_direct(m) - seen)
    return seen - {module}


def test_the_cuda_graph_module_imports_no_cpu_kernel_module():
    reach = imports_of(CUDA_MODULE)
    assert "spec_core.backends.static_step" in reach and "spec_core.kv_cache" in reach  # the scan sees imports
    assert not reach & CPU_MODULES, sorted(reach & CPU_MODULES)
    assert "spec_core.runner" not in reach


def test_no_cpu_backend_module_imports_the_cuda_one():
    for module in sorted(CPU_MODULES):
        reach = imports_of(module)
        assert CUDA_MODULE not in reach and "spec_core.backends.torch_runner" not in reach, (module, sorted(reach))
    # negative control: the scan follows chains
    assert "spec_core.backends.cpu.cpu_kernels" in imports_of("spec_core.backends.cpu.w8a8")


def test_the_cpu_backend_never_imports_the_runner():
    """The runner switches the CPU backend's parts on; none of them reaches back (w8a8 once imported the runner for
    its weight layout, which now lives in :mod:`spec_core.weight_layout`)."""
    for module in sorted(CPU_MODULES):
        assert "spec_core.runner" not in imports_of(module), module
    assert CPU_MODULES <= imports_of("spec_core.runner") | {"spec_core.backends.cpu.w8a8"}  # the scan sees them


def test_importing_the_cuda_graph_module_touches_no_cuda():
    code = ("import torch, spec_core.backends.cuda_graphs as g\n"
            "print(torch.cuda.is_initialized(), sorted(m for m in __import__('sys').modules "
            "if m in ('spec_core.backends.cpu.cpu_kernels', 'spec_core.runner')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "False []", out.stdout


def test_the_runner_backend_meets_the_protocol(toy_pair):
    runner = ModelRunner(toy_pair["target"])
    dynamic, static = RunnerBackend(runner), RunnerBackend(runner, static=True, buckets=Buckets(context_step=1))
    assert isinstance(dynamic, Backend) and isinstance(static, Backend)
    caps = static.capabilities()
    assert caps.exact and not caps.graphs and not caps.cpu_kernels and caps.device_type == "cpu"
    ids = torch.randint(0, 8000, (64,), generator=torch.Generator().manual_seed(3)).tolist()
    outs = []
    for backend in (dynamic, static):
        cache = backend.new_paged_cache(16, 16)
        with backend.timer() as t:
            backend.forward_paged(cache, pack([work_item(ids, 0, 12, 0), work_item(ids, 0, 5, 64)], cache.scratch_slot))
            step = [work_item(ids, 12, 1, 0), work_item(ids, 5, 4, 64)]
            outs.append((backend.forward_paged(cache, pack(step, cache.scratch_slot)), cache.kv[:, :-1].clone()))
        assert t.elapsed_s() > 0
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert isinstance(static_step(runner.forward_paged, runner.new_paged_cache(4, 16)), StaticStep)  # no CUDA: eager


class _FakeGraph:
    """A stand-in for ``torch.cuda.CUDAGraph`` on a CPU: capture records the forward, replay runs it again into the
    captured output (what replaying a graph does to its output tensor)."""

    capturing: _FakeGraph | None = None
    captures = 0

    def __init__(self) -> None:
        self.fn = self.out = None

    def replay(self) -> None:
        with torch.inference_mode():
            self.out.copy_(self.fn())

    def pool(self) -> str:
        return "pool"


def _fake_cuda(monkeypatch, runner):
    """Patch the CUDA calls :mod:`spec_core.backends.cuda_graphs` makes; returns the forward to give the step."""
    import contextlib
    import types

    from spec_core.backends import cuda_graphs

    @contextlib.contextmanager
    def graph(g, pool=None):
        _FakeGraph.capturing, _FakeGraph.captures = g, _FakeGraph.captures + 1
        yield
        _FakeGraph.capturing = None

    stream = types.SimpleNamespace(wait_stream=lambda other: None)
    monkeypatch.setattr(_FakeGraph, "captures", 0)
    monkeypatch.setattr(cuda_graphs, "require_cuda", lambda device: None)
    for name, value in (("CUDAGraph", _FakeGraph), ("graph", graph), ("Stream", lambda device=None: stream),
                        ("stream", lambda s: contextlib.nullcontext()), ("current_stream", lambda: stream),
                        ("synchronize", lambda: None)):
        monkeypatch.setattr(torch.cuda, name, value)

    def forward(cache, batch):
        g = _FakeGraph.capturing
        if g is None:
            return runner.forward_paged(cache, batch)
        g.fn = lambda: runner.forward_paged(cache, batch)
        g.out = g.fn()
        return g.out

    return forward


def test_the_graph_step_captures_once_per_bucket_and_replays_exactly(monkeypatch, toy_pair):
    """The graph step's bookkeeping on a CPU, with CUDA's calls faked: one capture per bucket, captures write only
    the scratch slot, and replays give the dynamic forward's logits and K/V bit for bit (exact slot buckets)."""
    from spec_core.backends.cuda_graphs import CudaGraphStep

    runner = ModelRunner(toy_pair["target"])
    forward = _fake_cuda(monkeypatch, runner)
    ids = torch.randint(0, 8000, (64,), generator=torch.Generator().manual_seed(4)).tolist()
    prefill = [work_item(ids, 0, 12, 0), work_item(ids, 0, 5, 64), work_item(ids, 0, 7, 128)]
    steps = [prefill] + [[work_item(ids, 12 + i, 1, 0), work_item(ids, 5 + i, 2, 64), work_item(ids, 7 + i, 1, 128)]
                         for i in range(0, 8, 2)]
    outs = []
    for graphs in (False, True):
        cache = runner.new_paged_cache(16, 16)
        step = CudaGraphStep(forward, cache, Buckets(max_tokens=16, context_step=1)) if graphs else None
        got = [(step or runner.forward_paged)(cache, pack(items, cache.scratch_slot)) for items in steps]
        outs.append((got, cache.kv[:, :-1].clone(), step))
    (want, kv_want, _), (got, kv, step) = outs
    assert all(torch.equal(a, b) for a, b in zip(got, want)) and torch.equal(kv, kv_want)
    assert _FakeGraph.captures == len(step.graphs) == len(steps)  # each step's slot count is new: a bucket each
    before = cache.kv[:, :-1].clone()
    buf = step.static.buffers_for(pack(steps[-1], cache.scratch_slot))
    step.capture(buf)  # over the padding state: writes the scratch slot only
    assert torch.equal(cache.kv[:, :-1], before)
    replayed = step(cache, pack(steps[-1], cache.scratch_slot))
    assert torch.equal(replayed, got[-1]) and _FakeGraph.captures == len(steps) + 1
