"""Tables, the policy verdict and PNG plots for a `run_compare` result (a JSON-able dict)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from pagedkv.bench import report

__all__ = ["cells", "format_markdown", "plots", "policy_verdict", "write_plots"]

BASE = "pagedkv-lru"
NO_QUEUE = "pagedkv-lru-noqueue"  # the defaults under a scheduler that never calls `expect`


def cells(result: dict[str, Any]) -> dict[tuple[str, int], dict[str, dict[str, Any]]]:
    """(workload, capacity) -> manager -> row."""
    out: dict[tuple[str, int], dict[str, dict[str, Any]]] = defaultdict(dict)
    for row in result["rows"]:
        out[(row["workload"], row["capacity_pages"])][row["manager"]] = row
    return out


def _managers(result: dict[str, Any]) -> list[str]:
    seen: dict[str, None] = {}
    for row in result["rows"]:
        seen.setdefault(row["manager"], None)
    return list(seen)


EVICTION = ("pagedkv-slru", "pagedkv-lfu", "pagedkv-arc", "pagedkv-lru-leaves")  # the policies that may replace LRU


def policy_verdict(result: dict[str, Any], base: str = BASE, max_loss: float = 0.01,
                   candidates: tuple[str, ...] = EVICTION) -> dict[str, Any]:  # fmt: skip
    """Per candidate policy: worst and mean hit-rate difference to `base` over every cell; the winner is
    the policy with the best mean among those never worse than `base` by more than `max_loss`."""
    table = cells(result)
    stats: dict[str, dict[str, float]] = {}
    for name in _managers(result):
        if name not in candidates:
            continue
        diffs = [c[name]["hit_rate"] - c[base]["hit_rate"] for c in table.values() if name in c and base in c]
        if diffs:
            stats[name] = {"worst": min(diffs), "mean": sum(diffs) / len(diffs), "best": max(diffs)}
    eligible = {n: s for n, s in stats.items() if s["worst"] >= -max_loss and s["mean"] > 0}
    winner = max(eligible, key=lambda n: eligible[n]["mean"]) if eligible else base
    return {"base": base, "policies": stats, "winner": winner, "max_loss": max_loss}


def format_markdown(result: dict[str, Any]) -> str:
    """Hit rates, prefill recomputed, preemptions and bookkeeping cost per workload and capacity."""
    table, managers = cells(result), _managers(result)
    lines = ["### Prefix hit rate (token-weighted, first admissions)", ""]
    lines += [f"| workload | pages | ideal | {' | '.join(managers)} |", "|---" * (len(managers) + 3) + "|"]
    for (w, pages), row in sorted(table.items()):
        hits = " | ".join(f"{row[m]['hit_rate']:.4f}" if m in row else "-" for m in managers)
        lines.append(f"| {w} | {pages} | {result['ideal'][w]['page']:.4f} | {hits} |")
    lines += ["", "### Prefill tokens computed / preemptions", ""]
    lines += [f"| workload | pages | {' | '.join(managers)} |", "|---" * (len(managers) + 2) + "|"]
    for (w, pages), row in sorted(table.items()):
        vals = " | ".join(f"{row[m]['prefill_tokens_computed']} / {row[m]['preemptions']}" if m in row else "-"
                          for m in managers)  # fmt: skip
        lines.append(f"| {w} | {pages} | {vals} |")
    lines += [
        "",
        "### Bookkeeping µs per scheduled request-step; ratios to each peer, and hit-rate points of "
        f"{BASE} vs peer ({NO_QUEUE}: the defaults without queue-aware retention)",
        "",
    ]
    peers = [m for m in managers if not m.startswith("pagedkv") and m != "belady"]
    ours = [m for m in (BASE, NO_QUEUE) if m in managers]
    extra = [f"{m.removeprefix('pagedkv-')}/{p}" for m in ours for p in peers] + [f"Δhit vs {p}" for p in peers]
    lines += [
        f"| workload | pages | {' | '.join(ours + peers + extra)} |",
        "|---" * (len(ours + peers + extra) + 2) + "|",
    ]
    for (w, pages), row in sorted(table.items()):
        us = [f"{row[m]['bookkeeping_us']:.2f}" if m in row else "-" for m in ours + peers]
        ratios = [f"{row[m]['bookkeeping_us'] / row[p]['bookkeeping_us']:.2f}" if m in row and p in row else "-"
                  for m in ours for p in peers]  # fmt: skip
        deltas = [f"{100 * (row[BASE]['hit_rate'] - row[p]['hit_rate']):+.2f}" if p in row and BASE in row else "-"
                  for p in peers]  # fmt: skip
        lines.append(f"| {w} | {pages} | {' | '.join(us + ratios + deltas)} |")
    if result.get("decode"):
        decode = result["decode"]
        lines += ["", "### Plain decode step (one token, no page taken or filled), µs per request", ""]
        others = [p for p in decode if p != BASE] if BASE in decode else []
        figures = [f"{v:.2f}" for v in decode.values()] + [f"{decode[BASE] / decode[p]:.2f}" for p in others]
        lines += report.table((*decode, *(f"{BASE}/{p}" for p in others)), [figures])
    lines += ["", "### Prompt hashing, ns per token", ""]
    names = sorted({k for h in result["hashing"].values() for k in h})
    lines += [f"| workload | {' | '.join(names)} |", "|---" * (len(names) + 1) + "|"]
    for w, h in result["hashing"].items():
        lines.append(f"| {w} | {' | '.join(f'{h[n]:.1f}' if n in h else '-' for n in names)} |")
    verdict = policy_verdict(result)
    lines += ["", f"### Eviction policies vs {verdict['base']} (hit-rate points)", ""]
    lines += report.table(("policy", "worst", "mean", "best"), (
        (name, f"{100 * s['worst']:+.2f}", f"{100 * s['mean']:+.2f}", f"{100 * s['best']:+.2f}")
        for name, s in verdict["policies"].items()))  # fmt: skip
    lines += ["", f"Winner (never loses more than {100 * verdict['max_loss']:.0f} point): {verdict['winner']}"]
    for peer, why in result["skipped"].items():
        lines.append(f"\nSkipped {peer}: {why}")
    return "\n".join(lines) + "\n"


def plots(result: dict[str, Any]) -> list[report.Plot]:
    """Per workload, hit rate vs capacity (every manager, with the ideal); bookkeeping cost at the largest
    capacity of each workload."""
    table, managers, out = cells(result), _managers(result), []
    for w in result["ideal"]:
        caps = sorted(p for (wl, p) in table if wl == w)
        series = {m: [table[(w, p)][m]["hit_rate"] if m in table[(w, p)] else None for p in caps] for m in managers}
        out.append(report.Plot(f"hit_rate_{w}", w, "prefix hit rate", caps, series, kind="line",
                               xlabel="pages in the pool", logx=True, dashed={"belady"},
                               hline=(result["ideal"][w]["page"], "ideal (unbounded)")))  # fmt: skip
    workloads = list(result["ideal"])
    tops = {w: max(p for (wl, p) in table if wl == w) for w in workloads}
    cost = {m: [table[(w, tops[w])].get(m, {}).get("bookkeeping_us", 0.0) for w in workloads] for m in managers}
    out.append(report.Plot("bookkeeping_us", "bookkeeping cost (largest capacity)", "µs per scheduled request-step",
                           workloads, cost))  # fmt: skip
    return out


def write_plots(result: dict[str, Any], directory: Path) -> list[Path]:
    """The PNGs of `plots` in `directory`. Needs matplotlib (extra `pagedkv[bench]`)."""
    return report.write_plots(plots(result), directory)
