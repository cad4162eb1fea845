"""The peer: greedy or sampled AR through llama.cpp on the target's own GGUF (bench modes ``llama-cpp`` and
``llama-cpp-2t``).

Two ways to run it, neither installed by ``make install`` nor used in CI:

* ``llama-cpp-python`` (an optional extra, built from source, see the README), when it is installed: it is fed the
  very token ids our tokenizer makes (the GGUF carries the same vocabulary) and timed as our modes are, prefill
  (the first token) apart from decode;
* else the ``llama-completion`` binary that ``make llama-cpp`` builds (:mod:`benchmarks.llama_cpp_build`): it gets
  the prompt's text and is timed by llama.cpp itself, its prompt evaluation apart from its single-token steps.

When neither is here, or the target has no GGUF file, :func:`unavailable_reason` says why and the bench reports
the mode as skipped.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import time
from pathlib import Path

from benchmarks.llama_cpp_build import binary, read_record
from benchmarks.llama_cpp_output import LlamaCppOutputError, parse_completion_output
from spec_core.config import SamplingParams
from spec_core.metrics import DecodeStats

INSTALL_HINT = ("neither llama-cpp-python (an optional extra: `CMAKE_ARGS=-DGGML_NATIVE=ON pip install "
                "llama-cpp-python`) nor llama.cpp's llama-completion (`make llama-cpp`) is installed")
COMPLETION_BINARY = "llama-completion"


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


def has_python_package() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def make_ar(target_path: str) -> LlamaCppAR | LlamaCppBinaryAR:
    """The AR peer for a target :func:`unavailable_reason` passed: llama-cpp-python where installed, else the
    binary."""
    gguf = target_gguf(target_path)
    return LlamaCppAR(gguf) if has_python_package() else LlamaCppBinaryAR(binary(COMPLETION_BINARY), gguf)


def unavailable_reason(target_path: str) -> str | None:
    """Why the llama-cpp modes cannot run here (``None``: they can)."""
    if not has_python_package() and binary(COMPLETION_BINARY) is None:
        return INSTALL_HINT
    if target_gguf(target_path) is None:
        return f"no GGUF file known for the target {target_path} (pass --target FILE.gguf)"
    return None


class LlamaCppAR:
    """One ``llama_cpp.Llama`` per thread count, loaded once and reset per request."""

    takes_text = False

    def __init__(self, gguf: Path, n_ctx: int = 2048) -> None:
        self.gguf, self.n_ctx = gguf, n_ctx
        self.models: dict[int, object] = {}

    def _model(self, threads: int):
        if threads not in self.models:
            from llama_cpp import Llama

            self.models[threads] = Llama(model_path=str(self.gguf), n_ctx=self.n_ctx, n_threads=threads,
                                         n_threads_batch=threads, n_batch=512, verbose=False)
        return self.models[threads]

    def record(self) -> dict:
        from importlib.metadata import version

        return {"package": f"llama-cpp-python {version('llama-cpp-python')}", "target_gguf": str(self.gguf),
                "prompt": "our token ids"}

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


class LlamaCppBinaryAR:
    """``llama-completion`` run once per request on the prompt's text; llama.cpp's own timings."""

    takes_text = True

    def __init__(self, exe: Path, gguf: Path, n_ctx: int = 4096) -> None:
        self.exe, self.gguf, self.n_ctx = exe, gguf, n_ctx

    def command(self, prompt: str, params: SamplingParams, threads: int) -> list[str]:
        from benchmarks.llama_cpp_spec import sampling_flags

        t = str(threads)
        return [str(self.exe), "-m", str(self.gguf), "-t", t, "-tb", t, "-c", str(self.n_ctx), "-n",
                str(params.max_new_tokens), "-no-cnv", "--perf", *sampling_flags(params), "--no-escape", "-p", prompt]

    def generate(self, prompt: str, params: SamplingParams, threads: int) -> tuple[DecodeStats, float]:
        """Stats (decode: the steps after the first token) and time to first token (the prompt's evaluation)."""
        proc = subprocess.run(self.command(prompt, params, threads), capture_output=True, text=True, errors="replace",
                              stdin=subprocess.DEVNULL, timeout=900)
        out = proc.stdout + "\n" + proc.stderr
        if proc.returncode != 0:
            raise LlamaCppOutputError(f"{self.exe.name} exited with status {proc.returncode}:\n"
                                      + "\n".join(out.strip().splitlines()[-15:]))
        t = parse_completion_output(out)
        stats = DecodeStats()
        stats.num_generated, stats.decode_s, stats.prefill_s = t.generated, t.eval_s, t.prompt_s
        stats.num_rounds = stats.num_round_tokens = t.eval_runs
        stats.verify_s = stats.decode_s
        return stats, t.prompt_s

    def record(self) -> dict:
        return {"binary": str(self.exe), "build": read_record(), "target_gguf": str(self.gguf),
                "prompt": "text, tokenized by llama.cpp"}
