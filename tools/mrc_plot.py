"""PNG plots of replay reports (matplotlib, headless).

- ``plot_sweep(report, out)``: the miss-ratio curve of a ``kvtier replay
  --sweep`` report, drawn as block hit rate vs CPU-tier capacity (tokens,
  log-scaled x past zero), one line per policy, Belady's MIN for one cache
  of GPU + CPU blocks (dashed) and the infinite-cache bound (dotted
  horizontal line).
- ``plot_result(report, out)``: one replay: hit rate by tier (stacked GPU and
  CPU) beside the Belady and infinite bounds, block- and token-weighted.

Both take the JSON-shaped dicts ``kvtier.tools.replay`` writes, so a saved
report can be re-plotted later.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["plot_sweep", "plot_result"]


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _tokens_label(n: float) -> str:
    n = float(f"{n:.3g}")  # 999,936 -> 1e6, so it reads "1M"
    for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if n >= div:
            return f"{n / div:.3g}{suffix}"
    return f"{n:.3g}"


def curve_name(config: dict[str, Any]) -> str:
    """A point's curve: its policy, with the hints it ran with (``chain [session]``, ``lru [retain 60s]``).
    Reports written before hints existed have neither field."""
    extra = []
    if config.get("hints", "none") != "none":
        extra.append(config["hints"])
    if config.get("retain_s", 0.0):
        extra.append(f"retain {config['retain_s']:g}s")
    return config["policy"] + (f" [{', '.join(extra)}]" if extra else "")


def curve_names(s: dict[str, Any]) -> list[str]:
    """A sweep's curves in the order the points were replayed (policy, then hint set)."""
    return list(dict.fromkeys(curve_name(p["config"]) for p in s["points"]))


def plot_sweep(report: dict[str, Any], out: str | Path, *, title: str | None = None) -> Path:
    plt = _pyplot()
    bs = report["block_size"]
    cpu = list(report["cpu_blocks"])
    xs = [m * bs for m in cpu]
    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    by = {(curve_name(p["config"]), p["config"]["cpu_blocks"]): p for p in report["points"]}
    for policy in curve_names(report):
        ys = [by[policy, m]["block_hit_rate"]["total"] for m in cpu]
        ax.plot(xs, ys, marker="o", markersize=3, linewidth=1.5, label=policy)
    ax.plot(xs, [b["block_hit_rate"] for b in report["belady"]], linestyle="--", color="black", linewidth=1.2,
            label="Belady (one cache, GPU+CPU)")
    ax.axhline(report["infinite"]["block_hit_rate"], linestyle=":", color="gray", linewidth=1.2,
               label=f"infinite cache ({report['infinite']['block_hit_rate']:.3f})")
    if any(x > 0 for x in xs):
        positive = [x for x in xs if x > 0]
        ax.set_xscale("symlog", linthresh=min(positive), linscale=0.3)
        ax.set_xticks(xs)
        ax.set_xticklabels([_tokens_label(x) for x in xs], rotation=45)
        ax.minorticks_off()
        ax.set_xlim(min(xs) - 0.1 * min(positive), max(xs) * 1.2)
    ax.set_xlabel("CPU tier capacity (tokens)")
    ax.set_ylabel("block hit rate (GPU + CPU)")
    ax.set_ylim(0, max(1e-3, report["infinite"]["block_hit_rate"]) * 1.1)
    ax.grid(True, alpha=0.3)
    name = Path(str(report.get("trace", ""))).name
    ax.set_title(title or f"miss-ratio curve {name} — GPU {_tokens_label(report['gpu_blocks'] * bs)} tokens, "
                 f"{bs}-token blocks", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out)
    plt.close(fig)
    return out


def plot_result(report: dict[str, Any], out: str | Path, *, title: str | None = None) -> Path:
    plt = _pyplot()
    c = report["config"]
    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    labels = ["block", "token"]
    gpu = [report["block_hit_rate"]["gpu"], report["token_hit_rate"]["gpu"]]
    cpu = [report["block_hit_rate"]["cpu"], report["token_hit_rate"]["cpu"]]
    ax.bar(labels, gpu, label="GPU hits", color="tab:green")
    ax.bar(labels, cpu, bottom=gpu, label="CPU hits", color="tab:blue")
    styles = {"belady": ("--", "black"), "infinite": (":", "gray")}
    for name, b in report.get("bounds", {}).items():
        ls, color = styles.get(name, ("-.", "red"))
        for i, key in enumerate(("block_hit_rate", "token_hit_rate")):
            ax.hlines(b[key], i - 0.4, i + 0.4, linestyles=ls, colors=color, label=name if i == 0 else None)
    ax.set_ylabel("hit rate")
    name = Path(str(report.get("trace", ""))).name
    ax.set_title(title or f"{name}: GPU {c['gpu_blocks']:,} / CPU {c['cpu_blocks']:,} blocks, {c['policy']}",
                 fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out)
    plt.close(fig)
    return out
