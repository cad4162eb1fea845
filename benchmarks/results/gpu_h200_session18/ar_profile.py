"""GPU profile: Generator AR tokens/s in fp32 and bf16 (warm), and a torch.profiler table of a bf16 AR run."""
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from spec_core.config import ModelConfig, SamplingParams
from spec_core.model_paths import default_pair
from spec_core.models import load_pair
from verifier_service.api import Generator

dev = sys.argv[1] if len(sys.argv) > 1 else "cuda:0"
N = int(sys.argv[2]) if len(sys.argv) > 2 else 64
p = default_pair()
ids = list(range(100, 160))


def sync():
    if dev.startswith("cuda"):
        torch.cuda.synchronize()


gens = {}
for dt in ("float32", "bfloat16"):
    pair = load_pair(ModelConfig(p["target"], dt, dev), ModelConfig(p["draft"], dt, dev))
    gen = Generator.from_pair(pair, k=4)
    gens[dt] = gen
    for mode in ("ar", "sd"):
        gen.generate(ids, SamplingParams(max_new_tokens=8, ignore_eos=True), mode=mode, request_id="w")
        for rep in range(2):
            sync()
            t = time.perf_counter()
            res = gen.generate(ids, SamplingParams(max_new_tokens=N, ignore_eos=True), mode=mode, request_id=f"r{rep}")
            sync()
            dt_s = time.perf_counter() - t
            print(f"{dt} {mode} rep{rep}: {len(res.token_ids)} tokens in {dt_s:.3f}s = {dt_s / len(res.token_ids) * 1e3:.1f} ms/token", flush=True)


acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.startswith("cuda") else [])
for dt in ("bfloat16", "float32"):
    with profile(activities=acts) as prof:
        gens[dt].generate(ids, SamplingParams(max_new_tokens=16, ignore_eos=True), mode="ar", request_id="prof")
        sync()
    print(f"==== {dt} AR 16 tokens, by self CPU time")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=22, max_name_column_width=60))
    if dev.startswith("cuda"):
        print(f"==== {dt} by CUDA time")
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=60))
