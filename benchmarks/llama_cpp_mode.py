"""The peer: greedy or sampled AR through ``llama-cpp-python`` on the target's own GGUF (bench modes
``llama-cpp`` and ``llama-cpp-2t``).

An optional extra, built from source (``pip install llama-cpp-python``, see the README), never installed by
``make install`` nor used in CI. When it is missing, or the target has no GGUF file, :func:`unavailable_reason`
says why and the bench reports the mode as skipped.

It is fed the very token ids our tokenizer makes (the GGUF carries the same vocabulary), decodes on the given
threads, and is timed as our modes are: prefill (the first token) apart from decode.
"""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

from spec_core.config import SamplingParams
from spec_core.metrics import DecodeStats

INSTALL_HINT = ("llama-cpp-python is not installed (an optional extra, built from source: "
                "`CMAKE_ARGS=-DGGML_NATIVE=ON pip install llama-cpp-python`)")


def target_gguf(target_path: str) -> Path | None:
    """The GGUF file a target came from: the path itself, or the file its converted folder records."""
    from spec_core.gguf_checkpoint import SOURCE_RECORD
    from spec_core.model_paths import default_target_dir, installed_target_gguf

    p = Path(target_path)
    if p.suffix == ".gguf" and p.is_file():
        return p
    record = p / SOURCE_RECORD
    if record.is_file():
        src = json.loads(record.read_text()).get("path")
        if src and Path(src).is_file():
            return Path(src)
    if p.resolve() == default_target_dir().resolve():
        return installed_target_gguf()
    return None


def unavailable_reason(target_path: str) -> str | None:
    """Why the llama-cpp modes cannot run here (``None``: they can)."""
    if importlib.util.find_spec("llama_cpp") is None:
        return INSTALL_HINT
    if target_gguf(target_path) is None:
        return f"no GGUF file known for the target {target_path} (pass --target FILE.gguf)"
    return None


class LlamaCppAR:
    """One ``llama_cpp.Llama`` per thread count, loaded once and reset per request."""

    def __init__(self, gguf: Path, n_ctx: int = 2048) -> None:
        self.gguf, self.n_ctx = gguf, n_ctx
        self.models: dict[int, object] = {}

    def _model(self, threads: int):
        if threads not in self.models:
            from llama_cpp import Llama

            self.models[threads] = Llama(model_path=str(self.gguf), n_ctx=self.n_ctx, n_threads=threads,
                                         n_threads_batch=threads, n_batch=512, verbose=False)
        return self.models[threads]

    def generate(self, ids: list[int], params: SamplingParams, eos_ids: tuple[int, ...],
                 threads: int) -> tuple[list[int], DecodeStats, float, list[float]]:
        """Tokens, stats (decode excludes the first token), time to first token, emission times."""
        llm = self._model(threads)
        llm.reset()
        greedy = params.temperature == 0
        kwargs = dict(temp=0.0, top_k=1) if greedy else dict(
            temp=params.temperature, top_k=params.top_k or 0, top_p=params.top_p, min_p=0.0)
        if params.seed is not None:
            llm.set_seed(params.seed)
        out: list[int] = []
        times: list[float] = []
        t0 = time.perf_counter()
        for tok in llm.generate(ids, reset=True, repeat_penalty=1.0, **kwargs):
            out.append(int(tok))
            times.append(time.perf_counter())
            if len(out) >= params.max_new_tokens or (not params.ignore_eos and tok in eos_ids):
                break
        ttft = times[0] - t0 if times else 0.0
        stats = DecodeStats()
        stats.num_generated = len(out)
        stats.decode_s = times[-1] - times[0] if len(times) > 1 else 0.0
        stats.prefill_s = ttft
        stats.num_rounds = stats.num_round_tokens = max(0, len(out) - 1)
        stats.verify_s = stats.decode_s
        return out, stats, ttft, times
