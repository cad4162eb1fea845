"""``ssd bench``: modes side by side on the same prompts, interleaved prompt by prompt, with repeats.

Metric definitions are those of :mod:`spec_core.metrics`: decode tokens/s = Σ(generated − 1) ÷ Σ decode time over
all runs of a mode (model load, process start and prefill excluded). Per-run tokens/s are also reported as a median
with min/max, since this machine is noisy. The modes themselves are in :mod:`benchmarks.modes`; the result rows,
the report and the summary table in :mod:`benchmarks.report`.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

from benchmarks.modes import BATCHED_MODES, BENCH_MODES, ModeRunner
from benchmarks.report import ModeRuns, build_report, concurrency_row, print_summary, skipped_row, summarise
from spec_core.config import SSD_DEFAULT_TREE, ModelConfig, SamplingParams, TreeShape
from spec_core.models import LoadedPair, set_threads
from spec_core.prompts import CHAT_SETS, CODE_SET, chat_prompts, code_prompts, humaneval_prompts, read_prompt_file
from spec_core.settings import ServiceConfig


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
    tree: str = str(SSD_DEFAULT_TREE)  # the ssd mode's candidate tree per outcome (ssd-chain: a chain)
    #: humaneval, code (our held-out code set) or a chat set (spec_core.prompts.CHAT_SETS, through the chat template)
    prompt_set: str = "humaneval"
    adaptive_k: bool = True  # the ssd modes choose K per step from measured costs, down to 0, as the service does
    #: Seed sampled requests. A seeded sampled request is reproducible, so its K stays fixed (adaptive K would
    #: change its tokens) and it waits for neural drafts: what a user who passes `seed` gets, not the default.
    seeded: bool = False
    #: How the ssd modes' sampled requests draw (``EngineConfig.sampling``); the other modes use the residual rule.
    sampling: str = "auto"
    #: The local ssd modes' plain steps borrow the drafter's core (:mod:`verifier_service.core_lending`).
    lend_cores: bool = True
    #: The sd modes choose K per step from measured costs too (``ssd demo``; the bench's SD runs at fixed K).
    sd_adaptive: bool = False
    #: The ssd modes' drafting strategy (``SSDConfig.strategy``).
    ssd_strategy: str = "auto"
    #: How a run-ahead pair shares its cores (:mod:`verifier_service.run_ahead_schedule`).
    run_ahead_schedule: str = "auto"

    def service_config(self, target: str, draft: str, dtype: str, draft_dtype: str | None = None,
                       mode: str = "ssd") -> ServiceConfig:
        """The ssd modes' settings as the one configuration: the local ``ssd`` rows and ``ssd-service`` run exactly
        these (``ssd-chain``: a chain; ``ssd-coupled``: coupled sampling; ``ssd-pipelined``: never alternating)."""
        return ServiceConfig(target=target, draft=draft, dtype=dtype, draft_dtype=draft_dtype, k=self.k,
                             budget=self.budget, saguaro_c=self.saguaro_c, ssd_strategy=self.ssd_strategy,
                             tree="chain" if mode == "ssd-chain" else self.tree, fixed_k=not self.adaptive_k,
                             sampling="coupled" if mode == "ssd-coupled" else self.sampling,
                             lend_cores=self.lend_cores, port=0,
                             run_ahead_schedule="pipelined" if mode == "ssd-pipelined" else self.run_ahead_schedule)

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
        bad = [d for d in sweep if d not in ("k", "budget", "c", "tree")]
        if bad:
            raise ValueError(f"--sweep takes k, budget, c and/or tree, got {', '.join(bad)}")
        tree = str(TreeShape.parse(getattr(args, "tree", None) or str(SSD_DEFAULT_TREE)))
        return BenchSettings(modes, num_prompts, max_new, args.k, args.repeats, temps, args.prompts,
                             args.ignore_eos, args.target_threads, concurrency=conc,
                             budget=getattr(args, "budget", 12),
                             saguaro_c=getattr(args, "saguaro_c", 1.0), sweep=sweep, sd_k=getattr(args, "sd_k", None),
                             tree=tree, prompt_set=getattr(args, "prompt_set", "humaneval"),
                             adaptive_k=not getattr(args, "fixed_k", False), seeded=getattr(args, "seeded", False),
                             sampling=getattr(args, "sampling", "auto"),
                             lend_cores=not getattr(args, "no_lend_cores", False),
                             ssd_strategy=getattr(args, "ssd_strategy", "auto"),
                             run_ahead_schedule=getattr(args, "run_ahead_schedule", "auto"))


def _seed(settings: BenchSettings, prompt: int, rep: int) -> int | None:
    return 1000 * prompt + rep if settings.seeded else None


def _prompts(settings: BenchSettings, tokenizer=None) -> list[str]:
    if settings.prompts_file:
        return [r["prompt"] for r in read_prompt_file(settings.prompts_file)][: settings.num_prompts]
    if settings.prompt_set in CHAT_SETS:  # rendered to text, so every mode (the peers too) gets the same prompt
        return [tokenizer.apply_chat_template(p.as_list(), tokenize=False, add_generation_prompt=True)
                for p in chat_prompts(settings.num_prompts, settings.prompt_set)]
    if settings.prompt_set == CODE_SET:
        return code_prompts(settings.num_prompts)
    return humaneval_prompts(settings.num_prompts)


def progress(total: int, desc: str):
    """A progress bar on stderr (tqdm; plain lines when stderr is not a terminal)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=f"bench {desc}", unit="run", file=sys.stderr, mininterval=1.0,
                dynamic_ncols=True, leave=True)


def run_bench(settings: BenchSettings, target: ModelConfig, draft: ModelConfig | None,
              summary: bool = True, on_block=None, pair: LoadedPair | None = None) -> dict:
    """Run every (mode, temperature) on every prompt, interleaved; return the report dict. ``on_block(report)``
    gets the report so far after each (temperature, concurrency) block; ``pair``: the models, already loaded."""
    set_threads(settings.target_threads)
    runner = ModeRunner(settings, target, draft, pair)
    try:
        return _run_all(settings, runner, target, draft, summary, on_block)
    finally:
        runner.close()


def _run_all(settings: BenchSettings, runner: ModeRunner, target: ModelConfig, draft: ModelConfig | None,
             summary: bool = True, on_block=None) -> dict:
    gen = runner.gen
    prompts = _prompts(settings, gen.pair.tokenizer)
    modes = tuple(m for m in settings.modes if m not in runner.skipped)
    for mode in modes:  # warm-up
        runner.run(mode, prompts[0], SamplingParams(max_new_tokens=4))
    runner.tune_assistant(prompts, settings)
    runner.tune_llama_cpp_spec(prompts, settings)
    results = []
    for temp in settings.temperatures:
        runs = {m: ModeRuns.empty() for m in modes}
        runner.ssd_extra = {m: [] for m in runner.ssd_extra}
        reference: dict[tuple[int, int], list[int]] = {}
        total = len(prompts) * settings.repeats * len(modes) if 1 in settings.concurrency else 0
        with progress(total, f"T={temp} concurrency 1") as bar:
            for pi, prompt in enumerate(prompts if total else []):
                for rep in range(settings.repeats):
                    order = modes[rep % len(modes):] + modes[: rep % len(modes)]
                    for mode in order:
                        params = SamplingParams(temperature=temp, max_new_tokens=settings.max_new_tokens,
                                                ignore_eos=settings.ignore_eos, seed=_seed(settings, pi, rep))
                        runs[mode].add((pi, rep), runner.run(mode, prompt, params))
                        bar.update()
        if temp == 0:
            if "ar" in runs and runs["ar"].outputs:
                reference = runs["ar"].outputs
            else:
                greedy = SamplingParams(max_new_tokens=settings.max_new_tokens, ignore_eos=settings.ignore_eos)
                reference = {(pi, rep): gen.generate(p, greedy, mode="ar").token_ids
                             for pi, p in enumerate(prompts) for rep in range(settings.repeats)}
        if 1 in settings.concurrency:
            results.extend({**summarise(m, temp, runs[m], reference or None, runner.ssd_extra.get(m)),
                            **runner.row_extra(m)}
                           if m in runs else skipped_row(m, temp, runner.skipped[m]) for m in settings.modes)
            if on_block is not None:
                on_block(build_report(settings, target, draft, results, runner.assistant_tokens))
        for c in (c for c in settings.concurrency if c > 1):
            results.extend(_run_concurrency(settings, runner, prompts, temp, c, reference))
            if on_block is not None:
                on_block(build_report(settings, target, draft, results, runner.assistant_tokens))
    report = build_report(settings, target, draft, results, runner.assistant_tokens)
    if summary:
        print_summary(report)
    return report


def _run_concurrency(settings: BenchSettings, runner: ModeRunner, prompts: list[str], temp: float, c: int,
                     reference: dict) -> list[dict]:
    """Every batched mode at concurrency ``c`` over all prompts (repeats rotate the mode order)."""
    modes = [m for m in settings.modes if m in BATCHED_MODES and m not in runner.skipped]
    acc: dict[str, list[dict]] = {m: [] for m in modes}
    with progress(settings.repeats * len(modes), f"T={temp} concurrency {c}") as bar:
        for rep in range(settings.repeats):
            params = [SamplingParams(temperature=temp, max_new_tokens=settings.max_new_tokens,
                                     ignore_eos=settings.ignore_eos, seed=_seed(settings, pi, rep))
                      for pi in range(len(prompts))]
            for mode in modes[rep % len(modes):] + modes[: rep % len(modes)]:
                acc[mode].append(runner.run_concurrent(mode, prompts, params, c))
                bar.update()
    return [concurrency_row(mode, runs, temp, c, reference, len(prompts)) for mode, runs in acc.items()]
