"""Session 18: python benchmarks/results/session18_b16_drafter_cpu.py ar,ssd [profile-mode] [repeats].

Batch-16, T=0.8 plain-step cost: AR engine vs the local SSD engine; drafter CPU time per run; optional profile."""
import cProfile
import os
import pstats
import sys
import time

import torch

from benchmarks.concurrent import run_concurrent
from cluster.local_ssd import LocalSSD, LocalSSDConfig
from spec_core import chat
from spec_core.config import ModelConfig, SamplingParams, SSDConfig
from spec_core.model_paths import default_pair
from spec_core.models import load_pair
from spec_core.prompts import chat_prompts
from verifier_service.adaptive import AdaptiveK


def cpu(pid):
    f = open(f'/proc/{pid}/stat').read().split(')')[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf('SC_CLK_TCK')


def main():
    torch.set_num_threads(1)
    p = default_pair()
    pair = load_pair(ModelConfig(p["target"], "auto"), ModelConfig(p["draft"], "auto"))
    prompts = [chat.encode(pair.tokenizer, x) for x in chat_prompts(16)]
    params = [SamplingParams(max_new_tokens=128, temperature=0.8) for i in range(16)]
    local = LocalSSD(pair.target, LocalSSDConfig(p["draft"], SSDConfig(k=3), draft_dtype="bfloat16", adaptive_k=True)).__enter__()
    planners = {}
    mode_order = sys.argv[1].split(",")
    prof_mode = sys.argv[2] if len(sys.argv) > 2 else None
    reps = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    dpid = local.drafter_info['pid']
    for rep in range(reps):
        for mode in mode_order:
            pl = planners.setdefault(mode, local.engine.adaptive if mode == 'ssd' else (AdaptiveK(k_max=3) if mode == 'sd' else None))
            prof = cProfile.Profile() if (mode == prof_mode and rep == reps - 1) else None
            c0, m0, w0 = cpu(dpid), cpu(os.getpid()), time.perf_counter()
            if prof:
                prof.enable()
            out = run_concurrent(pair, mode, prompts, params, 3, 16, local if mode == "ssd" else None, pl)
            if prof:
                prof.disable()
            c1, m1, w1 = cpu(dpid), cpu(os.getpid()), time.perf_counter()
            itl = sorted(out["itls"])
            print(f"rep {rep} {mode}: {out['tokens_per_s']:.1f} tok/s, itl p50 {itl[len(itl)//2]*1e3:.1f} ms, mean K {out['mean_batch_k']}; drafter cpu {c1-c0:.2f}s, main cpu {m1-m0:.2f}s, wall {w1-w0:.2f}s", flush=True)
            if prof:
                pstats.Stats(prof).sort_stats("cumulative").print_stats(35)
    local.__exit__(None, None, None)


if __name__ == '__main__':
    main()
