"""Session 22: how many tokens per round can any candidate tree of depth K add over a chain, with this draft? (#15)

    python benchmarks/results/session22_tree_bound.py 8 128        # HumanEval prompts, tokens each

The target (bf16, as ``auto`` here) decodes each prompt greedily; the draft then reads the prompt and that
continuation in one forward (teacher forcing), which gives, at every position, the rank of the target's token in
the draft's distribution. On a hit, the accepted path is the target's own tokens, and the drafter's distribution at
each accepted node is exactly this teacher-forced one, so a tree accepts, from a round's start, as long as each next
target token is among the children drafted at that depth: a *full* tree of widths (w1, .., wK) accepts while rank <
w_d; the shipped *spine with leaves* continues only through rank 0 and ends on one leaf (rank < w_d). Tokens per
round = accepted + 1 (the bonus), averaged over every start position. This is the hit-round ceiling of each shape;
misses (no bundle for the outcome) dilute any gain further.
"""

from __future__ import annotations

import json
import sys

import torch

from spec_core.chat import encode
from spec_core.config import SamplingParams
from spec_core.model_paths import default_pair
from spec_core.models import load_tokenizer
from spec_core.prompts import humaneval_prompts
from spec_core.runner import ModelRunner
from spec_core.sequence import Sequence
from verifier_service.api import engine_for_one, run_one


def ranks(n_prompts: int, n_tokens: int) -> list[list[int]]:
    """Per prompt: the rank of each generated target token in the draft's teacher-forced distribution."""
    return [rk for _, _, rk in decode(n_prompts, n_tokens)]


def decode(n_prompts: int, n_tokens: int) -> list[tuple[list[int], int, list[int]]]:
    """Per prompt: (prompt + the target's continuation, the prompt's length, the draft's rank of each generated
    token)."""
    pair = default_pair()
    target = ModelRunner(pair["target"], dtype=torch.bfloat16)
    draft = ModelRunner(pair["draft"], dtype=torch.bfloat16)
    tok = load_tokenizer(pair["target"])
    engine = engine_for_one(target, None, 0)
    out = []
    for i, prompt in enumerate(humaneval_prompts(n_prompts)):
        ids = encode(tok, prompt)
        seq = Sequence(f"p{i}", list(ids), SamplingParams(max_new_tokens=n_tokens, ignore_eos=True),
                       max_len=target.spec.max_positions)
        run_one(engine, seq)
        full = seq.token_ids
        cache = draft.new_cache(1, len(full) + 1)
        with torch.inference_mode():
            logits = draft.forward(cache, torch.tensor([full]), torch.arange(len(full))[None])[0]
        gen = torch.tensor(full[len(ids):])
        rows = logits[len(ids) - 1: len(full) - 1]  # the distribution each generated token was drawn against
        out.append((full, len(ids), (rows > rows.gather(1, gen[:, None])).sum(1).tolist()))
    return out


def tokens_per_round(rank_lists: list[list[int]], widths: tuple[int, ...], spine_only: bool) -> float:
    total = count = 0
    for rk in rank_lists:
        for start in range(len(rk) - len(widths)):
            accepted = 0
            for d, w in enumerate(widths):
                r = rk[start + d]
                if r == 0:
                    accepted += 1
                    continue
                if r < w:
                    accepted += 1
                    if not spine_only:
                        continue
                break
            total += accepted + 1
            count += 1
    return total / count


def nodes(widths: tuple[int, ...], spine_only: bool) -> int:
    if spine_only:
        return sum(widths)
    n, level = 0, 1
    for w in widths:
        level *= w
        n += level
    return n


def main(n_prompts: int, n_tokens: int) -> dict:
    rk = ranks(n_prompts, n_tokens)
    flat = [r for x in rk for r in x]
    out = {"prompts": n_prompts, "tokens": n_tokens,
           "rank_share": {str(r): round(sum(1 for x in flat if x == r) / len(flat), 3) for r in range(6)},
           "shapes": []}
    k = 3
    chain = tokens_per_round(rk, (1,) * k, True)
    for widths, spine_only in [((1, 1, 1), True), ((5, 3, 2), True), ((8, 8, 8), True), ((2, 1, 1), False),
                               ((2, 2, 1), False), ((2, 2, 2), False), ((3, 2, 1), False), ((4, 2, 2), False),
                               ((8, 8, 8), False)]:
        tpr = tokens_per_round(rk, widths, spine_only)
        out["shapes"].append({"widths": list(widths), "kind": "spine+leaves" if spine_only else "full tree",
                              "nodes": nodes(widths, spine_only), "tokens_per_round": round(tpr, 3),
                              "x_chain": round(tpr / chain, 3)})
    return out


if __name__ == "__main__":
    torch.set_num_threads(2)
    print(json.dumps(main(int(sys.argv[1]), int(sys.argv[2])), indent=1))
