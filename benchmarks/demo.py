"""``ssd demo``: one chat question answered by AR on one core and on two, SD and SSD, interleaved and repeated,
judged on medians: each mode's tok/s, the equal-hardware ratio (SSD's two processes against AR on the same two
cores), and whether every greedy output is the same."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from benchmarks.bench import BenchSettings
from benchmarks.modes import ModeRunner
from spec_core import chat
from spec_core.config import ModelConfig, SamplingParams
from spec_core.hardware import describe

#: The demo's modes, in the order they are printed: (mode, label, cores).
DEMO_MODES = (("ar", "AR", 1), ("ar-2t", "AR on two cores", 2), ("sd", "SD", 1), ("ssd", "SSD", 2))


@dataclass(frozen=True, slots=True)
class DemoRow:
    mode: str
    label: str
    cores: int
    tok_s: float  # median over the runs
    runs: tuple[float, ...]
    tokens_per_round: float
    note: str


@dataclass(frozen=True, slots=True)
class DemoReport:
    question: str
    answer: str
    hardware: str
    dtype: str
    draft_dtype: str
    tokens: int
    repeats: int
    rows: tuple[DemoRow, ...]
    identical: bool

    def row(self, mode: str) -> DemoRow:
        return next(r for r in self.rows if r.mode == mode)

    @property
    def equal_hardware(self) -> float:
        """SSD's tok/s over AR's on the same two cores."""
        return self.row("ssd").tok_s / self.row("ar-2t").tok_s


def run_demo(target: ModelConfig, draft: ModelConfig, question: str, max_new_tokens: int, k: int, ssd_k: int,
             repeats: int = 3, adaptive: bool = True, threads: int = 1) -> DemoReport:
    """Every mode on the question ``repeats`` times, the order rotated each time (after one warm-up each)."""
    settings = BenchSettings(modes=tuple(m for m, _, _ in DEMO_MODES), num_prompts=1, max_new_tokens=max_new_tokens,
                             k=ssd_k, sd_k=k, repeats=repeats, temperatures=(0.0,), prompts_file=None,
                             ignore_eos=False, target_threads=threads, adaptive_k=adaptive, sd_adaptive=adaptive)
    runner = ModeRunner(settings, target, draft)
    try:
        tokenizer = runner.gen.pair.tokenizer
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                               add_generation_prompt=True)
        modes = settings.modes
        for mode in modes:
            runner.run(mode, prompt, SamplingParams(max_new_tokens=8))
        results: dict[str, list] = {m: [] for m in modes}
        params = SamplingParams(max_new_tokens=max_new_tokens)
        for rep in range(repeats):
            for mode in modes[rep % len(modes):] + modes[: rep % len(modes)]:
                results[mode].append(runner.run(mode, prompt, params))
        extra = runner.ssd_extra["ssd"][-repeats:]
    finally:
        runner.close()
    outputs = {tuple(r.token_ids) for runs in results.values() for r in runs}
    ar = results["ar"][0]
    rows = tuple(_row(mode, label, cores, results[mode], extra, k if mode == "sd" else ssd_k, adaptive)
                 for mode, label, cores in DEMO_MODES)
    return DemoReport(question, chat.decode(tokenizer, ar.token_ids), describe(), target.resolved_dtype,
                      draft.resolved_dtype, len(ar.token_ids), repeats, rows, len(outputs) == 1)


def _row(mode: str, label: str, cores: int, runs: list, extra: list[dict], k: int, adaptive: bool) -> DemoRow:
    tok_s = [r.stats.tokens_per_s or 0.0 for r in runs]
    stats = runs[len(runs) // 2].stats
    plan = f"k={k}" if not adaptive else f"adaptive k <= {k}, no draft on {stats.plain_round_fraction or 0:.0%} of rounds"
    note = ""
    if mode == "sd":
        note = f"{plan}, acceptance {stats.acceptance_rate or 0:.2f}"
    elif mode == "ssd":
        hits = statistics.median(e.get("cache_hit_rate") or 0.0 for e in extra) if extra else 0.0
        note = f"{plan}, cache hit rate {hits:.2f}, drafter on the second core"
    elif mode == "ar-2t":
        note = "the same two cores SSD uses"
    return DemoRow(mode, label, cores, statistics.median(tok_s), tuple(tok_s), stats.mean_tokens_per_round or 1.0,
                   note)


def format_demo(report: DemoReport) -> str:
    ar = report.row("ar").tok_s
    runs = f"median of {report.repeats} interleaved runs" if report.repeats > 1 else "one run"
    lines = [f"user: {report.question}", f"assistant: {report.answer}", "-" * 72,
             f"{report.hardware}; dtype {report.dtype} (draft {report.draft_dtype}); {report.tokens} tokens, greedy; "
             + runs,
             f"{'mode':<17}{'cores':>5}{'tok/s':>9}{'x AR':>7}{'tokens/round':>14}"]
    for r in report.rows:
        lines.append(f"{r.label:<17}{r.cores:>5}{r.tok_s:>9.1f}{r.tok_s / ar:>7.2f}{r.tokens_per_round:>14.2f}"
                     + (f"  ({r.note})" if r.note else ""))
    eq = report.equal_hardware
    lines.append(f"equal hardware: SSD {eq:.2f}x AR on the same two cores")
    lines.append(f"greedy outputs identical: {'yes' if report.identical else 'NO'} (AR, AR on two cores, SD, SSD)")
    lines.append(_verdict(report, eq))
    if not report.identical:
        lines.append(f"({report.dtype}: a forward over several tokens may round differently from one-token steps; "
                     "--dtype float32 is the exact reference)")
    return "\n".join(lines) + "\n"


def _verdict(report: DemoReport, eq: float) -> str:
    one = report.row("ssd").tok_s / report.row("ar").tok_s
    if eq >= 1.0:
        return f"SSD pays here: {eq:.2f}x plain decoding on the same two cores, {one:.2f}x on one."
    head = f"Speculation does not pay for this request in {report.dtype} on this CPU: "
    if one >= 1.0:
        return (head + f"on the same two cores, plain decoding is {1 / eq:.2f}x faster than SSD. SSD's gain over "
                "one-core AR comes from its second core: its planner decodes plain where speculation measures no "
                "gain, and lends the drafter's idle core to the verifier.")
    return (head + f"SSD runs at {one:.2f}x one-core AR and {eq:.2f}x AR on the same two cores. Its planner decodes "
            "plain where speculation measures no gain; the rounds it still tries, to measure, cost more than they "
            "return.")
