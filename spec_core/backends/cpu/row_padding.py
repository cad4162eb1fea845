"""Padding a forward's token rows up to a row count its weight matmuls run faster at, measured per runner.

On a CPU the weight matmuls of one forward are not monotone in its rows. With oneDNN's bf16 linear on an AVX-512
BF16 core, SmolLM2-135M's whole stack took 20.2 ms for 1 row, 23.1 for 2, 18.7 for 3 and 17.7 for 4: the kernels
for one and two rows read the weights more slowly than the 4-row one. So a forward of n rows is cheaper run as m > n
rows, the extra ones padding, the way vLLM pads a decode batch up to the next size it captured a CUDA graph for.

:func:`measure` times the runner's own matmul stack at 1..``max_rows`` rows (interleaved, medians) once at load;
:meth:`RowPadding.tokens` then picks, for a packed batch of ``bsz`` rows of ``t`` tokens, the padded token count
whose measured time is lowest, if it beats ``t``'s by ``margin``. Padding leaves the real rows' results alone:
every op of the stack is row-wise (oneDNN's linear gives each row bit for bit the same output at any row count,
tested), the pad tokens write their K/V to the cache's scratch slot, and their logits are never read
(:func:`spec_core.packing.pack`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from spec_core.backends.cpu.quant import Weight, matmul

#: Row counts measured: past 8 rows the stack's time grows with its rows on every CPU measured.
MAX_ROWS = 8


@dataclass(frozen=True, slots=True)
class RowPadding:
    """Measured seconds of a runner's weight matmuls by row count (``seconds[r - 1]``: r rows), and how much
    faster a padded size must be to be used (``margin``, a fraction: below it the pad rows' own costs outside the
    matmuls, such as their attention, would eat the gain)."""

    seconds: tuple[float, ...]
    margin: float = 0.05

    def tokens(self, bsz: int, t: int) -> int:
        """The token count to pad each of ``bsz`` rows of ``t`` tokens to: ``t``, or the t' > t whose
        ``bsz · t'`` rows were measured fastest, where that beats ``bsz · t`` rows by ``margin``."""
        n = len(self.seconds)
        if bsz * t > n:
            return t
        best = min(range(t, n // bsz + 1), key=lambda u: (self.seconds[bsz * u - 1], u))
        return best if self.seconds[bsz * best - 1] < (1 - self.margin) * self.seconds[bsz * t - 1] else t

    def skip_pads(self, real: int, padded: int) -> bool:
        """Whether a ragged batch of ``real`` tokens, ``padded`` with its pads, runs faster without them: always
        past the measured counts (the time grows with the rows there), else where ``real`` rows measured no slower."""
        n = len(self.seconds)
        return padded > n or self.seconds[real - 1] <= self.seconds[padded - 1]

    def padded_sizes(self) -> dict[int, int]:
        """Rows → padded rows for a single sequence, where they differ (for logs and reports)."""
        return {r: p for r in range(1, len(self.seconds) + 1) if (p := self.tokens(1, r)) != r}


def stack_seconds(mats: Sequence[Weight], dtype: torch.dtype, device: torch.device, rows: Sequence[int],
                  repeats: int, warmup: int = 2) -> dict[int, float]:
    """Median seconds of one pass through ``mats`` (``[in, out]`` weights, in a forward's order) at each row
    count of ``rows``, the counts interleaved within every repeat so that drift hits them alike."""
    xs = {r: {m.shape[0]: torch.randn(r, m.shape[0], dtype=dtype, device=device) for m in mats} for r in rows}
    times: dict[int, list[float]] = {r: [] for r in rows}
    with torch.inference_mode():
        for i in range(warmup + repeats):
            for r in rows:
                t0 = time.perf_counter()
                for m in mats:
                    matmul(xs[r][m.shape[0]], m)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                if i >= warmup:
                    times[r].append(time.perf_counter() - t0)
    return {r: statistics.median(v) for r, v in times.items()}


def measure(mats: Sequence[Weight], dtype: torch.dtype, device: torch.device, repeats: int = 5,
            margin: float = 0.05) -> RowPadding:
    """A :class:`RowPadding` from the stack's measured time at 1..:data:`MAX_ROWS` rows."""
    secs = stack_seconds(mats, dtype, device, range(1, MAX_ROWS + 1), repeats)
    return RowPadding(tuple(secs[r] for r in range(1, MAX_ROWS + 1)), margin)
