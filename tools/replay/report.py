"""The replay reports as text tables: one run, a sweep, several nodes."""

from __future__ import annotations

from typing import Any

from kvtier.tiers.units import format_gib
from kvtier.tools.mrc_plot import curve_name, curve_names

__all__ = ["format_nodes", "format_result", "format_sweep"]


def format_result(r: dict[str, Any]) -> str:
    c = r["config"]
    bs = c["block_size"]
    br, tr = r["block_hit_rate"], r["token_hit_rate"]
    lines = [
        f"trace {r.get('trace', '')}: {r['requests']:,} requests, {r['looked_up_blocks']:,} full blocks looked up, "
        f"{r['input_tokens']:,} input tokens",
        f"GPU {c['gpu_blocks']:,} blocks ({c['gpu_blocks'] * bs:,} tokens), CPU {c['cpu_blocks']:,} blocks "
        f"({c['cpu_blocks'] * bs:,} tokens), policy {curve_name(c)}, block size {bs}",
        "",
        f"{'':14}{'blocks':>12}{'block rate':>12}{'token rate':>12}",
    ]
    for tier in ("gpu", "cpu", "total"):
        lines.append(f"{'hit ' + tier:14}{r['hit_blocks'][tier]:>12,}{br[tier]:>12.4f}{tr[tier]:>12.4f}")
    lines.append(f"{'miss':14}{r['miss_blocks']:>12,}")
    for name in ("belady", "infinite"):
        b = r["bounds"].get(name)
        if b is not None:
            cap = "" if b["capacity_blocks"] is None else f" ({b['capacity_blocks']:,} blocks)"
            lines.append(f"{'bound ' + name:14}{b['hit_blocks']:>12,}{b['block_hit_rate']:>12.4f}"
                         f"{b['token_hit_rate']:>12.4f}{cap}")
    lines += [
        "",
        f"demotions {r['demotions']:,} (not admitted {r['demotions_not_admitted']:,}), restores {r['restores']:,}, "
        f"CPU evictions {r['cpu_evictions']:,}",
        f"bytes GPU->CPU {format_gib(r['bytes']['gpu_to_cpu'], decimals=1, thousands=True)}, "
        f"CPU->GPU {format_gib(r['bytes']['cpu_to_gpu'], decimals=1, thousands=True)} "
        f"({c['block_bytes']:,} B/block)",
    ]
    if r["truncated_requests"]:
        lines.append(f"{r['truncated_requests']:,} requests longer than the GPU tier: "
                     f"{r['truncated_blocks']:,} blocks looked up but not cached")
    lines.append(f"replayed in {r['seconds']:.2f} s")
    return "\n".join(lines)


def format_sweep(s: dict[str, Any]) -> str:
    bs = s["block_size"]
    policies = curve_names(s)
    by = {(curve_name(p["config"]), p["config"]["cpu_blocks"]): p for p in s["points"]}
    width = max(12, *(len(p) + 2 for p in policies))
    lines = [
        f"trace {s.get('trace', '')}: block hit rate, GPU {s['gpu_blocks']:,} blocks "
        f"({s['gpu_blocks'] * bs:,} tokens), block size {bs}",
        f"{'CPU blocks':>11}{'CPU tokens':>13}" + "".join(f"{p:>{width}}" for p in policies) + f"{'belady':>10}",
    ]
    for m, b in zip(s["cpu_blocks"], s["belady"]):
        row = f"{m:>11,}{m * bs:>13,}"
        row += "".join(f"{by[p, m]['block_hit_rate']['total']:>{width}.4f}" for p in policies)
        lines.append(row + f"{b['block_hit_rate']:>10.4f}")
    lines.append(f"infinite cache: {s['infinite']['block_hit_rate']:.4f}   "
                 f"(Belady: one cache of GPU + CPU blocks)   {s.get('seconds', 0):.1f} s")
    return "\n".join(lines)


def format_nodes(r: dict[str, Any]) -> str:
    """The report as a table: block hit rate by tier for each run, token hit rate, Mooncake's figures."""
    c, n = r["node"], r["nodes"]
    bs = c["block_size"]
    rb = r["remote_blocks"]
    remote = "unbounded" if rb is None else f"{rb:,} blocks ({rb * bs:,} tokens)"
    any_run = next(iter(r["assign"].values()))["local"] if r["assign"] else r["one_global_cache"]
    lines = [
        f"trace {r.get('trace', '')}: {any_run['requests']:,} requests, {any_run['looked_up_blocks']:,} full "
        f"blocks looked up",
        f"{n} nodes, each GPU {c['gpu_blocks']:,} blocks ({c['gpu_blocks'] * bs:,} tokens) + CPU "
        f"{c['cpu_blocks']:,} blocks ({c['cpu_blocks'] * bs:,} tokens), policy {c['policy']}; shared remote "
        f"tier {remote}, LRU; {r['hot_blocks']} hot block(s) skipped by hash assignment",
        "",
        f"{'block hit rate':40}{'gpu':>8}{'cpu':>8}{'remote':>8}{'total':>8}{'token':>8}",
    ]

    def row(label: str, d: dict[str, Any]) -> str:
        b = d["block_hit_rate"]
        return (f"{label:40}{b['gpu']:>8.4f}{b['cpu']:>8.4f}{b['remote']:>8.4f}{b['total']:>8.4f}"
                f"{d['token_hit_rate']['total']:>8.4f}")

    for rule, d in r["assign"].items():
        rates = [p["block_hit_rate"] for p in d["local"]["per_node"]]
        lines.append(row(f"local, {rule}", d["local"]) + f"   nodes {min(rates):.3f}..{max(rates):.3f}")
        lines.append(row(f"global (+remote), {rule}", d["global"]) + f"   requests/node "
                     f"{d['requests_per_node']['min']:,}..{d['requests_per_node']['max']:,}")
        if "global_write_through" in d:
            lines.append(row(f"global, write-through*, {rule}", d["global_write_through"]))
    lines.append(row(f"one global cache ({n}x GPU+CPU)", r["one_global_cache"]))
    inf = r["infinite"]
    lines.append(f"{'infinite cache (bound)':40}{'':>24}{inf['block_hit_rate']:>8.4f}{inf['token_hit_rate']:>8.4f}")
    m = r["mooncake_reference"]
    if r.get("write_through"):
        lines.append("* what-if: computed blocks written to the remote tier at once (the pool writes back on "
                     "CPU eviction only)")
    lines += [
        "",
        f"reference: {m['source']}: ~{m['local_hit_rate']:.3f} each node alone, ~{m['global_hit_rate']:.3f} "
        "one global cache",
        f"replayed in {r['seconds']:.1f} s",
    ]
    return "\n".join(lines)
