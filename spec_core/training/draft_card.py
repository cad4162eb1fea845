"""The draft's model card (``README.md`` in its folder), written from the training report: data, shape, steps,
losses, agreement and, once measured, SD tokens per round and cost."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path


def _fmt(x, nd: int = 3) -> str:
    return "n/a" if x is None else (f"{x:.{nd}f}" if isinstance(x, float) else str(x))


def _data_lines(report: dict, cfg) -> list[str]:
    d, t = cfg.data, cfg.train
    lines = ["## Data (all offline; no benchmark prompt is ever read)"]
    if d.stdlib_tokens:
        lines += [f"- Chunks of {d.chunk_len} tokens of the Python standard library's source ({d.stdlib_tokens:,} "
                  "tokens; test", "  folders and ten held-out files excluded), teacher-forced through the target "
                  f"({d.dtype})."]
    past_eos = "past EOS for all" if d.code_ignore_eos else "up to EOS,"
    docs = report.get("gen_documents")
    lines += [
        f"- The target's own responses ({d.gen_dtype}) to {d.num_code_prompts} code prompts (stdlib function heads,",
        f"  continued greedily, {past_eos} {d.code_max_new} tokens) and {d.num_chat_prompts} chat prompts built from "
        "stdlib",
        "  docstrings, the language reference topics and a fixed topic list"
        + (f", plus {d.num_selfinstruct} questions the target wrote itself (its user turn sampled at T = "
           f"{d.question_temperature} after a seeded starter word, kept when complete)" if d.num_selfinstruct else "")
        + (f", and {d.num_prose_prompts} everyday requests (a written list of things and tasks crossed with request "
           "templates; the topics of our chat eval set left out)" if d.num_prose_prompts else "")
        + f" ({int(100 * (1 - d.sampled_fraction))}% greedy, the rest sampled at",
        f"  T = {d.gen_temperature}; up to {d.chat_max_new} tokens). Labels are the target's top-{d.top_k}",
        "  next-token distribution at every position."
        + (f" {docs:,} documents were generated ({report.get('gen_shards')} batches; a run may stop early and "
           "train on the batches it has)." if docs else ""),
        f"- Held out: {int(t.heldout_fraction * 100)}% of the generated documents, and the stdlib's held-out files.",
    ]
    if cfg.init_from:
        lines += ["", "## Lineage",
                  f"Fine-tuned from the draft in `{Path(cfg.init_from).name}` (its weights and vocabulary), whose own "
                  "card is kept here as `LINEAGE.md`: the steps, data and numbers above are this stage's only."]
    return lines


def _reproduce_lines(cfg) -> list[str]:
    d = cfg.data
    first = ([f"ssd train-draft --out runs/NAME --init {cfg.init_from and Path(cfg.init_from).name} --seed {cfg.seed} "
              f"--gen-dtype {d.gen_dtype}{' --recipe chat' if d.num_prose_prompts else ''} --threads 2  "
              "# resumable; --stage data-gen --shard I/N splits the teacher between processes; "
              "--stage train --steps N trains on the data so far"]
             if cfg.init_from else ["ssd train-draft --out runs/smollm2-draft --threads 1   # rerun the same command to resume"])
    return ["## Reproduce", "```bash", *first,
            "ssd train-draft --out runs/NAME [--init ...] --stage eval  # SD tokens per round and cost into report.json",
            "```", "", "Configuration: " + ", ".join(f"{k}={v}" for k, v in asdict(cfg.shape).items()) + ".", ""]


def card_text(report: dict, cfg) -> str:
    s, d, t = cfg.shape, cfg.data, cfg.train
    log = report.get("train_log", [])
    first, last = (log[0], log[-1]) if log else ({}, {})
    held = report.get("heldout_gen", {})
    held_std = report.get("heldout_stdlib", {})
    lines = [
        "# smollm2-draft: a distilled draft for SmolLM2-135M-Instruct",
        "",
        "A small Llama that proposes tokens for speculative decoding with SmolLM2-135M-Instruct (Apache-2.0) as the",
        "target. Same tokenizer (49,152 ids); output head over a reduced draft vocabulary (`token_map.json`): its",
        "proposal q is exactly zero outside the map, and the verifier uses that q, so decoding stays lossless.",
        "",
        "| | |",
        "|---|---|",
        f"| architecture | Llama, {s.num_layers} layers, hidden {s.hidden_size}, {s.num_heads} heads "
        f"({s.num_kv_heads} KV), MLP {s.intermediate_size}, tied embeddings |",
        f"| parameters | {report.get('params', 0) / 1e6:.2f} M (bf16 safetensors) |",
        f"| draft vocabulary | {report.get('draft_vocab')} ids, the teacher's most frequent next tokens |",
        f"| training tokens | {report.get('train_tokens', 0):,} (teacher-labelled, top-{d.top_k}) |",
        f"| steps | {report.get('steps')} x {t.batch_tokens} tokens, seq {t.seq_len}, AdamW lr {t.lr} cosine "
        f"to {t.min_lr}, warmup {t.warmup}, bf16 autocast {report.get('bf16_autocast', t.bf16_autocast)} |",
        f"| loss (soft CE, nats/token, EMA) | {_fmt(first.get('loss'))} at step {first.get('step')} -> "
        f"{_fmt(last.get('loss'))} at step {last.get('step')} |",
        f"| train top-1 agreement (EMA) | {_fmt(last.get('train_agree'))} |",
        f"| held-out top-1 agreement, target's own responses | {_fmt(held.get('top1_agreement'))} "
        f"({held.get('tokens', 0):,} tokens; soft CE {_fmt(held.get('soft_ce'))}) |",
        f"| held-out top-1 agreement, stdlib files never trained on | {_fmt(held_std.get('top1_agreement'))} "
        f"({held_std.get('tokens', 0):,} tokens) |",
    ]
    sd = report.get("sd")
    if sd:
        he, ch, cost = sd["humaneval"], sd["chat"], sd.get("cost", {})
        lines += [
            f"| greedy SD, K = {he['k']}, first {he['prompts']} HumanEval x {he['max_new_tokens']} tokens | "
            f"{_fmt(he['tokens_per_round'], 2)} tokens per target forward (acceptance {_fmt(he['acceptance_rate'])}) |",
            f"| greedy SD, K = {ch['k']}, our {ch['prompts']} chat prompts (to end of turn, <= "
            f"{ch['max_new_tokens']}) | {_fmt(ch['tokens_per_round'], 2)} tokens per target forward |",
            f"| cost c = T_draft(1) / T_target(1) | {_fmt(cost.get('c'))} (fp32, one pinned thread, context 256: "
            f"{_fmt((cost.get('draft_t1_s') or 0) * 1e3, 2)} ms vs {_fmt((cost.get('target_t1_s') or 0) * 1e3, 2)} ms) |",
        ]
    lines += ["", *_data_lines(report, cfg)]
    lines += ["", "## Limits",
              "The held-out generated documents come from the same prompt templates as the training ones, so their",
              "agreement is optimistic: the SD rows above, on prompts of other kinds, are the measure that matters.",
              "", *_reproduce_lines(cfg)]
    return "\n".join(lines)


def write_card(dest: Path, report: dict, cfg) -> None:
    """``README.md`` from the report; a fine-tuned draft also keeps its parent's card as ``LINEAGE.md``."""
    if cfg.init_from:
        parent = Path(cfg.init_from)
        if (parent / "README.md").is_file() and parent.resolve() != dest.resolve():
            text = (parent / "README.md").read_text()
            if (parent / "LINEAGE.md").is_file():
                text += "\n\n---\n\n" + (parent / "LINEAGE.md").read_text()
            (dest / "LINEAGE.md").write_text(text)
    (dest / "README.md").write_text(card_text(report, cfg))
