"""Draft quality on the real interface: greedy SD tokens per target forward, and the draft's cost c.

- HumanEval: the first ``num_code`` prompts, ``max_new`` tokens each (``ignore_eos``), as the bar states;
- chat: our own prompt set (``spec_core/assets/chat_prompts.jsonl``) through the chat template, stopping at the
  end of the turn (at most ``max_new`` tokens).

Tokens per round = (accepted draft tokens + one target token per round) / rounds, over all requests.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from cluster.offline_batch import run_batch
from spec_core.config import ModelConfig, SamplingParams
from spec_core.models import load_pair
from spec_core.prompts import chat_prompts, humaneval_prompts
from verifier_service.batch_requests import BatchSettings


def _sd(pair, prompts, k: int, max_new: int, ignore_eos: bool) -> dict:
    rows = [(f"r{i}", p, SamplingParams(max_new_tokens=max_new, ignore_eos=ignore_eos)) for i, p in enumerate(prompts)]
    with tempfile.TemporaryDirectory() as tmp:
        summary = run_batch(pair, rows, Path(tmp) / "out.jsonl", BatchSettings(mode="sd", k=k, concurrency=8))
    return {"prompts": len(prompts), "k": k, "max_new_tokens": max_new,
            "tokens_per_round": summary["mean_tokens_per_round"], "acceptance_rate": summary["acceptance_rate"],
            "acceptance_by_position": summary["acceptance_by_position"], "generated_tokens": summary["generated_tokens"]}


def draft_quality(target_path: str, draft_path: str, k: int = 4, max_new: int = 128, num_code: int = 20,
                  costs: bool = True) -> dict:
    """Greedy SD at ``k`` on HumanEval and on our chat set, and (``costs``) c = T_draft(1) / T_target(1)."""
    pair = load_pair(ModelConfig(target_path), ModelConfig(draft_path))
    out = {
        "humaneval": _sd(pair, humaneval_prompts(num_code), k, max_new, ignore_eos=True),
        "chat": _sd(pair, chat_prompts(), k, max_new, ignore_eos=False),
    }
    if costs:
        from benchmarks.cost_model import measure_costs

        m = measure_costs(target_path, draft_path, context=256, k_max=4, repeats=50)
        out["cost"] = {"target_t1_s": m["target_t1_s"], "draft_t1_s": m["draft_t1_s"], "c": m["c"],
                       "context": 256, "dtype": "float32", "threads": 1}
    return out
