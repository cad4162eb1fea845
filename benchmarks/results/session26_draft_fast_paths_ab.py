"""Session 26 A/B: the draft's CPU fast paths (compiled small ops + row padding) on against off, SD and SSD.

The target (``dtype``) runs on core 0, pinned, one thread; SSD's drafter process on core 1. Both draft variants are
loaded with ``reference=False`` (fused norms); "off" turns their kernels and row padding off. Modes run interleaved
by prompt, their order flipped every repeat; medians and paired ratios are judged.

    python benchmarks/results/session26_draft_fast_paths_ab.py w8a8 8 3 > out.json
"""

import dataclasses
import json
import os
import statistics
import sys


def main() -> None:
    from cluster.local_ssd import LocalSSD, LocalSSDConfig, generate_ssd
    from spec_core import chat
    from spec_core.config import ModelConfig, SamplingParams, SSDConfig, draft_dtype
    from spec_core.model_paths import default_pair
    from spec_core.models import set_threads
    from spec_core.prompts import humaneval_prompts
    from spec_core.runner import ModelRunner
    from verifier_service.api import Generator

    dtype, n, reps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    os.sched_setaffinity(0, {0})
    set_threads(1)
    pair = default_pair()
    gen = Generator(ModelConfig(pair["target"], dtype=dtype), ModelConfig(pair["draft"], dtype=draft_dtype(dtype)), k=3)
    slow = ModelRunner(pair["draft"], dtype=gen.pair.draft.dtype, pad_rows=False, kernels=False, reference=False)
    gens = {"on": gen, "off": Generator.from_pair(dataclasses.replace(gen.pair, draft=slow), k=3)}
    params = SamplingParams(max_new_tokens=128)
    prompts = humaneval_prompts(n)
    res: dict[str, list[float]] = {m: [] for m in ("ar", "sd_on", "sd_off", "ssd_on", "ssd_off")}
    locals_ = {tag: LocalSSD(gen.pair.target, LocalSSDConfig(pair["draft"], SSDConfig(k=3), adaptive_k=True,
                                                              draft_cpu_kernels=on, draft_pad_rows=on),
                             eos_ids=gen.pair.eos_ids).__enter__() for tag, on in (("on", True), ("off", False))}
    gen.generate(prompts[0], SamplingParams(max_new_tokens=8), mode="ar")  # warm-up
    for r in range(reps):
        for p in prompts:
            ids = chat.encode(gen.tokenizer, p)
            res["ar"].append(gen.generate(p, params, mode="ar").stats.tokens_per_s)
            for tag in ("on", "off") if r % 2 == 0 else ("off", "on"):
                res["sd_" + tag].append(gens[tag].generate(p, params, mode="sd").stats.tokens_per_s)
                res["ssd_" + tag].append(generate_ssd(locals_[tag], ids, params)[1].tokens_per_s)
    for local in locals_.values():
        local.__exit__(None, None, None)
    paired = {m: statistics.median(a / b for a, b in zip(res[m + "_on"], res[m + "_off"])) for m in ("sd", "ssd")}
    print(json.dumps({"dtype": dtype, "median_tok_s": {m: statistics.median(v) for m, v in res.items()},
                      "median_paired_on_over_off": paired, "all": res}, indent=1))


if __name__ == "__main__":
    main()
