"""``ssd train-pair`` and ``ssd train-draft``: the training commands (the toy pair, and a draft for the target)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from ssd_cli.commands import quiet_transformers
from ssd_cli.main import CliError, print_json


def cmd_train_pair(args: argparse.Namespace) -> int:
    import torch

    from spec_core.training.train_pair import config_from_args, train_pair

    logging.getLogger().setLevel(logging.INFO)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = config_from_args(
        args.smoke, target_steps=args.target_steps, draft_steps=args.draft_steps, max_minutes=args.max_minutes
    )
    report = train_pair(Path(args.out), cfg, resume=args.resume, stage=args.stage)
    print_json({k: report[k] for k in ("eval", "target_params", "draft_params") if k in report})
    return 0


def cmd_train_draft(args: argparse.Namespace) -> int:
    from spec_core.model_paths import check_model_dir, default_pair
    from spec_core.training.train_draft import STAGES

    if args.stage not in STAGES:
        raise CliError(f"unknown --stage {args.stage!r}; choose one of {', '.join(STAGES)}")
    if args.steps is not None and args.steps <= 0:
        raise CliError(f"--steps must be > 0, got {args.steps}")
    if (args.seed is not None or args.gen_dtype or args.data_scale or args.recipe) and not args.init:
        raise CliError("--seed, --gen-dtype, --data-scale and --recipe belong to the fine-tune recipe: give --init")
    from spec_core.training.train_draft import RECIPES

    if args.recipe is not None and args.recipe not in RECIPES:
        raise CliError(f"unknown --recipe {args.recipe!r}; choose one of {', '.join(RECIPES)}")
    shard = _parse_shard(args.shard, args.stage)
    if args.data_scale is not None and args.data_scale <= 0:
        raise CliError(f"--data-scale must be > 0, got {args.data_scale}")
    target = args.target or default_pair()["target"]
    check_model_dir(target)
    quiet_transformers()
    import torch

    from spec_core.model_paths import resolve_model
    from spec_core.training.train_draft import DraftTrainConfig, train_draft

    logging.getLogger().setLevel(logging.INFO)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.init:
        check_model_dir(args.init)
        if not (Path(args.init) / "token_map.json").is_file() or not (Path(args.init) / "config.json").is_file():
            raise CliError(f"--init {args.init}: not an exported draft (needs config.json and token_map.json)")
    if args.smoke:
        cfg = DraftTrainConfig.smoke()
        if args.init:
            from dataclasses import replace

            base = DraftTrainConfig.finetune(args.init)
            cfg = replace(cfg, shape=base.shape, draft_vocab=base.draft_vocab, init_from=base.init_from,
                          data=replace(cfg.data, stdlib_tokens=0, num_selfinstruct=4, code_ignore_eos=True,
                                       num_prose_prompts=4 if args.recipe == "chat" else 0))
    else:
        cfg = DraftTrainConfig.finetune(args.init, seed=args.seed, gen_dtype=args.gen_dtype, scale=args.data_scale,
                                        recipe=args.recipe or "mixed") if args.init else DraftTrainConfig()
    if args.steps is not None:
        from dataclasses import replace

        cfg = replace(cfg, train=replace(cfg.train, steps=args.steps))
    out, target_dir = Path(args.out), str(resolve_model(target))
    if args.stage == "eval":
        return _eval_draft(out, target_dir, cfg)
    report = train_draft(out, target_dir, cfg, stage=args.stage, shard=shard)
    if report:
        print_json({k: report[k] for k in ("steps", "params", "draft_vocab", "train_tokens", "heldout_gen")})
    return 0


def _parse_shard(text: str | None, stage: str):
    """``--shard I/N`` (only with ``--stage data-gen``) as a :class:`~spec_core.training.draft_data.Shard`."""
    from spec_core.training.draft_data import Shard

    if text is None:
        return Shard()
    if stage != "data-gen":
        raise CliError("--shard splits --stage data-gen only")
    try:
        index, count = (int(x) for x in text.split("/"))
    except ValueError:
        raise CliError(f"--shard takes I/N (for example 0/2), got {text!r}") from None
    if not 0 <= index < count:
        raise CliError(f"--shard {text}: need 0 <= I < N")
    return Shard(index, count)


def _eval_draft(out: Path, target_dir: str, cfg) -> int:
    """Measure the exported draft (SD tokens per round, cost) and record it in the report and the card."""
    import json

    from benchmarks.draft_quality import draft_quality
    from spec_core.training.draft_card import write_card

    report_file, draft = out / "report.json", out / "draft"
    if not report_file.is_file() or not (draft / "config.json").is_file():
        raise CliError(f"no exported draft in {out}; run the training stages first")
    report = json.loads(report_file.read_text())
    report["sd"] = draft_quality(target_dir, str(draft))
    report_file.write_text(json.dumps(report, indent=1) + "\n")
    write_card(draft, report, cfg)
    print_json(report["sd"])
    return 0
