"""The peer's own speculation (bench mode ``llama-cpp-spec``): llama.cpp's draft-model speculative decoding,
``llama-speculative-simple --spec-type draft-simple``, on the target's and the draft's GGUF files.

The binary is built by ``make llama-cpp`` (:mod:`benchmarks.llama_cpp_build`); without it the mode is skipped
with one line. Each request runs the binary once on the prompt's text (llama.cpp tokenizes it with the GGUF's own
tokenizer, the same vocabulary as ours) on :data:`THREADS` threads for the target and the draft, and is timed by
llama.cpp itself (:func:`benchmarks.llama_cpp_output.parse_spec_output`): model load and the prompt's encoding are
excluded, as they are from our modes' decode rate.

Before the measured runs, ``--spec-draft-n-max`` is swept over :data:`N_MAX_SWEEP` on the first
:data:`SWEEP_PROMPTS` prompts, greedy, and the fastest is kept; ``--spec-draft-p-min`` stays at :data:`P_MIN`
and ``--spec-draft-n-min`` at :data:`N_MIN`.
"""

from __future__ import annotations

import logging
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.llama_cpp_build import binary, read_record
from benchmarks.llama_cpp_output import LlamaCppOutputError, SpecTimings, parse_spec_output
from spec_core.config import SamplingParams
from spec_core.metrics import DecodeStats

logger = logging.getLogger(__name__)

SPEC_BINARY = "llama-speculative-simple"
#: draft lengths tried before the measured runs; the fastest is kept
N_MAX_SWEEP = (2, 3, 4, 6, 8)
#: the draft stops early when its own top token's probability falls below this (llama-server's long-time default)
P_MIN = 0.75
#: every round may draft nothing (llama.cpp's default)
N_MIN = 0
#: the target's and the draft's threads: SSD's two cores
THREADS = 2
#: prompts the n-max sweep runs on
SWEEP_PROMPTS = 2
CONTEXT = 4096
RUN_TIMEOUT_S = 900
BUILD_HINT = "run `make llama-cpp` (builds llama.cpp from the llama-cpp-python sdist, about 6 minutes on 2 cores)"


def draft_gguf(draft_path: str) -> Path | None:
    """The draft's GGUF file: the path itself, the file its converted folder came from, or its export
    (``make draft-gguf``, :func:`spec_core.gguf_export.exported_path`)."""
    from benchmarks.llama_cpp_mode import target_gguf
    from spec_core.gguf_export import exported_path

    found = target_gguf(draft_path)
    if found is not None:
        return found
    exported = exported_path(Path(draft_path).resolve())
    return exported if exported.is_file() else None


def unavailable_reason(target_path: str, draft_path: str | None) -> str | None:
    """Why ``llama-cpp-spec`` cannot run here (``None``: it can)."""
    from benchmarks.llama_cpp_mode import target_gguf

    if binary(SPEC_BINARY) is None:
        return f"{SPEC_BINARY} is not built; {BUILD_HINT}"
    if target_gguf(target_path) is None:
        return f"no GGUF file known for the target {target_path} (pass --target FILE.gguf)"
    if draft_path is None or draft_gguf(draft_path) is None:
        return (f"no GGUF file known for the draft {draft_path} (pass --draft FILE.gguf, or export an HF draft "
                f"with `make draft-gguf`)")
    return None


def sampling_flags(params: SamplingParams) -> list[str]:
    """llama.cpp's sampler set as ours: greedy at T = 0, else temperature, top-k, top-p and nothing else."""
    if params.temperature == 0:
        flags = ["--temp", "0", "--top-k", "1"]
    else:
        flags = ["--temp", str(params.temperature), "--top-k", str(params.top_k or 0), "--top-p",
                 str(params.top_p), "--min-p", "0"]
    flags += ["--repeat-penalty", "1.0"] + (["--seed", str(params.seed)] if params.seed is not None else [])
    return flags + (["--ignore-eos"] if params.ignore_eos else [])


@dataclass
class LlamaCppSpec:
    """Runs ``llama-speculative-simple`` on one pair; remembers the n-max sweep and the chosen n-max."""

    binary: Path
    target: Path
    draft: Path
    threads: int = THREADS
    n_max: int = N_MAX_SWEEP[0]
    sweep: dict[int, float] = field(default_factory=dict)  #: n-max → decode tok/s while sweeping

    def command(self, prompt: str, params: SamplingParams, n_max: int) -> list[str]:
        t = str(self.threads)
        return [str(self.binary), "-m", str(self.target), "-md", str(self.draft), "--spec-type", "draft-simple",
                "--spec-draft-n-max", str(n_max), "--spec-draft-n-min", str(N_MIN), "--spec-draft-p-min",
                str(P_MIN), "-t", t, "-tb", t, "-td", t, "-tbd", t, "-c", str(CONTEXT),
                "-n", str(params.max_new_tokens), *sampling_flags(params), "--no-escape", "-p", prompt]

    def generate(self, prompt: str, params: SamplingParams, n_max: int | None = None) -> SpecTimings:
        """One request; llama.cpp's own timings (``LlamaCppOutputError`` when the run fails or prints nothing
        parsable)."""
        cmd = self.command(prompt, params, self.n_max if n_max is None else n_max)
        proc = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=RUN_TIMEOUT_S)
        out = proc.stdout + "\n" + proc.stderr
        if proc.returncode != 0:
            raise LlamaCppOutputError(f"{self.binary.name} exited with status {proc.returncode}:\n"
                                      + "\n".join(out.strip().splitlines()[-15:]))
        return parse_spec_output(out)

    def tune(self, prompts: list[str], max_new_tokens: int, ignore_eos: bool) -> int:
        """Sweep n-max greedily over the first :data:`SWEEP_PROMPTS` prompts; keep and return the fastest."""
        params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=ignore_eos)
        for n in N_MAX_SWEEP:
            runs = [self.generate(p, params, n) for p in prompts[:SWEEP_PROMPTS]]
            self.sweep[n] = sum(r.generated for r in runs) / sum(r.decode_s for r in runs)
        self.n_max = max(self.sweep, key=self.sweep.__getitem__)
        logger.info("llama-cpp-spec: n-max %d (%s tok/s while sweeping)", self.n_max,
                    ", ".join(f"{n}: {v:.1f}" for n, v in self.sweep.items()))
        return self.n_max

    def record(self) -> dict:
        """What the row ran: the binary and its build, the GGUF files, the speculation settings, the threads."""
        return {"binary": str(self.binary), "build": read_record(), "target_gguf": str(self.target),
                "draft_gguf": str(self.draft), "spec_type": "draft-simple", "n_max": self.n_max,
                "n_max_sweep": {str(n): round(v, 3) for n, v in self.sweep.items()}, "p_min": P_MIN, "n_min": N_MIN,
                "threads": self.threads, "draft_threads": self.threads, "prompt": "text, tokenized by llama.cpp"}


def from_paths(target_path: str, draft_path: str) -> LlamaCppSpec:
    """The runner for a pair :func:`unavailable_reason` passed."""
    from benchmarks.llama_cpp_mode import target_gguf

    return LlamaCppSpec(binary(SPEC_BINARY), target_gguf(target_path), draft_gguf(draft_path))


def spec_stats(t: SpecTimings) -> tuple[DecodeStats, float]:
    """One run's stats in our terms, and its time to first token.

    llama.cpp times its whole decode loop, the first token's step included; our decode time excludes the first
    token, so it is the loop's mean time per token times the tokens after the first, and the decode rate is
    llama.cpp's printed one. Rounds are target verifications (:attr:`SpecTimings.rounds`); the first token comes
    after the prompt's encoding and one mean round."""
    s = DecodeStats()
    s.num_generated, s.prefill_s = t.generated, t.encode_s
    s.decode_s = s.verify_s = t.decode_s * (t.generated - 1) / t.generated
    s.num_rounds, s.num_round_tokens = t.rounds, t.generated
    s.num_drafted, s.num_accepted = t.drafted, t.accepted
    return s, t.encode_s + t.decode_s / t.rounds
