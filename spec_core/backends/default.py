"""The backend a bare runner gets: what the engines hold when a caller hands them a
:class:`~spec_core.runner.ModelRunner` (tests, tools) instead of a :class:`~spec_core.backends.Backend`."""

from __future__ import annotations

from spec_core.backends import Backend


def as_backend(model) -> Backend:
    """``model`` if it is a :class:`Backend`, else a runner behind
    :class:`~spec_core.backends.torch_runner.RunnerBackend` (its steps replayed as CUDA graphs where the runner asks for them: ``ModelRunner.cuda_graphs``)."""
    if isinstance(model, Backend):
        return model
    from spec_core.backends.torch_runner import RunnerBackend

    return RunnerBackend(model, static=model.cuda_graphs)
