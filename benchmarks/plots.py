"""PNG plots of a bench report (matplotlib, headless): tokens/s by mode and concurrency; acceptance by position
and cache-hit rate by mode."""

from __future__ import annotations

from pathlib import Path


def write_plots(report: dict, out_dir: str | Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = report["results"]
    paths = []
    for temp in sorted({r["temperature"] for r in rows}):
        sel = [r for r in rows if r["temperature"] == temp and r["tokens_per_s"]]
        modes = list(dict.fromkeys(r["mode"] for r in sel))
        concs = sorted({r["concurrency"] for r in sel})
        fig, ax = plt.subplots(figsize=(8, 4))
        width = 0.8 / max(1, len(concs))
        for j, c in enumerate(concs):
            vals = [next((r["tokens_per_s"] for r in sel if r["mode"] == m and r["concurrency"] == c), 0) for m in modes]
            ax.bar([i + j * width for i in range(len(modes))], vals, width, label=f"concurrency {c}")
        ax.set_xticks([i + width * (len(concs) - 1) / 2 for i in range(len(modes))], modes)
        ax.set_ylabel("decode tokens/s")
        ax.set_title(f"tokens/s by mode and concurrency (T={temp:g})")
        ax.legend()
        fig.tight_layout()
        path = out / f"tokens_per_s_T{temp:g}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    for r in rows:
        acc = r.get("acceptance_by_position")
        if acc:
            a1.plot(range(1, len(acc) + 1), acc, marker="o", label=f"{r['mode']} T={r['temperature']:g}")
    a1.set_xlabel("draft position")
    a1.set_ylabel("acceptance rate")
    a1.set_title("acceptance by position")
    if a1.lines:
        a1.legend(fontsize=7)
    hits = [r for r in rows if r.get("cache_hit_rate") is not None]
    a2.bar([f"{r['mode']}\nT={r['temperature']:g} c={r['concurrency']}" for r in hits],
           [r["cache_hit_rate"] for r in hits])
    a2.set_ylim(0, 1)
    a2.set_title("SSD cache-hit rate")
    fig.tight_layout()
    path = out / "acceptance_and_hits.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    paths.append(path)
    return paths
