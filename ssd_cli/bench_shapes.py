"""``ssd bench-costs --shapes``: T(1), V(K) and batch throughput of random-weight models with real shapes
(:mod:`benchmarks.shape_costs`), eager and through the static-buffer step (CUDA graphs on a GPU)."""

from __future__ import annotations

import argparse
import contextlib
import sys

from ssd_cli.main import CliError, print_json

#: The dtypes a random-weight shape runs in (weight formats need a real checkpoint's calibration or blocks).
FLOAT_DTYPES = ("float32", "bfloat16", "float16")


def shape_dtype(name: str, device: str) -> str:
    """``auto``: bf16 on a GPU (what the issue's targets are timed in), fp32 elsewhere."""
    if name == "auto":
        return "bfloat16" if device.startswith("cuda") else "float32"
    if name not in FLOAT_DTYPES:
        raise CliError(f"--shapes runs random weights in {', '.join(FLOAT_DTYPES)} or auto, not {name}")
    return name


def _line(row: dict) -> str:
    def part(label: str, r: dict) -> str:
        return (f"{label} T(1) {r['t1_s'] * 1e3:.2f} ms, V(4) {r['V'].get(4, float('nan')):.2f}, "
                f"batch {row['batch']} {r['batch_tokens_per_s']:.0f} tok/s")

    static = "graphs" if row["static"]["graphs"] else "static"
    return (f"{row['shape']:>18} {row['dtype']:>8} on {row['device']}: {part('eager', row['eager'])}; "
            f"{part(static, row['static'])}  ({row['params'] / 1e6:.0f}M params, {row['config_source']})\n")


def bench_shapes(args: argparse.Namespace, dtypes: list[str]) -> int:
    """One row per shape and dtype; JSON on stdout, one line each on stderr."""
    from benchmarks.cost_model import pinned
    from benchmarks.shape_costs import SHAPES, measure_shape

    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown or args.batch < 1:
        raise CliError(f"unknown shape(s) {unknown}; known: {', '.join(SHAPES)}" if unknown else "--batch must be >= 1")
    names = [shape_dtype(d, args.device) for d in dtypes]
    rows = []
    for shape in shapes:
        for dtype in names:
            with pinned(None, args.threads) if not args.device.startswith("cuda") else contextlib.nullcontext():
                row = measure_shape(shape, dtype, args.device, context=args.context, k_max=args.k_max,
                                    batch=args.batch, repeats=args.repeats)
            sys.stderr.write(_line(row))
            rows.append(row)
    print_json({"shapes": rows})
    return 0
