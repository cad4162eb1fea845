"""Bench modes: their names and groups, which runtime each runs on, and :class:`ModeRunner`, which runs one request
in any of them.

Every mode shares one loaded target (and draft) and the tokenised prompt; the peers (transformers, llama.cpp), the
local two-process SSD and the gRPC service are set up only when a mode needs them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import TYPE_CHECKING

import torch

from spec_core.config import ModelConfig, SamplingParams
from spec_core.metrics import DecodeStats
from verifier_service.api import RUNTIME, GenerationResult, Generator

if TYPE_CHECKING:
    from benchmarks.bench import BenchSettings
    from spec_core.models import LoadedPair

logger = logging.getLogger(__name__)

BENCH_MODES = ("ar", "sd", "ssd", "ssd-chain", "ssd-coupled", "ssd-pipelined", "ssd-service", "hf-generate", "hf-assisted", "hf-assisted-tuned", "ar-2t", "sd-2t",
               "hf-generate-2t", "llama-cpp", "llama-cpp-2t", "llama-cpp-spec")
#: Equal-hardware modes: the target (and SD's draft) get both cores, as SSD's two processes do.
TWO_THREAD_MODES = {"ar-2t": "ar", "sd-2t": "sd", "hf-generate-2t": "hf-generate"}
#: The peer, AR on the target's GGUF through llama-cpp-python (an optional extra) or else llama.cpp's
#: llama-completion binary (`make llama-cpp`), on 1 and on 2 threads.
LLAMA_CPP_MODES = {"llama-cpp": 1, "llama-cpp-2t": 2}
#: The peer's own draft-model speculation, llama.cpp's binary on both cores (:mod:`benchmarks.llama_cpp_spec`).
LLAMA_CPP_SPEC = "llama-cpp-spec"

#: Modes that also run at concurrency > 1 (through the continuous-batching engine; ar-2t and sd-2t on both cores).
BATCHED_MODES = ("ar", "sd", "ssd", "ssd-chain", "ssd-coupled", "ssd-pipelined", "ssd-service", "ar-2t", "sd-2t")
#: The local two-process SSD modes: ``ssd`` with its candidate tree per outcome (``--tree``), ``ssd-chain`` with
#: one chain per outcome (the paper's SSD), on the same K and budget; ``ssd-coupled``: ``ssd`` with coupled sampling
#: (``EngineConfig.sampling``) whatever ``--sampling`` says, to compare the two rules side by side;
#: ``ssd-pipelined``: ``ssd`` whose run-ahead drafter always drafts during the verify (never the alternating
#: schedule, :mod:`verifier_service.run_ahead_schedule`), to show what the overlap itself gives.
LOCAL_SSD_MODES = ("ssd", "ssd-chain", "ssd-coupled", "ssd-pipelined")


def runtime_of(mode: str) -> str:
    """Which runtime a mode runs on: ours (every AR, SD and SSD mode: the one verifier engine) or a peer's."""
    if mode.startswith("hf"):
        return "transformers"
    if mode in LLAMA_CPP_MODES or mode == LLAMA_CPP_SPEC:
        return "llama.cpp"
    return RUNTIME + (" over gRPC" if mode == "ssd-service" else "")


def is_ar(mode: str) -> bool:
    return mode in ("ar", "ar-2t") or mode in LLAMA_CPP_MODES


class ModeRunner:
    """Runs one request in any bench mode; every mode shares the loaded models and the tokenised prompt."""

    def __init__(self, settings: BenchSettings, target: ModelConfig, draft: ModelConfig | None,
                 pair: LoadedPair | None = None) -> None:
        """``pair``: the models already loaded (``ssd bench --sweep`` loads them once for all its points)."""
        adaptive = settings.sd_adaptive
        self.gen = (Generator(target, draft, k=settings.k, adaptive=adaptive) if pair is None
                    else Generator.from_pair(pair, k=settings.k, adaptive=adaptive))
        self.all_cores = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
        self.threads = settings.target_threads
        self.k = settings.k
        self.sd_k = settings.sd_k or settings.k
        self.hf: dict[str, object] = {}
        self.assistant_tokens: int | None = None
        modes = set(settings.modes)
        #: modes that cannot run here, with the reason (reported as skipped rows)
        self.skipped: dict[str, str] = {}
        self.llama_cpp = self._llama_cpp_ar(modes, target)
        self.llama_cpp_spec = self._llama_cpp_spec_runner(modes, target, draft)
        if modes & {"hf-generate", "hf-generate-2t", "hf-assisted", "hf-assisted-tuned"}:
            from benchmarks.hf_baselines import HFGenerate

            if modes & {"hf-generate", "hf-generate-2t"}:
                self.hf["hf-generate"] = HFGenerate(target.path)
            if "hf-assisted" in modes:
                self.hf["hf-assisted"] = HFGenerate(target.path, draft.path if draft else None)
            if "hf-assisted-tuned" in modes:
                self.hf["hf-assisted-tuned"] = HFGenerate(target.path, draft.path if draft else None)

        # The service first: Ray's processes inherit this process's CPU affinity, which the local SSD pins to
        # one core below.
        self.service = None
        if "ssd-service" in settings.modes:
            from benchmarks.service_mode import ServiceMode

            self.service = ServiceMode(settings.service_config(target.path, draft.path, target.resolved_dtype,
                                                               draft.dtype))
        self.local_ssds = {m: self._local_ssd(m, settings, target, draft) for m in LOCAL_SSD_MODES if m in modes}
        self.local_ssd = self.local_ssds.get("ssd")
        self.ssd_extra: dict[str, list[dict]] = {m: [] for m in (*LOCAL_SSD_MODES, "ssd-service")}
        self.planners: dict[str, object] = {}

    def _skip(self, modes: set[str], reason: str) -> None:
        for m in modes:
            self.skipped[m] = reason
        sys.stderr.write(f"bench: skipping {', '.join(sorted(modes))}: {reason}\n")

    def _llama_cpp_ar(self, modes: set[str], target: ModelConfig):
        """The AR peer (llama-cpp-python, else llama.cpp's binary) when an llama-cpp AR mode is asked for."""
        if not modes & set(LLAMA_CPP_MODES):
            return None
        from benchmarks.llama_cpp_mode import make_ar, unavailable_reason

        reason = unavailable_reason(target.path)
        if reason is None:
            return make_ar(target.path)
        self._skip(modes & set(LLAMA_CPP_MODES), reason)
        return None

    def _llama_cpp_spec_runner(self, modes: set[str], target: ModelConfig, draft: ModelConfig | None):
        """llama.cpp's own speculation on the pair's GGUF files, when ``llama-cpp-spec`` is asked for."""
        if LLAMA_CPP_SPEC not in modes:
            return None
        from benchmarks.llama_cpp_spec import from_paths, unavailable_reason

        reason = unavailable_reason(target.path, draft.path if draft else None)
        if reason is None:
            return from_paths(target.path, draft.path)
        self._skip({LLAMA_CPP_SPEC}, reason)
        return None

    def row_extra(self, mode: str) -> dict:
        """What a peer's row ran beyond :func:`benchmarks.report.what_ran`: its binary or package and build,
        and for ``llama-cpp-spec`` the n-max sweep, p-min and threads."""
        peer = self.llama_cpp_spec if mode == LLAMA_CPP_SPEC else self.llama_cpp if mode in LLAMA_CPP_MODES else None
        return {"llama_cpp": peer.record()} if peer is not None else {}

    def _local_ssd(self, mode: str, settings: BenchSettings, target: ModelConfig, draft: ModelConfig):
        """A local two-process SSD for ``mode``, entered (closed by :meth:`close`)."""
        from cluster.local_ssd import LocalPlacement, LocalSSD

        pair = self.gen.pair
        config = settings.service_config(target.path, draft.path, target.resolved_dtype, draft.dtype, mode)
        place = LocalPlacement(draft_pad_rows=draft.pad_rows, draft_cpu_kernels=draft.cpu_kernels)
        return LocalSSD(pair.target, config, place, eos_ids=pair.eos_ids).__enter__()

    def close(self) -> None:
        for local in self.local_ssds.values():
            local.__exit__(None, None, None)
        if self.service is not None:
            self.service.close()

    def tune_llama_cpp_spec(self, prompts: list[str], settings: BenchSettings) -> None:
        """llama-cpp-spec: sweep its n-max on the first prompts (both cores, as its measured runs)."""
        if self.llama_cpp_spec is not None:
            with self.unpinned():
                self.llama_cpp_spec.tune(prompts, settings.max_new_tokens, settings.ignore_eos)

    def tune_assistant(self, prompts: list[str], settings: BenchSettings) -> None:
        """hf-assisted-tuned: pick num_assistant_tokens in 1..8 by tokens/s on the first two prompts."""
        hf = self.hf.get("hf-assisted-tuned")
        if hf is None:
            return
        params = SamplingParams(max_new_tokens=settings.max_new_tokens, ignore_eos=settings.ignore_eos)
        best, best_tps = 1, -1.0
        for n in range(1, 9):
            hf.set_assistant_tokens(n)
            stats = DecodeStats()
            for p in prompts[:2]:
                stats.merge(hf.generate(self.gen.encode(p), params)[1])
            if (stats.tokens_per_s or 0) > best_tps:
                best, best_tps = n, stats.tokens_per_s or 0
        hf.set_assistant_tokens(best)
        self.assistant_tokens = best
        logger.info("hf-assisted-tuned: num_assistant_tokens=%d (%.1f tok/s while tuning)", best, best_tps)

    @contextlib.contextmanager
    def unpinned(self):
        """This process is only the client of ``ssd-service``: unpin it from the verifier's core (the local ssd
        mode pins it there), or the client would compete with the verifier actor for one vCPU."""
        pinned = os.sched_getaffinity(0) if self.all_cores is not None else None
        try:
            if pinned is not None:
                os.sched_setaffinity(0, self.all_cores)
            yield
        finally:
            if pinned is not None:
                os.sched_setaffinity(0, pinned)

    def run_concurrent(self, mode: str, prompts: list[str], params: list[SamplingParams], c: int) -> dict:
        from benchmarks.concurrent import run_concurrent

        if mode == "ssd-service":
            with self.unpinned():
                return self.service.run_concurrent(prompts, params, c)
        ids = [self.gen.encode(p) for p in prompts]
        base = TWO_THREAD_MODES.get(mode, mode)
        k = self.sd_k if base == "sd" else self.k
        with self.two_threads() if mode in TWO_THREAD_MODES else contextlib.nullcontext():
            planner = self._planner(mode, k) if base != "ar" else None
            return run_concurrent(self.gen.pair, base, ids, params, k, c, self.local_ssds.get(mode), planner)

    def _planner(self, mode: str, k: int):
        """The mode's one adaptive-K planner for the whole bench (``ssd serve`` keeps one per engine): a local SSD
        mode's own engine planner where it has one, else one made on first use."""
        if mode not in self.planners:
            from verifier_service.adaptive import AdaptiveK

            local = self.local_ssds.get(mode)
            self.planners[mode] = (local.engine.adaptive if local is not None else None) or AdaptiveK(k_max=k)
        return self.planners[mode]

    def run(self, mode: str, prompt: str, params: SamplingParams) -> GenerationResult:
        if mode in TWO_THREAD_MODES:
            return self._two_threads(TWO_THREAD_MODES[mode], prompt, params)
        if mode in LLAMA_CPP_MODES:
            return self._llama_cpp(mode, prompt, params)
        if mode == LLAMA_CPP_SPEC:
            return self._llama_cpp_spec(prompt, params)
        if mode == "ssd-service":
            self.service.configure(adaptive=False)
            with self.unpinned():
                result, extra = self.service.run(prompt, params)
            self.ssd_extra[mode].append(extra)
            return result
        if mode in LOCAL_SSD_MODES:
            from cluster.local_ssd import generate_ssd

            ids = self.gen.encode(prompt)
            seq, stats, extra = generate_ssd(self.local_ssds[mode], ids, params)
            self.ssd_extra[mode].append(extra)
            return GenerationResult(mode, ids, list(seq.output_ids), "", seq.finish_reason, stats, stats.prefill_s,
                                    list(seq.emit_times))
        if mode not in self.hf:
            return self.gen.generate(prompt, params, mode=mode, k=self.sd_k if mode == "sd" else None)
        return self._hf(mode, prompt, params)

    @contextlib.contextmanager
    def two_threads(self):
        """Torch on 2 threads over every core this process may use (equal hardware with SSD's two processes)."""
        pinned = os.sched_getaffinity(0) if self.all_cores is not None else None
        try:
            if self.all_cores is not None:
                os.sched_setaffinity(0, self.all_cores)
            torch.set_num_threads(2)
            yield
        finally:
            torch.set_num_threads(self.threads)
            if pinned is not None:
                os.sched_setaffinity(0, pinned)

    def _two_threads(self, mode: str, prompt: str, params: SamplingParams) -> GenerationResult:
        with self.two_threads():
            return (self.gen.generate(prompt, params, mode=mode, k=self.sd_k if mode == "sd" else None)
                    if mode not in self.hf else self._hf(mode, prompt, params))

    def _llama_cpp(self, mode: str, prompt: str, params: SamplingParams) -> GenerationResult:
        """The peer on 1 thread (pinned as our target is) or on 2 (every core this process may use)."""
        threads = LLAMA_CPP_MODES[mode]
        ids = self.gen.encode(prompt)
        ctx = self.unpinned() if threads > 1 else contextlib.nullcontext()
        with ctx:
            if self.llama_cpp.takes_text:
                (stats, ttft), tokens, times = self.llama_cpp.generate(prompt, params, threads), [], []
            else:
                tokens, stats, ttft, times = self.llama_cpp.generate(ids, params, self.gen.pair.eos_ids, threads)
        return GenerationResult(mode=mode, prompt_token_ids=ids, token_ids=tokens, text="", finish_reason=None,
                                stats=stats, ttft_s=ttft, emit_times=times)

    def _llama_cpp_spec(self, prompt: str, params: SamplingParams) -> GenerationResult:
        """One request through llama.cpp's speculation on both cores; its text output is not compared."""
        from benchmarks.llama_cpp_spec import spec_stats

        ids = self.gen.encode(prompt)
        with self.unpinned():
            timings = self.llama_cpp_spec.generate(prompt, params)
        if timings.prompt_tokens != len(ids):
            logger.info("llama-cpp-spec: llama.cpp tokenized the prompt to %d tokens, ours to %d",
                        timings.prompt_tokens, len(ids))
        stats, ttft = spec_stats(timings)
        return GenerationResult(mode=LLAMA_CPP_SPEC, prompt_token_ids=ids, token_ids=[], text="", finish_reason=None,
                                stats=stats, ttft_s=ttft, emit_times=[])

    def _hf(self, mode: str, prompt: str, params: SamplingParams) -> GenerationResult:
        ids = self.gen.encode(prompt)
        tokens, stats, ttft = self.hf[mode].generate(ids, params)
        return GenerationResult(mode=mode, prompt_token_ids=ids, token_ids=tokens, text="", finish_reason=None,
                                stats=stats, ttft_s=ttft, emit_times=[])
