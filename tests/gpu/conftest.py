"""Fixtures for the one-shot GPU check (``pytest -m gpu tests/gpu -s``): see README.md in this folder.

Every test here is skipped, with its reason, where ``torch.cuda.is_available()`` is False. Set
``SSD_GPU_TESTS_DEVICE=cpu`` to dry-run the test code itself on a CPU (slow; device assertions then expect cpu).

At the end of the run a section "GPU check" lists the environment, every test's outcome (with the first line of
its failure) and the numbers the tests reported (the bf16 benchmark table), so a run nobody watches still says
what happened.
"""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
_OVERRIDE = os.environ.get("SSD_GPU_TESTS_DEVICE")
_CUDA = torch.cuda.is_available()

_LINES: list[str] = []  # reported numbers and tables, printed at the end
_RESULTS: dict[str, tuple[str, float, str]] = {}  # nodeid -> (outcome, seconds, first line of the failure)


def _ours(path) -> bool:
    try:
        Path(path).resolve().relative_to(HERE)
        return True
    except ValueError:
        return False


def pytest_collection_modifyitems(config, items) -> None:
    if _CUDA or _OVERRIDE:
        return
    skip = pytest.mark.skip(reason=f"CUDA is not available (torch {torch.__version__}, built for CUDA "
                                   f"{torch.version.cuda}): these checks need an NVIDIA GPU and a CUDA build of "
                                   "torch (see tests/gpu/README.md)")
    for item in items:
        if _ours(item.path):
            item.add_marker(skip)


def pytest_runtest_logreport(report) -> None:
    if not _ours(report.fspath):
        return
    prev = _RESULTS.get(report.nodeid)
    if report.when == "call" or report.failed or (report.skipped and prev is None):
        msg = ""
        if report.failed:
            text = str(report.longrepr.reprcrash.message) if hasattr(report.longrepr, "reprcrash") else str(
                report.longrepr)
            msg = text.strip().splitlines()[0][:300] if text.strip() else "failed"
            outcome = "FAILED" if report.when == "call" else f"ERROR ({report.when})"
        elif report.skipped:
            outcome = "skipped"
            if isinstance(report.longrepr, tuple):
                msg = str(report.longrepr[2])[:200]
        else:
            outcome = "passed"
        if prev is not None and prev[0] != "passed" and outcome == "passed":
            return  # a teardown never turns a failure into a pass
        _RESULTS[report.nodeid] = (outcome, (prev[1] if prev else 0.0) + report.duration, msg)


def _environment() -> list[str]:
    import transformers

    lines = [f"python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
             f"transformers {transformers.__version__}"]
    try:
        import ray

        lines[0] += f", ray {ray.__version__}"
    except ImportError:
        pass
    if _CUDA:
        p = torch.cuda.get_device_properties(0)
        lines.append(f"cuda:0 = {p.name}, {p.total_memory / 2**30:.0f} GiB, capability {p.major}.{p.minor}, "
                     f"devices visible: {torch.cuda.device_count()}, bf16: {torch.cuda.is_bf16_supported()}")
    lines.append(f"test device: {_device_name()}{'' if _CUDA or _OVERRIDE else ' (not available)'}; CPU cores: "
                 f"{len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count()}")
    return lines


def pytest_terminal_summary(terminalreporter) -> None:
    if not _RESULTS:
        return
    tr = terminalreporter
    tr.section("GPU check")
    for line in _environment():
        tr.write_line(line)
    tr.write_line("")
    width = max(len(n.split("::", 1)[-1]) for n in _RESULTS)
    shown: set[str] = set()
    for nodeid, (outcome, secs, msg) in _RESULTS.items():
        name = nodeid.split("::", 1)[-1]
        if outcome == "skipped" and msg in shown:
            msg = "(as above)"
        shown.add(msg)
        tr.write_line(f"{outcome:<16} {secs:7.1f}s  {name:<{width}}  {msg}".rstrip())
    if _LINES:
        tr.write_line("")
        for line in _LINES:
            tr.write_line(line)


def _device_name() -> str:
    return _OVERRIDE or "cuda:0"


# ---- fixtures -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def device() -> str:
    """``cuda:0`` (or ``$SSD_GPU_TESTS_DEVICE``), with fp32 kept fp32: no TF32 in matmuls."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    return _device_name()


@pytest.fixture(scope="session")
def log():
    """``log(msg)``: a progress line, visible at once with ``-s`` (and in a failed test's captured output)."""
    t0 = time.monotonic()

    def _log(msg: str) -> None:
        print(f"[gpu {time.monotonic() - t0:6.1f}s] {msg}", flush=True)

    return _log


@pytest.fixture(scope="session")
def gpu_report(log):
    """``gpu_report(line)``: a number reported (not asserted); printed at once and in the final summary."""

    def _report(line: str) -> None:
        log(line)
        _LINES.append(line)

    return _report


@pytest.fixture(scope="session")
def generator_cls():
    """``Generator``, the in-process AR/SD API (on the verifier engine)."""
    from verifier_service.api import Generator

    return Generator


@pytest.fixture(scope="session")
def tokenizer(real_pair):
    from spec_core.models import load_tokenizer

    return load_tokenizer(real_pair["target"])


@pytest.fixture(scope="session")
def prompt_sets(tokenizer) -> dict[str, list[list[int]]]:
    """Token ids of 3 HumanEval prompts and 3 chat prompts (through the chat template)."""
    from spec_core import chat
    from spec_core.prompts import chat_prompts, humaneval_prompts

    return {"code": [chat.encode(tokenizer, p) for p in humaneval_prompts(3)],
            "chat": [chat.encode(tokenizer, p) for p in chat_prompts(3)]}


@pytest.fixture(scope="session")
def prompts(prompt_sets) -> list[list[int]]:
    """2 code + 2 chat prompts (the greedy equality set)."""
    return prompt_sets["code"][:2] + prompt_sets["chat"][:2]


@pytest.fixture(scope="session")
def hf_target(real_pair, device, log):
    """The real target in transformers, fp32, on the test device: the reference."""
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(real_pair["target"], dtype=torch.float32).to(device).eval()
    log(f"transformers target loaded on {device} in {time.perf_counter() - t0:.1f}s "
        f"(attention: {getattr(model.config, '_attn_implementation', '?')})")
    return model


@pytest.fixture(scope="session")
def hf_greedy(hf_target, device):
    """``hf_greedy(prompt_ids, n)``: transformers ``generate()``, greedy, fp32, on the device (memoised)."""
    cache: dict = {}

    def _ref(ids: list[int], n: int) -> list[int]:
        key = (tuple(ids), n)
        if key not in cache:
            x = torch.tensor([ids], device=device)
            with torch.no_grad():
                out = hf_target.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                                         top_p=None, top_k=None, temperature=None)
            cache[key] = out[0, len(ids):].tolist()
        return cache[key]

    return _ref


@pytest.fixture(scope="session")
def compare(hf_target, tokenizer, device):
    """``compare(label, got, ref, prompt_ids)``: None if equal, else one line saying where they part and whether
    transformers' own logits there are a near-tie (kernel rounding) or a real divergence (a bug)."""

    def _cmp(label: str, got: list[int], ref: list[int], prompt_ids: list[int]) -> str | None:
        got, ref = list(got), list(ref)
        if got == ref:
            return None
        j = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), None)
        if j is None:
            return f"{label}: lengths differ (ours {len(got)}, transformers {len(ref)}), equal up to the shorter"
        x = torch.tensor([list(prompt_ids) + ref[:j]], device=device)
        with torch.no_grad():
            logits = hf_target(x).logits[0, -1].float()
        gap = float(logits[ref[j]] - logits[got[j]])
        kind = "a near-tie (fp32 rounding), not a logic bug" if abs(gap) < 1e-3 else "NOT a near-tie: a real bug"
        return (f"{label}: first differs at token {j}/{len(ref)}: ours {got[j]} {tokenizer.decode([got[j]])!r}, "
                f"transformers {ref[j]} {tokenizer.decode([ref[j]])!r}; transformers' logit gap {gap:.3g} ({kind})")

    return _cmp


def load_pair_on(real_pair, dtype: str, device: str):
    from spec_core.config import ModelConfig
    from spec_core.models import load_pair

    return load_pair(ModelConfig(real_pair["target"], dtype, device), ModelConfig(real_pair["draft"], dtype, device))


@pytest.fixture(scope="session")
def fp32_pair(real_pair, device, log):
    """The real target and its draft, fp32, both on the device (``ModelConfig(path, "float32", device)``)."""
    t0 = time.perf_counter()
    pair = load_pair_on(real_pair, "float32", device)
    log(f"fp32 pair loaded on {pair.target.device} / {pair.draft.device} in {time.perf_counter() - t0:.1f}s")
    assert str(pair.target.device).startswith(torch.device(device).type), pair.target.device
    return pair


@pytest.fixture(scope="session")
def pair_loader(real_pair):
    """``pair_loader(dtype, device)``: load the real pair (for the bf16 benchmark)."""
    return lambda dtype, device: load_pair_on(real_pair, dtype, device)


@pytest.fixture(scope="session")
def cores() -> tuple[int | None, int | None]:
    """Two cores this process may use (verifier, drafter) for LocalSSD's pinning; (None, None) if not two."""
    if not hasattr(os, "sched_getaffinity"):
        return None, None
    mine = sorted(os.sched_getaffinity(0))
    return (mine[0], mine[1]) if len(mine) >= 2 else (None, None)


@pytest.fixture(scope="module")
def gpu_ray(device, log):
    """An embedded Ray with the real GPUs (the suite-wide ``ray_session`` claims 2 logical GPUs, which on a
    one-GPU machine would hand one actor a GPU id that does not exist). A CPU dry run gets 1 logical GPU."""
    import ray

    if ray.is_initialized():
        log(f"reusing the running Ray: {ray.cluster_resources()}")
        yield ray
        return
    num_gpus = torch.cuda.device_count() if _CUDA and device.startswith("cuda") else 1
    ray.init(num_cpus=4, num_gpus=num_gpus, include_dashboard=False, log_to_driver=True, address="local")
    log(f"Ray started: {ray.cluster_resources()}")
    try:
        yield ray
    finally:
        ray.shutdown()


@pytest.fixture(autouse=True)
def _name_each_test(request, log):
    if _ours(request.node.path):
        log(f"--- {request.node.name}")
    yield

