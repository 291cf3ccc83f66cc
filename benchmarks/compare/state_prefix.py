"""`python -m benchmarks.compare.state_prefix`: prefix hit rates of a Qwen3.5-shaped hybrid at equal byte budgets.

On the `benchmarks.compare` workloads (zipf system prompts, multi-turn, few-shot, doc QA), the same trace
replays through the compare driver (`sim.simulate`, `max_num_seqs` = S) at a few byte budgets B, with:

- pagedkv on the hybrid (`pagedkv_hybrid.StateCheckpointAdapter`: 8 full-attention layers in 16-token
  pages, 24 gated-delta-net layers in state rows): the budget pays S live rows first (51,511,296 B each),
  the rest buys attention pages (`memory.compute_num_device_blocks`), and state checkpoints take runs of
  those pages (99 pages each, `memory.checkpoint_pages`): one byte budget, one eviction policy. Its default
  (``pagedkv``: ``KVCacheParams.max_state_checkpoints`` unset, two per batch slot) and other caps C on how
  many checkpoints are kept (multiples of S). A budget whose rows leave fewer pages than the longest request needs is
  reported as "does not fit"; a run in which a request is refused with nothing else running (checkpoint
  tails that cannot give their pages back: `pagedkv_hybrid.StallError`) as "stalled", where the engine's
  scheduler would drop that request with `InsufficientBlocksError`.
- vLLM 0.33's hybrid `KVCacheManager` in Mamba align mode (`peer_vllm_hybrid.VllmHybridAdapter.from_bytes`:
  the blocks vLLM's planner makes of B), when vLLM imports (else reported skipped with the import error).
- the ceiling: the same model with all 32 layers full attention, pagedkv's `PagedKVAdapter`, B // 2 MiB
  pages of 16 tokens, with ``commit_on_alloc=True`` (pages hittable from the step that schedules them,
  vLLM's caching; the higher of pagedkv's two modes, so the stricter reference). The same with pagedkv's
  default step-time commit (``ceiling-step``) is reported beside it: the hybrid coordinator commits at step
  time only (a state cannot be checkpointed before its forward pass), so the difference between the two
  ceilings is a loss no state checkpoint can recover.

Budgets: `fractions` of the bytes the ceiling's unbounded cache ends up holding (distinct full pages of the
trace x 2 MiB), as `benchmarks.compare` sweeps fractions of the unbounded pages, never below the floor where
pagedkv runs (S live rows, twice the longest request's attention pages and one page per row: see `budgets`)
nor below twice the longest request in the ceiling.
pagedkv's eviction policy (attention pages and checkpoint runs alike) is `eviction` (LRU unless set); the
ceiling keeps LRU. Per workload the "unbounded hybrid"
figure is pagedkv's hybrid with unlimited pages: what its checkpoint saving rule itself allows.
Hit rate = prompt tokens served from the cache / prompt tokens over first admissions, as `benchmarks.compare`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeGuard

from benchmarks.compare.pagedkv_adapter import PagedKVAdapter
from benchmarks.compare.pagedkv_hybrid import (
    StallError,
    StateCheckpointAdapter,
    budget_pages,
    ceiling_params,
    hybrid_params,
)
from benchmarks.compare.peer_vllm_hybrid import QWEN35, VllmHybridAdapter
from benchmarks.compare.peers import PeerUnavailable
from benchmarks.compare.sim import CacheAdapter, SimConfig, SimResult, simulate
from pagedkv.bench import report
from pagedkv.bench.timing import gc_frozen
from pagedkv.core.errors import InsufficientBlocksError
from pagedkv.core.memory import checkpoint_pages, num_state_rows, pool_page_bytes, state_row_bytes
from pagedkv.core.pool import EVICTION_POLICIES
from pagedkv.workloads.traces import TraceRequest, ideal_hit_rates, make_trace, unique_pages

__all__ = [
    "CHECKPOINT_MULTIPLES",
    "FRACTIONS",
    "WORKLOADS",
    "add_arguments",
    "budgets",
    "command",
    "format_markdown",
    "plots",
    "run_state_prefix",
]

WORKLOADS = ("zipf", "multiturn", "fewshot", "docqa")
FRACTIONS = (0.1, 0.2, 0.4, 1.0)
CHECKPOINT_MULTIPLES = (0.5, 1.0, 4.0)  # checkpoint caps C besides the default (2 per slot), in multiples of S
NO_CAP = 2**31 - 1  # a cap no run reaches: checkpoints as many as the pages hold (always swept)
MAX_NUM_SEQS = 32
CEILING, CEILING_STEP, VLLM = "ceiling", "ceiling-step", "vllm-hybrid"
DEFAULT = "pagedkv"  # pagedkv with max_state_checkpoints=None: two checkpoints per batch slot
MiB, GiB = 1 << 20, 1 << 30

Progress = Callable[[int, int, str], None]


def _pagedkv(c: int) -> str:
    return "pagedkv-nocap" if c == NO_CAP else f"pagedkv-c{c}"


def _label(c: int) -> str:
    return "no cap" if c == NO_CAP else f"C={c}"


def budgets(trace: list[TraceRequest], fractions: Sequence[float], max_num_seqs: int, page_size: int = 16) -> list[int]:
    """The byte budgets of the sweep (whole MiB): `fractions` of the ceiling's unbounded cache, at least the
    floor where pagedkv runs: its live rows, twice the longest request's attention pages and one page per row,
    and at least twice the longest request in the ceiling."""
    hybrid = hybrid_params(page_size=page_size)
    ceiling = ceiling_params(page_size=page_size)
    longest = max(-(-len(r.tokens) // page_size) for r in trace)
    rows = num_state_rows(hybrid, max_num_seqs)  # every row may hold a checkpoint whose tail holds a page
    floor = max(rows * state_row_bytes(hybrid) + (2 * longest + rows) * pool_page_bytes(hybrid),
                2 * longest * ceiling.bytes_per_block)  # fmt: skip
    total = unique_pages(trace, page_size) * ceiling.bytes_per_block
    return sorted({-(-max(floor, int(total * f)) // MiB) * MiB for f in fractions})


def _replay(adapter: CacheAdapter, trace: Sequence[TraceRequest], config: SimConfig) -> SimResult:
    with gc_frozen():
        return simulate(adapter, trace, config)


def _row(workload: str, budget: int, res: SimResult, **extra: Any) -> dict[str, Any]:
    return {
        "workload": workload, "budget_bytes": budget, "manager": res.name, "fits": True, "hit_rate": res.hit_rate,
        "prefill_tokens_computed": res.prefill_tokens_computed, "preemptions": res.preemptions,
        "bookkeeping_us": res.bookkeeping_us, "peak_used_pages": res.peak_used_pages, **extra,
    }  # fmt: skip


def _unbounded_hybrid(trace: list[TraceRequest], config: SimConfig, page_size: int) -> SimResult:
    """pagedkv's hybrid with a page for every token and a run for everything it saves."""
    params = hybrid_params(page_size=page_size)
    saves = 4 * len(trace) + config.max_num_seqs
    pages = sum(-(-len(r.tokens) // page_size) for r in trace) + 1 + saves * checkpoint_pages(params)
    return _replay(StateCheckpointAdapter("pagedkv-unbounded", params, pages, config.max_num_seqs), trace, config)


def run_state_prefix(
    workloads: Sequence[str] = WORKLOADS,
    num_requests: int = 1000,
    fractions: Sequence[float] = FRACTIONS,
    checkpoint_multiples: Sequence[float] = CHECKPOINT_MULTIPLES,
    max_num_seqs: int = MAX_NUM_SEQS,
    peers: Sequence[str] = (VLLM,),
    page_size: int = 16,
    max_num_batched_tokens: int = 8192,
    seed: int = 0,
    eviction: str = "lru",
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Run the sweep; returns {"rows", "workloads", "bytes", "skipped", "config"} (see `format_markdown`)."""
    config = SimConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
    caps = sorted({max(1, round(m * max_num_seqs)) for m in checkpoint_multiples} | {NO_CAP})
    hybrid, ceiling = hybrid_params(page_size=page_size), ceiling_params(page_size=page_size)
    row_bytes, page_bytes = state_row_bytes(hybrid), pool_page_bytes(hybrid)
    rows: list[dict[str, Any]] = []
    per_workload: dict[str, dict[str, Any]] = {}
    skipped: dict[str, str] = {}
    traces = {w: make_trace(w, num_requests, seed) for w in workloads}
    plan = {w: budgets(t, fractions, max_num_seqs, page_size) for w, t in traces.items()}
    planned = sum(len(b) for b in plan.values()) * (3 + len(peers) + len(caps)) + len(workloads)
    done = 0

    def tick(what: str) -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(min(done, planned), planned, what)

    for workload, trace in traces.items():
        page_ideal, token_ideal = ideal_hit_rates(trace, page_size)
        longest = max(-(-len(r.tokens) // page_size) for r in trace)
        unbounded = _unbounded_hybrid(trace, config, page_size)  # (nothing is evicted: the policy is moot)
        per_workload[workload] = {
            "ideal": {"page": page_ideal, "token": token_ideal}, "unbounded_hybrid": unbounded.hit_rate,
            "unbounded_bytes": unique_pages(trace, page_size) * ceiling.bytes_per_block, "budgets": plan[workload],
        }  # fmt: skip
        tick(f"{workload}: unbounded hybrid {unbounded.hit_rate:.4f}")
        for budget in plan[workload]:
            for name, flat in ((CEILING, ceiling_params(page_size=page_size, commit_on_alloc=True)),
                               (CEILING_STEP, ceiling_params(page_size=page_size, commit_on_alloc=False))):  # fmt: skip
                pages = budget // flat.bytes_per_block
                flat_adapter = PagedKVAdapter(name, flat, pages, max_num_seqs)
                if name == CEILING_STEP:  # (the hybrid's own features: step-time commit, no queue-aware retention)
                    flat_adapter.lookahead = None  # type: ignore[assignment,method-assign]
                res = _replay(flat_adapter, trace, config)
                rows.append(_row(workload, budget, res, pages=pages))
                tick(f"{workload} @ {budget / GiB:.2f} GiB: {name} {res.hit_rate:.4f}")
            for peer in peers:
                rows.extend(_peer(peer, workload, budget, trace, config, skipped))
                tick(f"{workload} @ {budget / GiB:.2f} GiB: {peer}")
            for c, name in [*((c, _pagedkv(c)) for c in caps), (None, DEFAULT)]:
                params = hybrid_params(page_size=page_size, max_state_checkpoints=c, eviction_policy=eviction)
                extra = {
                    "checkpoints": c,
                    "state_rows": num_state_rows(params, max_num_seqs),
                    "default": name == DEFAULT,
                }
                try:
                    pages = budget_pages(params, budget, max_num_seqs)
                except InsufficientBlocksError:
                    pages = 0
                if pages < longest:  # the rows leave no room for the longest request's pages
                    rows.append({"workload": workload, "budget_bytes": budget, "manager": name, "fits": False,
                                 "pages": pages, **extra})  # fmt: skip
                    tick(f"{workload} @ {budget / GiB:.2f} GiB: {name} does not fit")
                    continue
                adapter = StateCheckpointAdapter(name, params, pages, max_num_seqs)
                try:
                    res = _replay(adapter, trace, config)
                except StallError as exc:
                    rows.append({"workload": workload, "budget_bytes": budget, "manager": name, "fits": True,
                                 "stalled": str(exc), "pages": pages, **extra})  # fmt: skip
                    tick(f"{workload} @ {budget / GiB:.2f} GiB: {name} stalled")
                    continue
                adapter.coord.check_integrity()
                states = adapter.states
                rows.append(_row(workload, budget, res, pages=pages, checkpoint_hits=states.num_hits,
                                 checkpoints_saved=states.num_saved, checkpoint_evictions=states.num_dropped,
                                 checkpoints_kept=len(states),
                                 state_copies=adapter.state_copies, tail_copies=adapter.tail_copies,
                                 cut_chunks=adapter.cut_chunks, **extra))  # fmt: skip
                tick(f"{workload} @ {budget / GiB:.2f} GiB: {name} {res.hit_rate:.4f}")
    vllm_block = None
    if VLLM in peers and VLLM not in skipped:
        vllm_block = VllmHybridAdapter.bytes_per_block()
    return {
        "rows": rows, "workloads": per_workload, "skipped": skipped,
        "bytes": {"state_row": row_bytes, "hybrid_page": page_bytes, "ceiling_page": ceiling.bytes_per_block,
                  "vllm_block": vllm_block, "checkpoint_pages": checkpoint_pages(hybrid)},
        "config": {"workloads": list(workloads), "num_requests": num_requests, "fractions": list(fractions),
                   "checkpoints": caps, "default_checkpoints": None, "max_num_seqs": max_num_seqs,
                   "max_num_batched_tokens": max_num_batched_tokens, "page_size": page_size, "seed": seed,
                   "eviction": eviction,
                   "shape": dataclasses.asdict(QWEN35)},
    }  # fmt: skip


def _peer(peer: str, workload: str, budget: int, trace: list[TraceRequest], config: SimConfig,
          skipped: dict[str, str]) -> list[dict[str, Any]]:  # fmt: skip
    if peer != VLLM:
        raise ValueError(f"peer {peer!r}: only {VLLM!r} runs the hybrid model")
    if peer in skipped:
        return []
    try:
        adapter = VllmHybridAdapter.from_bytes(budget, max_num_batched_tokens=config.max_num_batched_tokens)
    except PeerUnavailable as exc:
        skipped[peer] = str(exc)
        return []
    except ValueError:  # fewer than one usable block
        return [{"workload": workload, "budget_bytes": budget, "manager": peer, "fits": False}]
    res = _replay(adapter, trace, config)
    return [_row(workload, budget, res, pages=adapter.num_pages, block_tokens=adapter.page_size)]


# ----------------------------------------------------------------------------------------------- report
def _cells(result: dict[str, Any]) -> dict[tuple[str, int], dict[str, dict[str, Any]]]:
    out: dict[tuple[str, int], dict[str, dict[str, Any]]] = defaultdict(dict)
    for row in result["rows"]:
        out[(row["workload"], row["budget_bytes"])][row["manager"]] = row
    return out


def _order(result: dict[str, Any]) -> list[tuple[str, int]]:
    index = {w: i for i, w in enumerate(result["config"]["workloads"])}
    return sorted(_cells(result), key=lambda k: (index[k[0]], k[1]))


def _ran(row: dict[str, Any] | None) -> TypeGuard[dict[str, Any]]:
    return row is not None and row["fits"] and "stalled" not in row


def _hit(row: dict[str, Any] | None) -> str:
    if row is None:
        return "-"
    if not row["fits"]:
        return "does not fit"
    return "stalled" if "stalled" in row else f"{row['hit_rate']:.4f}"


def _ratio(num: dict[str, Any] | None, den: dict[str, Any] | None) -> str:
    if num is None or den is None or not _ran(num) or not _ran(den):
        return "-"
    return f"{num['hit_rate'] / den['hit_rate']:.3f}" if den["hit_rate"] else "-"


def verdict(result: dict[str, Any]) -> dict[str, Any]:
    """The issue's targets for pagedkv's default cap: hit rate >= 90% of the ceiling's and above vLLM's in
    every cell; the cells that miss each."""
    name = DEFAULT
    ceiling_miss, vllm_miss = [], []
    for key in _order(result):
        cell = _cells(result)[key]
        mine = cell.get(name)
        where = f"{key[0]} @ {key[1] / GiB:.2f} GiB"
        if mine is None or not _ran(mine):
            ceiling_miss.append(where)
            if VLLM in cell:
                vllm_miss.append(where)
            continue
        if mine["hit_rate"] < 0.9 * cell[CEILING]["hit_rate"]:
            ceiling_miss.append(where)
        peer = cell.get(VLLM)
        if _ran(peer) and mine["hit_rate"] <= peer["hit_rate"]:
            vllm_miss.append(where)
    return {"manager": name, "below_90pct_of_ceiling": ceiling_miss, "not_above_vllm": vllm_miss,
            "vllm_compared": any(VLLM in c for c in _cells(result).values())}  # fmt: skip


def format_markdown(result: dict[str, Any]) -> str:
    """Hit rates, ratios to the ceiling, what each budget buys, and the checkpoint bytes."""
    cfg, table, sizes = result["config"], _cells(result), result["bytes"]
    caps, s = cfg["checkpoints"], cfg["max_num_seqs"]
    cols = [(DEFAULT, DEFAULT), *((_label(c), _pagedkv(c)) for c in caps)]  # (label, manager)
    labels = [label for label, _ in cols]
    has_vllm = any(VLLM in c for c in table.values())
    peers = [VLLM] if has_vllm else []
    policy = cfg.get("eviction", "lru")
    lines = [
        f"### Prefix hit rate, Qwen3.5-shaped hybrid vs all-attention ceiling (S = {s} sequences, pagedkv "
        f"eviction {policy})",
        "",
    ]
    head = ["workload", "budget GiB", "ideal", "unbounded hybrid", "ceiling", "ceiling-step", *peers,
            *[f"pagedkv {x}" for x in labels]]  # fmt: skip
    body = []
    for w, b in _order(result):
        cell, info = table[(w, b)], result["workloads"][w]
        body.append([w, f"{b / GiB:.2f}", f"{info['ideal']['page']:.4f}", f"{info['unbounded_hybrid']:.4f}",
                     _hit(cell.get(CEILING)), _hit(cell.get(CEILING_STEP)), *[_hit(cell.get(p)) for p in peers],
                     *[_hit(cell.get(m)) for _, m in cols]])  # fmt: skip
    lines += report.table(head, body)
    lines += ["", "### pagedkv / ceiling (target >= 0.9) and pagedkv - vLLM (hit-rate points, target > 0)", ""]
    head = ["workload", "budget GiB", *[f"/ceiling {x}" for x in labels]]
    head += [f"- vLLM {x}" for x in labels] if has_vllm else []
    body = []
    for w, b in _order(result):
        cell = table[(w, b)]
        mine = [cell.get(m) for _, m in cols]
        ratios = [_ratio(m, cell.get(CEILING)) for m in mine]
        peer = cell.get(VLLM)
        deltas = [f"{100 * (m['hit_rate'] - peer['hit_rate']):+.2f}" if _ran(m) and _ran(peer) else "-"
                  for m in mine] if has_vllm else []  # fmt: skip
        body.append([w, f"{b / GiB:.2f}", *ratios, *deltas])
    lines += report.table(head, body)
    lines += ["", "### What each budget buys (pages of 16 tokens; vLLM blocks of its own size), preemptions", ""]
    head = ["workload", "budget GiB", "ceiling pages", *([f"{VLLM} blocks"] if has_vllm else []),
            *[f"pagedkv {x} pages" for x in labels]]  # fmt: skip
    body = []
    for w, b in _order(result):
        cell = table[(w, b)]

        def pages(row: dict[str, Any] | None) -> str:
            if row is None or not _ran(row):
                return _hit(row)
            return f"{row['pages']} / {row['preemptions']}"

        body.append([w, f"{b / GiB:.2f}", pages(cell.get(CEILING)), *([pages(cell.get(VLLM))] if has_vllm else []),
                     *[pages(cell.get(m)) for _, m in cols]])  # fmt: skip
    lines += report.table(head, body)
    title = "### pagedkv's checkpoints: saved / restored (first admissions and re-admissions) / evicted (kept)"
    lines += ["", title, ""]
    body = []
    for w, b in _order(result):
        cell = table[(w, b)]

        def counts(row: dict[str, Any] | None) -> str:
            if row is None or not _ran(row):
                return _hit(row)
            kept = row.get("checkpoints_kept", "-")
            return f"{row['checkpoints_saved']} / {row['checkpoint_hits']} / {row['checkpoint_evictions']} ({kept})"

        body.append([w, f"{b / GiB:.2f}", *[counts(cell.get(m)) for _, m in cols]])
    lines += report.table(["workload", "budget GiB", *[f"pagedkv {x}" for x in labels]], body)
    row, page, ceil = sizes["state_row"], sizes["hybrid_page"], sizes["ceiling_page"]
    run = sizes.get("checkpoint_pages") or -(-row // page)
    lines += ["", f"State row (live state, and a checkpoint's content): {row:,} B = {row / page:.2f} hybrid attention "
              f"pages of {page:,} B ({row / ceil:.2f} ceiling pages of {ceil:,} B); a checkpoint takes a run of {run} "
              f"pages ({run * page:,} B); S = {s} live rows take {s * row / GiB:.2f} GiB of every budget."]  # fmt: skip
    v = verdict(result)
    lines += [
        "",
        f"Target for {v['manager']} (the default: max_state_checkpoints unset): "
        ">= 90% of the ceiling in every cell: "
        + ("met" if not v["below_90pct_of_ceiling"] else "missed at " + ", ".join(v["below_90pct_of_ceiling"])),
    ]
    if v["vllm_compared"]:
        lines.append(
            "Above vLLM in every cell: "
            + ("met" if not v["not_above_vllm"] else "missed at " + ", ".join(v["not_above_vllm"]))
        )
    for row in result["rows"]:
        if "stalled" in row:
            lines.append(
                f"\nStalled: {row['manager']} on {row['workload']} @ {row['budget_bytes'] / GiB:.2f} GiB: "
                f"{row['stalled']}"
            )
    for peer, why in result["skipped"].items():
        lines.append(f"\nSkipped {peer}: {why}")
    return "\n".join(lines) + "\n"


def plots(result: dict[str, Any]) -> list[report.Plot]:
    """Per workload: hit rate against the budget for every manager, the ideal as a line."""
    table, out = _cells(result), []
    for w in result["config"]["workloads"]:
        xs = sorted(b for (wl, b) in table if wl == w)
        names = list(dict.fromkeys(r["manager"] for r in result["rows"] if r["workload"] == w))
        series = {m: [table[(w, b)][m]["hit_rate"] if _ran(table[(w, b)].get(m)) else None for b in xs]
                  for m in names}  # fmt: skip
        out.append(report.Plot(f"state_prefix_{w}", w, "prefix hit rate", [round(b / GiB, 2) for b in xs], series,
                               kind="line", xlabel="budget (GiB)", dashed={CEILING, CEILING_STEP},
                               hline=(result["workloads"][w]["ideal"]["page"], "ideal (unbounded)")))  # fmt: skip
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `python -m benchmarks.compare.state_prefix` (--json and --plots come with every bench)."""
    p.add_argument(
        "--workloads", default=",".join(WORKLOADS), help="comma-separated workloads (pagedkv.workloads.traces)"
    )
    p.add_argument("--requests", type=int, default=1000, help="requests per workload")
    p.add_argument(
        "--fractions",
        default=",".join(map(str, FRACTIONS)),
        help="byte budgets, as fractions of the bytes the all-attention model's unbounded cache holds",
    )
    p.add_argument(
        "--max-seqs",
        type=int,
        default=MAX_NUM_SEQS,
        help="S: concurrent requests (the driver's max_num_seqs, pagedkv's max_batch_size: its live rows)",
    )
    p.add_argument(
        "--checkpoints",
        default=",".join(map(str, CHECKPOINT_MULTIPLES)),
        help="pagedkv's checkpoint caps C besides the default (2 per slot), as multiples of S (no cap is always run)",
    )
    p.add_argument("--peers", default=VLLM, help="peer managers to load ('' for none)")
    p.add_argument(
        "--eviction",
        default="lru",
        choices=list(EVICTION_POLICIES),
        help="pagedkv's eviction policy on the hybrid (attention pages and checkpoint rows)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the workloads")
    p.add_argument("--markdown", type=Path, help="also write the tables to this markdown file")
    p.add_argument("--from-json", type=Path, help="render the tables and plots of an earlier --json run")


def command(args: argparse.Namespace) -> int:
    """`python -m benchmarks.compare.state_prefix`: run the sweep (or read --from-json), print the tables, write the files."""
    if args.from_json:
        result = json.loads(args.from_json.read_text())
    else:
        with report.Progress("runs") as progress:
            result = run_state_prefix(
                workloads=[w for w in args.workloads.split(",") if w], num_requests=args.requests,
                fractions=[float(f) for f in args.fractions.split(",") if f],
                checkpoint_multiples=[float(c) for c in args.checkpoints.split(",") if c],
                max_num_seqs=args.max_seqs, peers=[p for p in args.peers.split(",") if p], seed=args.seed,
                eviction=args.eviction, progress=progress,
            )  # fmt: skip
    text = format_markdown(result)
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(text)
    report.finish(args, text, result, plots)
    return 0


if __name__ == "__main__":  # python -m benchmarks.compare.state_prefix
    import sys

    from benchmarks.command import main

    sys.exit(main("benchmarks.compare.state_prefix", sys.modules[__name__]))
