"""Bench results: per-mode tallies, the result rows (one per mode, temperature and concurrency), the report dict
written as JSON, and the summary table printed after a run.

Metric definitions are those of :mod:`spec_core.metrics`; see :mod:`benchmarks.bench` for how the runs are made.
"""

from __future__ import annotations

import datetime as dt
import os
import platform
import resource
import statistics
import sys
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import torch

from benchmarks.modes import LLAMA_CPP_MODES, LLAMA_CPP_SPEC, TWO_THREAD_MODES, is_ar, runtime_of
from spec_core.config import ModelConfig
from spec_core.metrics import DecodeStats
from verifier_service.api import RUNTIME, GenerationResult

if TYPE_CHECKING:
    from benchmarks.bench import BenchSettings


def hardware_info() -> dict:
    from spec_core.hardware import cpu_class, cpu_name

    return {
        "cpu": cpu_name(),
        "cpu_class": cpu_class(),
        "logical_cores": os.cpu_count(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def percentile(values: list[float], q: float) -> float | None:
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
    #: tokens/s of each run, by (prompt index, repeat)
    per_run_tps: dict[tuple[int, int], float]
    ttfts: list[float]
    itls: list[float]
    #: token ids by run; none for a peer's binary, which prints text (its greedy output is not compared)
    outputs: dict[tuple[int, int], list[int]]

    @staticmethod
    def empty() -> ModeRuns:
        return ModeRuns(DecodeStats(), {}, [], [], {})

    def add(self, key: tuple[int, int], result: GenerationResult) -> None:
        """Tally one run (``key``: prompt index, repeat)."""
        self.stats.merge(result.stats)
        if result.stats.tokens_per_s:
            self.per_run_tps[key] = result.stats.tokens_per_s
        self.ttfts.append(result.ttft_s)
        self.itls.extend(_itls(result))
        if result.token_ids:
            self.outputs[key] = result.token_ids


def summarise(mode: str, temp: float, runs: ModeRuns, reference: dict[tuple[int, int], list[int]] | None,
              ssd_extra: list[dict] | None = None) -> dict:
    s = runs.stats
    matches = None
    if temp == 0 and reference is not None and runs.outputs:
        matches = all(runs.outputs[key] == reference[key] for key in runs.outputs)
    # llama.cpp's speculation reports totals only: no per-round time split, per-position acceptance or plain rounds
    split = not is_ar(mode) and mode != LLAMA_CPP_SPEC
    tps = list(runs.per_run_tps.values())
    return {
        "mode": mode,
        "runtime": runtime_of(mode),
        "concurrency": 1,
        "temperature": temp,
        "tokens_per_s": s.tokens_per_s,
        "tokens_per_s_median_run": statistics.median(tps) if tps else None,
        "tokens_per_s_min_run": min(tps) if tps else None,
        "tokens_per_s_max_run": max(tps) if tps else None,
        "runs": [{"prompt": pi, "repeat": rep, "tokens_per_s": v} for (pi, rep), v in sorted(runs.per_run_tps.items())],
        "ttft_s_p50": percentile(runs.ttfts, 50),
        "itl_s_p50": percentile(runs.itls, 50),
        "itl_s_p99": percentile(runs.itls, 99),
        "mean_tokens_per_round": s.mean_tokens_per_round if not is_ar(mode) else 1.0,
        # rounds decoded without speculating (adaptive K = 0: speculation did not pay), as a share of all rounds
        "plain_round_fraction": s.plain_round_fraction if split else None,
        "batching": "batch 1" if mode.startswith(("hf", "llama")) else None,
        "target_threads": 2 if _two_threads(mode) else None,
        "acceptance_rate": s.acceptance_rate,
        "acceptance_by_position": s.acceptance_by_position() if split else None,
        **_ssd_fields(ssd_extra or []),
        "verify_s_per_round": s.verify_s / s.num_rounds if s.num_rounds and mode != LLAMA_CPP_SPEC else None,
        "draft_s_per_round": s.draft_s / s.num_rounds if s.num_rounds and split else None,
        "num_runs": len(tps),
        "num_generated": s.num_generated,
        "matches_target_greedy": matches,
        "peak_rss_mb_process": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def _ssd_fields(extra: list[dict]) -> dict:
    """The SSD rows' own fields, over the per-request reports of :func:`cluster.local_ssd.generate_ssd` (or the
    service's): each a mean over the requests that report it, or None."""

    def avg(key: str) -> float | None:
        return mean([e[key] for e in extra if e.get(key) is not None])

    def total(key: str) -> int | None:
        return sum(e.get(key, 0) for e in extra) if extra else None

    return {
        "cache_hit_rate": avg("cache_hit_rate"),
        "verifier_idle_fraction": avg("verifier_idle_fraction"),
        "link_bytes_per_round": avg("link_bytes_per_round"),
        "mean_tree_nodes": avg("mean_tree_nodes"),
        "off_spine_rate": avg("off_spine_rate"),
        # tokens per SSD round accepted on the tree's prompt-lookup branch
        "lookup_tokens_per_round": avg("lookup_tokens_per_round"),
        # SSD rounds served by a bundle the verifier waited for (the fast backup's short wait), of all rounds
        "bundle_wait_rate": avg("bundle_wait_rate"),
        # branches per pre-drafted bundle: the fan-out budget, or less where the drafter fitted it to the verify
        "branches_per_bundle": avg("branches_per_bundle"),
        # steps that ran on the drafter's core too, every request plain (verifier_service.core_lending)
        "lent_steps": total("lent_steps"),
        # run-ahead: speculating steps on both cores while the drafter idled, and the rounds in the alternating
        # schedule, as a share of all (verifier_service.run_ahead_schedule)
        "idle_lent_steps": total("idle_lent_steps"),
        "alternating_round_fraction": avg("alternating_round_fraction"),
        "ssd_strategy": next((e["strategy"] for e in extra if e.get("strategy")), None),
        # run-ahead: the share of the request's time (prefill and decode) the drafter spent in its forwards
        "drafter_busy_fraction": avg("drafter_busy_fraction"),
    }


def _two_threads(mode: str) -> bool:
    """Whether a single-process row ran its target on 2 threads."""
    return mode in TWO_THREAD_MODES or LLAMA_CPP_MODES.get(mode) == 2 or mode == LLAMA_CPP_SPEC


def skipped_row(mode: str, temp: float, reason: str) -> dict:
    """A mode that could not run here: every field of a result row (those of :func:`summarise`), empty, and why."""
    row = dict.fromkeys(summarise(mode, temp, ModeRuns.empty(), None))
    return {**row, "mode": mode, "runtime": runtime_of(mode), "concurrency": 1, "temperature": temp, "num_runs": 0,
            "num_generated": 0, "skipped": reason}


def mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def build_report(settings: BenchSettings, target: ModelConfig, draft: ModelConfig | None, results: list[dict],
                 assistant_tokens: int | None) -> dict:
    """The report dict: hardware, settings (with the models, and hf-assisted-tuned's pick) and the result rows."""
    return {
        "hardware": hardware_info(),
        "settings": {**asdict(settings), "target": target.path, "draft": draft.path if draft else None,
                     "draft_dtype": draft.dtype if draft else None,
                     "dtype": target.resolved_dtype, "device": target.device, "pad_rows": target.pad_rows,
                     "cpu_kernels": target.cpu_kernels,
                     "hf_assisted_tuned_num_assistant_tokens": assistant_tokens,
                     "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds")},
        "results": [{**r, **what_ran(r["mode"], settings, target, draft)} for r in with_paired_ratios(results)],
    }


def what_ran(mode: str, settings: BenchSettings, target: ModelConfig, draft: ModelConfig | None) -> dict:
    """What a row ran: the models' dtypes, the cores its processes had, the drafter's link and core lending.
    llama.cpp runs the GGUF file's own quantization; transformers' baselines run the target as they load it."""
    from benchmarks.modes import LOCAL_SSD_MODES

    base = TWO_THREAD_MODES.get(mode, mode)
    ours = runtime_of(mode).startswith(RUNTIME)
    speculates = base in ("sd", "ssd-service", LLAMA_CPP_SPEC, *LOCAL_SSD_MODES) or mode.startswith("hf-assisted")
    two = _two_threads(mode) or base in ("ssd-service", *LOCAL_SSD_MODES)
    peer = "gguf" if runtime_of(mode) == "llama.cpp" else "float32"
    return {
        "dtype": target.resolved_dtype if ours else peer,
        "draft_dtype": (draft.resolved_dtype if ours else peer) if speculates and draft is not None else None,
        "cores": 2 if two else settings.target_threads,
        "link": {"sd": "in-process", "ssd-service": "gRPC"}.get(base, "pipe" if base in LOCAL_SSD_MODES else None),
        "lending": settings.lend_cores if base in ("ssd-service", *LOCAL_SSD_MODES) else False,
        # the draft's LM head over this many frequent ids (0: whole; :mod:`spec_core.draft_vocab`)
        "draft_head_vocab": _head_vocab(draft) if ours and speculates and draft is not None else None,
    }


def _head_vocab(draft: ModelConfig) -> int | None:
    from spec_core.models import draft_head_vocab

    try:
        return draft_head_vocab(draft)
    except (OSError, ValueError):
        return None


def _run_key(run: dict) -> tuple[int | None, int]:
    return run.get("prompt"), run["repeat"]


def with_paired_ratios(results: list[dict]) -> list[dict]:
    """``results`` with ``x_ar_paired_median`` on every row that has AR beside it (same temperature and
    concurrency): the median over runs of this mode's tokens/s over AR's in the same run slot (prompt and repeat,
    or repeat at concurrency > 1). Modes run interleaved, so a pair shares its prompt and the machine's state
    of the moment; the median of the pairs is the comparison this bench judges modes by, robust to the prompts'
    spread in speed (the aggregate ``tokens_per_s`` is weighted towards the slow ones) and to a slow run."""
    ar = {(r["temperature"], r["concurrency"]): {_run_key(x): x["tokens_per_s"] for x in r.get("runs") or []}
          for r in results if r["mode"] == "ar"}
    out = []
    for r in results:
        base = ar.get((r["temperature"], r["concurrency"]), {})
        pairs = [x["tokens_per_s"] / base[_run_key(x)] for x in r.get("runs") or [] if base.get(_run_key(x))]
        out.append({**r, "x_ar_paired_median": statistics.median(pairs) if pairs else None})
    return out


def concurrency_row(mode: str, runs: list[dict], temp: float, c: int, reference: dict, num_prompts: int) -> dict:
    """The result row of one batched mode at concurrency ``c``, from its runs (those of
    :func:`benchmarks.concurrent.run_concurrent`)."""
    tps = [r["tokens_per_s"] for r in runs]
    itls = [x for r in runs for x in r["itls"]]
    matches = None
    if temp == 0 and reference:
        matches = all(r["outputs"][pi] == reference[(pi, 0)] for r in runs for pi in range(num_prompts))
    return {
        "mode": mode, "runtime": runtime_of(mode), "concurrency": c, "temperature": temp,
        "tokens_per_s": statistics.median(tps), "tokens_per_s_median_run": statistics.median(tps),
        "tokens_per_s_min_run": min(tps), "tokens_per_s_max_run": max(tps),
        "runs": [{"repeat": rep, "tokens_per_s": v} for rep, v in enumerate(tps)],
        "ttft_s_p50": percentile([x for r in runs for x in r["ttfts"]], 50),
        "itl_s_p50": percentile(itls, 50), "itl_s_p99": percentile(itls, 99),
        "mean_tokens_per_round": mean([r["mean_tokens_per_round"] for r in runs if r["mean_tokens_per_round"]]),
        "acceptance_rate": mean([r["acceptance_rate"] for r in runs if r["acceptance_rate"] is not None]),
        "acceptance_by_position": None,
        "cache_hit_rate": mean([r["cache_hit_rate"] for r in runs if r["cache_hit_rate"] is not None]),
        "branches_per_bundle": mean([r["branches_per_bundle"] for r in runs if r.get("branches_per_bundle") is not None]),
        "verifier_idle_fraction": None, "link_bytes_per_round": None,
        "batching": (f"continuous batching, {c} in flight" + (", adaptive K" if not is_ar(mode) else "")
                     + (", 2 threads on both cores" if mode in TWO_THREAD_MODES else "")
                     + (f", {c} streaming gRPC clients" if mode == "ssd-service" else "")),
        "mean_batch_k": mean([r["mean_batch_k"] for r in runs if r.get("mean_batch_k") is not None]),
        "backoff_step_fraction": mean([r["backoff_step_fraction"] for r in runs
                                       if r.get("backoff_step_fraction") is not None]),
        "lent_step_fraction": mean([r["lent_step_fraction"] for r in runs if r.get("lent_step_fraction") is not None]),
        "num_runs": len(runs),
        "num_generated": sum(r["num_generated"] for r in runs), "matches_target_greedy": matches,
        "peak_rss_mb_process": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def print_summary(report: dict) -> None:
    out = sys.stdout
    out.write(f"{'mode':<18}{'conc':>5}{'T':>5}{'tok/s':>10}{'x AR':>7}{'x AR med':>9}{'tok/round':>11}{'accept':>8}"
              f"{'hit':>6}{'greedy=AR':>11}  ran\n")
    base = {(r["temperature"], r["concurrency"]): r["tokens_per_s"] for r in report["results"] if r["mode"] == "ar"}
    for r in report["results"]:
        if r.get("skipped"):
            out.write(f"{r['mode']:<18}{r['concurrency']:>5}{r['temperature']:>5.2f}  skipped: {r['skipped']}\n")
            continue
        b = base.get((r["temperature"], r["concurrency"]))
        ratio = r["tokens_per_s"] / b if b and r["tokens_per_s"] else None
        paired = r.get("x_ar_paired_median")
        acc, hit = r["acceptance_rate"], r["cache_hit_rate"]
        out.write(
            f"{r['mode']:<18}{r['concurrency']:>5}{r['temperature']:>5.2f}{r['tokens_per_s'] or 0:>10.1f}"
            f"{(f'{ratio:.2f}' if ratio else '-'):>7}{(f'{paired:.2f}' if paired else '-'):>9}"
            f"{r['mean_tokens_per_round'] or 0:>11.2f}"
            f"{(f'{acc:.2f}' if acc is not None else '-'):>8}{(f'{hit:.2f}' if hit is not None else '-'):>6}"
            f"{str(r['matches_target_greedy']):>11}  {_ran(r)}\n"
        )
    for r in report["results"]:
        if r.get("matches_target_greedy") is False:
            sys.stderr.write(f"bench: WARNING: {r['mode']} (T={r['temperature']}, concurrency {r['concurrency']}, "
                             f"{_ran(r)}) did not reproduce AR's greedy output: its rate is not AR's model's\n")


def _ran(row: dict) -> str:
    """What a row ran, in a few words: ``int4/w8a8, 2 cores, pipe, lending``."""
    dtypes = row.get("dtype") or "?"
    if row.get("draft_dtype"):
        dtypes += "/" + row["draft_dtype"]
    parts = [dtypes, f"{row.get('cores')} core" + ("s" if row.get("cores") != 1 else "")]
    parts += [row["link"]] if row.get("link") else []
    parts += ["lending"] if row.get("lending") else []
    if row.get("alternating_round_fraction") is not None:
        parts += [f"alternating {100 * row['alternating_round_fraction']:.0f}%"]
    return ", ".join(parts)
