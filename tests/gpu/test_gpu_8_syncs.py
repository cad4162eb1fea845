"""Hidden host syncs: engine steps under torch's sync debug mode synchronise with the host only where the crossings
are counted (``spec_core/transfer.py``) and in the step timer. A ``bool()``, ``int()``, ``.item()`` or an implicit
copy anywhere else is a hidden sync, and the tests name its line. In a CPU dry run nothing synchronises and only the
tests' own code is checked."""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from spec_core.config import ModelConfig, SamplingParams
from spec_core.sequence import Sequence
from verifier_service.api import Generator

pytestmark = pytest.mark.gpu

NEW = 32
#: Where a verifier step may synchronise with the host: the counted crossings, and the step timer's read of its end
#: event (after the step's download, when the device is idle anyway).
SYNC_ALLOWED = ("transfer.py", "timing.py")
#: Greedy, seeded sampled, coupled and unseeded sampled requests, in one batch.
PARAMS = [SamplingParams(max_new_tokens=NEW, ignore_eos=True),
          SamplingParams(temperature=0.8, seed=1, max_new_tokens=NEW, ignore_eos=True, coupled=False),
          SamplingParams(temperature=0.8, seed=2, max_new_tokens=NEW, ignore_eos=True, coupled=True),
          SamplingParams(temperature=0.8, max_new_tokens=NEW, ignore_eos=True)]


def _pair(toy_pair, device: str) -> Generator:
    return Generator(*[ModelConfig(toy_pair[m], "float32", device) for m in ("target", "draft")], k=3)


def _watched(engine, gen: Generator, device: str) -> tuple[Counter, dict[str, int], int]:
    """Run the batch once to warm up (graphs captured, kernels loaded), then again under sync debug mode: (syncs
    by file:line, the hidden ones, the watched steps)."""
    def run(tag: str) -> None:
        for i, p in enumerate(PARAMS):
            engine.add(Sequence(f"{tag}{i}", gen.tokenizer.encode(f"def f{i}(x):"), p))
        engine.run()

    run("warm")
    warm_steps = engine.metrics.num_steps
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run("watched")
    finally:
        if cuda:
            torch.cuda.set_sync_debug_mode(0)
    where = Counter(f"{Path(w.filename).name}:{w.lineno}" for w in caught if "synchroniz" in str(w.message))
    hidden = {at: n for at, n in where.items() if not at.startswith(SYNC_ALLOWED)}
    if cuda:
        assert where, "sync debug mode reported nothing: the check is not watching"
    return where, hidden, engine.metrics.num_steps - warm_steps


def _report(gpu_report: Callable[[str], None], what: str, device: str, watched) -> None:
    where, hidden, steps = watched
    gpu_report(f"syncs of {steps} {what} steps on {device} (greedy, sampled, coupled together): "
               f"{sum(where.values())} in all, by line {dict(where.most_common(8))}; hidden {hidden or 'none'}")
    assert not hidden, f"hidden host syncs (file:line -> count): {hidden}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("branching", [1, 2])
def test_sd_steps_synchronise_only_where_the_crossings_are_counted(toy_pair, device, gpu_report, branching):
    """SD over the toy pair, graphs on: chains, and trees of two branches at ``branching=2``."""
    from spec_core.draft_engine import BatchDrafter, DraftConfig
    from verifier_service.engine_builder import EnginePlan, build_engine

    gen = _pair(toy_pair, device)
    draft = BatchDrafter(gen.pair.draft, DraftConfig(k=3, branching=branching, num_blocks=256, block_size=16))
    engine = build_engine(gen.pair.target, EnginePlan(512, 16, max_num_seqs=4, k=3, max_spec_nodes=3 * branching),
                          draft)
    _report(gpu_report, f"SD (branching {branching})", device, _watched(engine, gen, device))


@pytest.mark.timeout(300)
def test_ssd_steps_synchronise_only_where_the_crossings_are_counted(toy_pair, device, gpu_report):
    """SSD over the toy pair with the fan-out drafter in process (:class:`drafter_service.loopback.LoopbackLink`,
    which runs the drafter's steps on this thread): the verifier's steps, the proposer's and the drafter's."""
    from drafter_service.loopback import LoopbackLink
    from drafter_service.ssd_drafter import SSDDrafter
    from spec_core.config import FanoutConfig, SSDConfig
    from verifier_service.engine_builder import EnginePlan, build_engine
    from verifier_service.ssd_proposer import SSDProposer

    gen = _pair(toy_pair, device)
    config = SSDConfig(k=3, fanout=FanoutConfig(budget=6))
    proposer = SSDProposer(LoopbackLink(SSDDrafter(gen.pair.draft, config)), 256, wait_fraction=0.5,
                           max_nodes=config.max_nodes)
    engine = build_engine(gen.pair.target, EnginePlan(512, 16, max_num_seqs=4, k=3, max_spec_nodes=config.max_nodes),
                          proposer)
    _report(gpu_report, "SSD (fan-out, in process)", device, _watched(engine, gen, device))
    assert proposer.stats.hits > 0, proposer.stats
