"""The defaults: the backend a bare runner gets (what the engines hold when a caller hands them a
:class:`~spec_core.runner.ModelRunner` instead of a :class:`~spec_core.backends.Backend`), and the static step a
paged cache gets (graphs on a CUDA device)."""

from __future__ import annotations

from spec_core.backends import Backend
from spec_core.backends.static_step import Buckets, PagedForward, StaticStep
from spec_core.kv_cache import PagedKVCache


def as_backend(model) -> Backend:
    """``model`` if it is a :class:`Backend`, else a runner behind
    :class:`~spec_core.backends.torch_runner.RunnerBackend` (its steps replayed as CUDA graphs where the runner
    asks for them: ``ModelRunner.cuda_graphs``)."""
    if isinstance(model, Backend):
        return model
    from spec_core.backends.torch_runner import RunnerBackend

    return RunnerBackend(model, static=model.cuda_graphs)


def static_step(forward: PagedForward, cache: PagedKVCache, buckets: Buckets | None = None) -> PagedForward:
    """The static-buffer step over ``cache``: captured and replayed as CUDA graphs on a CUDA device, run eagerly
    elsewhere. The CUDA-graph module is imported only for a CUDA cache."""
    if cache.kv.device.type == "cuda":
        from spec_core.backends.cuda_graphs import graph_step

        return graph_step(forward, cache, buckets)
    return StaticStep(forward, cache.scratch_slot, cache.kv.device, buckets)
