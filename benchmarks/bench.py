"""``ssd bench``: modes side by side on the same prompts, interleaved prompt by prompt, with repeats.

Metric definitions are those of :mod:`spec_core.metrics`: decode tokens/s = Σ(generated − 1) ÷ Σ decode time over
all runs of a mode (model load, process start and prefill excluded). Per-run tokens/s are also reported as a median
with min/max, since this machine is noisy.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import logging
import os
import platform
import resource
import statistics
import sys
from dataclasses import asdict, dataclass

import torch

from spec_core.config import ModelConfig, SamplingParams
from spec_core.metrics import DecodeStats
from spec_core.models import set_threads
from spec_core.prompts import humaneval_prompts, read_prompt_file
from verifier_service.api import RUNTIME, GenerationResult, Generator

logger = logging.getLogger(__name__)

BENCH_MODES = ("ar", "sd", "ssd", "ssd-service", "hf-generate", "hf-assisted", "hf-assisted-tuned", "ar-2t", "sd-2t",
               "hf-generate-2t", "llama-cpp", "llama-cpp-2t")
#: Equal-hardware modes: the target (and SD's draft) get both cores, as SSD's two processes do.
TWO_THREAD_MODES = {"ar-2t": "ar", "sd-2t": "sd", "hf-generate-2t": "hf-generate"}
#: The peer, AR through llama-cpp-python on the target's GGUF (an optional extra), on 1 and on 2 threads.
LLAMA_CPP_MODES = {"llama-cpp": 1, "llama-cpp-2t": 2}


@dataclass(frozen=True, slots=True)
class BenchSettings:
    modes: tuple[str, ...]
    num_prompts: int
    max_new_tokens: int
    k: int
    repeats: int
    temperatures: tuple[float, ...]
    prompts_file: str | None
    ignore_eos: bool
    target_threads: int
    concurrency: tuple[int, ...] = (1,)
    budget: int = 12
    saguaro_c: float = 1.0
    sweep: tuple[str, ...] = ()
    sd_k: int | None = None  # SD's own K (default: k), so each mode can run at its best K

    @staticmethod
    def from_args(args: argparse.Namespace) -> BenchSettings:
        modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
        unknown = [m for m in modes if m not in BENCH_MODES]
        if unknown:
            raise ValueError(f"unknown bench mode(s) {', '.join(unknown)}; available: {', '.join(BENCH_MODES)}")
        try:
            temps = tuple(float(t) for t in args.temperatures.split(","))
        except ValueError:
            raise ValueError(f"--temperatures must be comma-separated numbers, got {args.temperatures!r}") from None
        num_prompts, max_new = args.num_prompts, args.max_new_tokens
        if args.quick:
            num_prompts, max_new = min(num_prompts, 3), min(max_new, 16)
        if num_prompts <= 0 or max_new <= 0 or args.repeats <= 0:
            raise ValueError("--num-prompts, --max-new-tokens and --repeats must be > 0")
        try:
            conc = tuple(int(c) for c in str(getattr(args, "concurrency", "1")).split(","))
        except ValueError:
            raise ValueError(f"--concurrency must be comma-separated integers, got {args.concurrency!r}") from None
        if any(c < 1 for c in conc):
            raise ValueError("--concurrency values must be >= 1")
        sweep = tuple(d.strip() for d in (getattr(args, "sweep", None) or "").split(",") if d.strip())
        bad = [d for d in sweep if d not in ("k", "budget", "c")]
        if bad:
            raise ValueError(f"--sweep takes k, budget and/or c, got {', '.join(bad)}")
        return BenchSettings(modes, num_prompts, max_new, args.k, args.repeats, temps, args.prompts,
                             args.ignore_eos, args.target_threads, concurrency=conc,
                             budget=getattr(args, "budget", 12),
                             saguaro_c=getattr(args, "saguaro_c", 1.0), sweep=sweep, sd_k=getattr(args, "sd_k", None))


def hardware_info() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "logical_cores": os.cpu_count(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    idx = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[idx]


def _itls(result: GenerationResult) -> list[float]:
    """Inter-token latencies: gaps between consecutive emissions (tokens of one round share a timestamp)."""
    times = result.emit_times
    return [b - a for a, b in zip(times, times[1:])]


@dataclass(slots=True)
class ModeRuns:
    stats: DecodeStats
    per_run_tps: list[float]
    ttfts: list[float]
    itls: list[float]
    outputs: dict[tuple[int, int], list[int]]

    @staticmethod
    def empty() -> ModeRuns:
        return ModeRuns(DecodeStats(), [], [], [], {})


def _summarise(mode: str, temp: float, runs: ModeRuns, reference: dict[tuple[int, int], list[int]] | None,
               ssd_extra: list[dict] | None = None) -> dict:
    s = runs.stats
    matches = None
    if temp == 0 and reference is not None:
        matches = all(runs.outputs[key] == reference[key] for key in runs.outputs)
    tps = runs.per_run_tps
    return {
        "mode": mode,
        "runtime": runtime_of(mode),
        "concurrency": 1,
        "temperature": temp,
        "tokens_per_s": s.tokens_per_s,
        "tokens_per_s_median_run": statistics.median(tps) if tps else None,
        "tokens_per_s_min_run": min(tps) if tps else None,
        "tokens_per_s_max_run": max(tps) if tps else None,
        "ttft_s_p50": _percentile(runs.ttfts, 50),
        "itl_s_p50": _percentile(runs.itls, 50),
        "itl_s_p99": _percentile(runs.itls, 99),
        "mean_tokens_per_round": s.mean_tokens_per_round if not _is_ar(mode) else 1.0,
        "batching": "batch 1" if mode.startswith(("hf", "llama")) else None,
        "target_threads": 2 if mode in TWO_THREAD_MODES or LLAMA_CPP_MODES.get(mode) == 2 else None,
        "acceptance_rate": s.acceptance_rate,
        "acceptance_by_position": s.acceptance_by_position() if not _is_ar(mode) else None,
        "cache_hit_rate": _mean([e["cache_hit_rate"] for e in ssd_extra or [] if e["cache_hit_rate"] is not None]),
        "verifier_idle_fraction": _mean([e["verifier_idle_fraction"] for e in ssd_extra or []
                                         if e["verifier_idle_fraction"] is not None]),
        "link_bytes_per_round": _mean([e["link_bytes_per_round"] for e in ssd_extra or []
                                       if e.get("link_bytes_per_round") is not None]),
        "verify_s_per_round": s.verify_s / s.num_rounds if s.num_rounds else None,
        "draft_s_per_round": s.draft_s / s.num_rounds if s.num_rounds and not _is_ar(mode) else None,
        "num_runs": len(tps),
        "num_generated": s.num_generated,
        "matches_target_greedy": matches,
        "peak_rss_mb_process": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def runtime_of(mode: str) -> str:
    """Which runtime a mode runs on: ours (every AR, SD and SSD mode: the one verifier engine) or a peer's."""
    if mode.startswith("hf"):
        return "transformers"
    if mode in LLAMA_CPP_MODES:
        return "llama.cpp"
    return RUNTIME + (" over gRPC" if mode == "ssd-service" else "")


def _is_ar(mode: str) -> bool:
    return mode in ("ar", "ar-2t") or mode in LLAMA_CPP_MODES


def skipped_row(mode: str, temp: float, reason: str) -> dict:
    """A mode that could not run here: every field of a result row (those of :func:`_summarise`), empty, and why."""
    row = dict.fromkeys(_summarise(mode, temp, ModeRuns.empty(), None))
    return {**row, "mode": mode, "runtime": runtime_of(mode), "concurrency": 1, "temperature": temp, "num_runs": 0,
            "num_generated": 0, "skipped": reason}


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _prompts(settings: BenchSettings) -> list[str]:
    if settings.prompts_file:
        return [r["prompt"] for r in read_prompt_file(settings.prompts_file)][: settings.num_prompts]
    return humaneval_prompts(settings.num_prompts)


class ModeRunner:
    """Runs one request in any bench mode; every mode shares the loaded models and the tokenised prompt."""

    def __init__(self, settings: BenchSettings, target: ModelConfig, draft: ModelConfig | None) -> None:
        self.gen = Generator(target, draft, k=settings.k)
        self.all_cores = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
        self.threads = settings.target_threads
        self.k = settings.k
        self.sd_k = settings.sd_k or settings.k
        self.hf: dict[str, object] = {}
        self.assistant_tokens: int | None = None
        modes = set(settings.modes)
        #: modes that cannot run here, with the reason (reported as skipped rows)
        self.skipped: dict[str, str] = {}
        self.llama_cpp = None
        if modes & set(LLAMA_CPP_MODES):
            from benchmarks.llama_cpp_mode import LlamaCppAR, target_gguf, unavailable_reason

            reason = unavailable_reason(target.path)
            if reason is None:
                self.llama_cpp = LlamaCppAR(target_gguf(target.path))
            else:
                for m in modes & set(LLAMA_CPP_MODES):
                    self.skipped[m] = reason
                sys.stderr.write(f"bench: skipping {', '.join(sorted(modes & set(LLAMA_CPP_MODES)))}: {reason}\n")
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

            self.service = ServiceMode(target.path, draft.path, settings.k)
        self.local_ssd = None
        if "ssd" in settings.modes:
            from cluster.local_ssd import LocalSSD, LocalSSDConfig
            from spec_core.config import SSDConfig

            pair = self.gen.pair
            from spec_core.fanout import FanoutConfig

            ssd_cfg = SSDConfig(k=settings.k, fanout=FanoutConfig(budget=settings.budget), saguaro_c=settings.saguaro_c)
            self.local_ssd = LocalSSD(pair.target, LocalSSDConfig(draft.path, ssd_cfg),
                                      eos_ids=pair.eos_ids).__enter__()
        self.ssd_extra: dict[str, list[dict]] = {"ssd": [], "ssd-service": []}

    def close(self) -> None:
        if self.local_ssd is not None:
            self.local_ssd.__exit__(None, None, None)
        if self.service is not None:
            self.service.close()

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
        k = self.sd_k if mode == "sd" else self.k
        return run_concurrent(self.gen.pair, mode, ids, params, k, c, self.local_ssd)

    def run(self, mode: str, prompt: str, params: SamplingParams) -> GenerationResult:
        if mode in TWO_THREAD_MODES:
            return self._two_threads(TWO_THREAD_MODES[mode], prompt, params)
        if mode in LLAMA_CPP_MODES:
            return self._llama_cpp(mode, prompt, params)
        if mode == "ssd-service":
            self.service.configure(adaptive=False)
            with self.unpinned():
                result, extra = self.service.run(prompt, params)
            self.ssd_extra[mode].append(extra)
            return result
        if mode == "ssd":
            from cluster.local_ssd import generate_ssd

            ids = self.gen.encode(prompt)
            seq, stats, extra = generate_ssd(self.local_ssd, ids, params)
            self.ssd_extra[mode].append(extra)
            return GenerationResult("ssd", ids, list(seq.output_ids), "", seq.finish_reason, stats, stats.prefill_s,
                                    list(seq.emit_times))
        if mode not in self.hf:
            return self.gen.generate(prompt, params, mode=mode, k=self.sd_k if mode == "sd" else None)
        return self._hf(mode, prompt, params)

    def _two_threads(self, mode: str, prompt: str, params: SamplingParams) -> GenerationResult:
        """Run ``mode`` with torch on 2 threads over every core this process may use (equal hardware)."""
        pinned = os.sched_getaffinity(0) if self.all_cores is not None else None
        try:
            if self.all_cores is not None:
                os.sched_setaffinity(0, self.all_cores)
            torch.set_num_threads(2)
            res = (self.gen.generate(prompt, params, mode=mode, k=self.sd_k if mode == "sd" else None)
                   if mode not in self.hf else self._hf(mode, prompt, params))
        finally:
            torch.set_num_threads(self.threads)
            if pinned is not None:
                os.sched_setaffinity(0, pinned)
        return res

    def _llama_cpp(self, mode: str, prompt: str, params: SamplingParams) -> GenerationResult:
        """The peer on 1 thread (pinned as our target is) or on 2 (every core this process may use)."""
        threads = LLAMA_CPP_MODES[mode]
        ids = self.gen.encode(prompt)
        ctx = self.unpinned() if threads > 1 else contextlib.nullcontext()
        with ctx:
            tokens, stats, ttft, times = self.llama_cpp.generate(ids, params, self.gen.pair.eos_ids, threads)
        return GenerationResult(mode=mode, prompt_token_ids=ids, token_ids=tokens, text="", finish_reason=None,
                                stats=stats, ttft_s=ttft, emit_times=times)

    def _hf(self, mode: str, prompt: str, params: SamplingParams) -> GenerationResult:
        ids = self.gen.encode(prompt)
        tokens, stats, ttft = self.hf[mode].generate(ids, params)
        return GenerationResult(mode=mode, prompt_token_ids=ids, token_ids=tokens, text="", finish_reason=None,
                                stats=stats, ttft_s=ttft, emit_times=[])


def progress(total: int, desc: str):
    """A progress bar on stderr (tqdm; plain lines when stderr is not a terminal)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=f"bench {desc}", unit="run", file=sys.stderr, mininterval=1.0,
                dynamic_ncols=True, leave=True)


def run_bench(settings: BenchSettings, target: ModelConfig, draft: ModelConfig | None,
              summary: bool = True, on_block=None) -> dict:
    """Run every (mode, temperature) on every prompt, interleaved; return the report dict. ``on_block(report)``
    gets the report so far after each (temperature, concurrency) block."""
    set_threads(settings.target_threads)
    runner = ModeRunner(settings, target, draft)
    try:
        return _run_all(settings, runner, target, draft, summary, on_block)
    finally:
        runner.close()


def _run_all(settings: BenchSettings, runner: ModeRunner, target: ModelConfig, draft: ModelConfig | None,
             summary: bool = True, on_block=None) -> dict:
    gen = runner.gen
    prompts = _prompts(settings)
    modes = tuple(m for m in settings.modes if m not in runner.skipped)
    for mode in modes:  # warm-up
        runner.run(mode, prompts[0], SamplingParams(max_new_tokens=4))
    runner.tune_assistant(prompts, settings)
    results = []
    for temp in settings.temperatures:
        runs = {m: ModeRuns.empty() for m in modes}
        runner.ssd_extra = {"ssd": [], "ssd-service": []}
        reference: dict[tuple[int, int], list[int]] = {}
        total = len(prompts) * settings.repeats * len(modes) if 1 in settings.concurrency else 0
        with progress(total, f"T={temp} concurrency 1") as bar:
            for pi, prompt in enumerate(prompts if total else []):
                for rep in range(settings.repeats):
                    order = modes[rep % len(modes):] + modes[: rep % len(modes)]
                    for mode in order:
                        params = SamplingParams(temperature=temp, max_new_tokens=settings.max_new_tokens,
                                                ignore_eos=settings.ignore_eos, seed=1000 * pi + rep)
                        res = runner.run(mode, prompt, params)
                        r = runs[mode]
                        r.stats.merge(res.stats)
                        if res.stats.tokens_per_s:
                            r.per_run_tps.append(res.stats.tokens_per_s)
                        r.ttfts.append(res.ttft_s)
                        r.itls.extend(_itls(res))
                        r.outputs[(pi, rep)] = res.token_ids
                        bar.update()
        if temp == 0:
            if "ar" in runs and runs["ar"].outputs:
                reference = runs["ar"].outputs
            else:
                reference = {(pi, rep): gen.generate(p, SamplingParams(max_new_tokens=settings.max_new_tokens,
                                                                       ignore_eos=settings.ignore_eos), mode="ar").token_ids
                             for pi, p in enumerate(prompts) for rep in range(settings.repeats)}
        if 1 in settings.concurrency:
            results.extend(_summarise(m, temp, runs[m], reference or None, runner.ssd_extra.get(m))
                           if m in runs else skipped_row(m, temp, runner.skipped[m]) for m in settings.modes)
            if on_block is not None:
                on_block(_report(settings, runner, target, draft, results))
        for c in (c for c in settings.concurrency if c > 1):
            results.extend(_run_concurrency(settings, runner, prompts, temp, c, reference))
            if on_block is not None:
                on_block(_report(settings, runner, target, draft, results))
    report = _report(settings, runner, target, draft, results)
    if summary:
        print_summary(report)
    return report


def _report(settings: BenchSettings, runner: ModeRunner, target: ModelConfig, draft: ModelConfig | None,
            results: list[dict]) -> dict:
    return {
        "hardware": hardware_info(),
        "settings": {**asdict(settings), "target": target.path, "draft": draft.path if draft else None,
                     "dtype": target.resolved_dtype, "device": target.device,
                     "hf_assisted_tuned_num_assistant_tokens": runner.assistant_tokens,
                     "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds")},
        "results": list(results),
    }


BATCHED_MODES = ("ar", "sd", "ssd", "ssd-service")


def _run_concurrency(settings: BenchSettings, runner: ModeRunner, prompts: list[str], temp: float, c: int,
                     reference: dict) -> list[dict]:
    """Every batched mode at concurrency ``c`` over all prompts (repeats rotate the mode order)."""
    modes = [m for m in settings.modes if m in BATCHED_MODES and m not in runner.skipped]
    acc: dict[str, list[dict]] = {m: [] for m in modes}
    with progress(settings.repeats * len(modes), f"T={temp} concurrency {c}") as bar:
        for rep in range(settings.repeats):
            params = [SamplingParams(temperature=temp, max_new_tokens=settings.max_new_tokens,
                                     ignore_eos=settings.ignore_eos, seed=1000 * pi + rep)
                      for pi in range(len(prompts))]
            for mode in modes[rep % len(modes):] + modes[: rep % len(modes)]:
                acc[mode].append(runner.run_concurrent(mode, prompts, params, c))
                bar.update()
    rows = []
    for mode, runs in acc.items():
        tps = [r["tokens_per_s"] for r in runs]
        itls = [x for r in runs for x in r["itls"]]
        matches = None
        if temp == 0 and reference:
            matches = all(r["outputs"][pi] == reference[(pi, 0)] for r in runs for pi in range(len(prompts)))
        rows.append({
            "mode": mode, "runtime": runtime_of(mode), "concurrency": c, "temperature": temp,
            "tokens_per_s": statistics.median(tps), "tokens_per_s_median_run": statistics.median(tps),
            "tokens_per_s_min_run": min(tps), "tokens_per_s_max_run": max(tps),
            "ttft_s_p50": _percentile([x for r in runs for x in r["ttfts"]], 50),
            "itl_s_p50": _percentile(itls, 50), "itl_s_p99": _percentile(itls, 99),
            "mean_tokens_per_round": _mean([r["mean_tokens_per_round"] for r in runs if r["mean_tokens_per_round"]]),
            "acceptance_rate": _mean([r["acceptance_rate"] for r in runs if r["acceptance_rate"] is not None]),
            "acceptance_by_position": None,
            "cache_hit_rate": _mean([r["cache_hit_rate"] for r in runs if r["cache_hit_rate"] is not None]),
            "verifier_idle_fraction": None, "link_bytes_per_round": None,
            "batching": (f"continuous batching, {c} in flight" + (", adaptive K" if mode != "ar" else "")
                         + (f", {c} streaming gRPC clients" if mode == "ssd-service" else "")),
            "mean_batch_k": _mean([r["mean_batch_k"] for r in runs if r.get("mean_batch_k") is not None]),
            "num_runs": len(runs),
            "num_generated": sum(r["num_generated"] for r in runs), "matches_target_greedy": matches,
            "peak_rss_mb_process": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        })
    return rows


def print_summary(report: dict) -> None:
    out = sys.stdout
    out.write(f"{'mode':<18}{'conc':>5}{'T':>5}{'tok/s':>10}{'x AR':>7}{'tok/round':>11}{'accept':>8}"
              f"{'hit':>6}{'greedy=AR':>11}\n")
    base = {(r["temperature"], r["concurrency"]): r["tokens_per_s"] for r in report["results"] if r["mode"] == "ar"}
    for r in report["results"]:
        if r.get("skipped"):
            out.write(f"{r['mode']:<18}{r['concurrency']:>5}{r['temperature']:>5.2f}  skipped: {r['skipped']}\n")
            continue
        b = base.get((r["temperature"], r["concurrency"]))
        ratio = r["tokens_per_s"] / b if b and r["tokens_per_s"] else None
        acc, hit = r["acceptance_rate"], r["cache_hit_rate"]
        out.write(
            f"{r['mode']:<18}{r['concurrency']:>5}{r['temperature']:>5.2f}{r['tokens_per_s'] or 0:>10.1f}"
            f"{(f'{ratio:.2f}' if ratio else '-'):>7}{r['mean_tokens_per_round'] or 0:>11.2f}"
            f"{(f'{acc:.2f}' if acc is not None else '-'):>8}{(f'{hit:.2f}' if hit is not None else '-'):>6}"
            f"{str(r['matches_target_greedy']):>11}\n"
        )
