"""Session 22: where batch-16 sampled SSD loses to AR, step by step, with a held-plain control.

    python benchmarks/results/session22_b16_steps.py 3 out.json      # passes, output

Each pass runs 16 HumanEval prompts x 128 tokens at T = 0.8, concurrency 16, in three modes, interleaved: ``ar``;
``ssd0k``, the SSD engine and drafter with a planner of ``k_max = 0`` (never speculates: what a fully held SSD pass
costs); and ``ssd`` with the default planner (one per mode across passes, as ``ssd bench`` keeps). Every engine step
is logged: its time, forward time, proposing time, batch, tokens emitted, the planner's batch K and hold, and the
drafter process's CPU time during the step (from /proc).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch

from benchmarks.concurrent import run_concurrent
from cluster.local_ssd import LocalSSD, LocalSSDConfig
from spec_core.chat import encode
from spec_core.config import SamplingParams, SSDConfig
from spec_core.model_paths import default_pair
from spec_core.models import LoadedPair, eos_token_ids, load_tokenizer
from spec_core.prompts import humaneval_prompts
from spec_core.runner import ModelRunner
from verifier_service.adaptive import AdaptiveK
from verifier_service.engine import VerifierEngine

LOG: list[dict] = []
STATE = {"mode": "?", "pid": None}
_step, _propose = VerifierEngine.step, VerifierEngine._propose


def _drafter_cpu_s() -> float:
    if STATE["pid"] is None:
        return 0.0
    fields = open(f"/proc/{STATE['pid']}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _timed_propose(self, work):
    t0 = time.perf_counter()
    out = _propose(self, work)
    self._propose_s = time.perf_counter() - t0
    return out


def _logged_step(self):
    self._propose_s = 0.0
    f0, e0, d0, t0 = self.metrics.forward_s, self.metrics.tokens_emitted, _drafter_cpu_s(), time.perf_counter()
    out = _step(self)
    plan = self.adaptive
    LOG.append(dict(mode=STATE["mode"], s=time.perf_counter() - t0, fwd=self.metrics.forward_s - f0,
                    prop=self._propose_s, b=self.metrics.batch_sizes[-1] if self.metrics.batch_sizes else 0,
                    em=self.metrics.tokens_emitted - e0, k=plan.batch_k if plan else 0,
                    hold=plan.backoff(16).hold_left if plan else 0, drafter_cpu=_drafter_cpu_s() - d0))
    return out


def summary(log: list[dict]) -> dict:
    """Per pass: wall seconds, steps, and the decode steps split into plain and speculating ones."""
    out = {}
    for mode in dict.fromkeys(e["mode"] for e in log):
        steps = [e for e in log if e["mode"] == mode and "s" in e]
        decode = [e for e in steps if e["s"] < 1.0]  # (the prefill step takes ~2.3 s)
        spec = [e for e in decode if e["k"] or e["em"] > e["b"]]
        plain = [e for e in decode if not (e["k"] or e["em"] > e["b"])]
        wall = next(e for e in log if e["mode"] == mode and "wall" in e)
        out[mode] = {"tok_s": wall["tok_s"], "steps_s": round(sum(e["s"] for e in steps), 2),
                     "plain_steps": len(plain), "plain_median_ms": round(statistics.median(e["s"] for e in plain) * 1e3),
                     "spec_steps": len(spec),
                     "spec_median_ms": round(statistics.median(e["s"] for e in spec) * 1e3) if spec else None,
                     "spec_tokens_per_request": round(sum(e["em"] for e in spec) / sum(e["b"] for e in spec), 2)
                     if spec else None,
                     "drafter_cpu_s_in_plain_steps": round(sum(e["drafter_cpu"] for e in plain), 2)}
    return out


def main(passes: int, out_path: str) -> None:
    VerifierEngine.step, VerifierEngine._propose = _logged_step, _timed_propose
    pair = default_pair()
    target = ModelRunner(pair["target"], dtype=torch.bfloat16)
    draft = ModelRunner(pair["draft"], dtype=torch.bfloat16)
    tok = load_tokenizer(pair["target"])
    loaded = LoadedPair(target, draft, tok, eos_token_ids(target, tok))
    ids = [encode(tok, p) for p in humaneval_prompts(16)]
    planner = AdaptiveK(k_max=3)
    cfg = LocalSSDConfig(pair["draft"], SSDConfig(k=3), verifier_core=0, drafter_core=1)
    with LocalSSD(target, cfg, eos_ids=loaded.eos_ids) as local:
        STATE["pid"] = local.proc.pid
        for r in range(passes):
            for mode in ("ar", "ssd0k", "ssd"):
                STATE["mode"] = f"{mode}{r}"
                engine_mode = "ar" if mode == "ar" else "ssd"
                plan = AdaptiveK(k_max=0) if mode == "ssd0k" else planner
                params = [SamplingParams(max_new_tokens=128, ignore_eos=True, temperature=0.8) for _ in ids]
                t0 = time.perf_counter()
                res = run_concurrent(loaded, engine_mode, ids, params, 3, 16, local if engine_mode == "ssd" else None,
                                     plan if engine_mode == "ssd" else None)
                LOG.append(dict(mode=STATE["mode"], wall=time.perf_counter() - t0, tok_s=round(res["tokens_per_s"], 1)))
    json.dump({"summary": summary(LOG), "steps": LOG}, open(out_path, "w"))
    print(json.dumps(summary(LOG), indent=1))


if __name__ == "__main__":
    os.sched_setaffinity(0, {0})
    torch.set_num_threads(1)
    main(int(sys.argv[1]), sys.argv[2])
