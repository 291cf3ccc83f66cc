"""`python -m benchmarks.compare`: every manager on every workload and capacity, side by side in one process.

For each workload (`traces`) the capacity sweeps from tight to ample as
fractions of the pages an unbounded cache would end up holding (never below
`floor_pages`). At each capacity the same driver (`sim.simulate`) replays the
trace through:

- pagedkv with each eviction policy (`POLICIES`);
- the peers, real vLLM and SGLang code, when importable (else reported skipped), and Modular MAX's
  own manager, replayed by a worker in MAX's environment (`peer_max.MaxWorker`: the same driver and
  timing, inside that process; reported skipped when that environment is missing);
- Belady's offline-optimal eviction on pagedkv's manager (two passes: the
  future is read from the previous pass's order of first admissions).

The garbage collector is frozen after setup, as vLLM's engine core does.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.compare.pagedkv_adapter import BeladyAdapter, PagedKVAdapter, PagedKVNoQueueAdapter, compare_params
from benchmarks.compare.peer_max import MaxWorker
from benchmarks.compare.peers import PeerUnavailable, load_peer
from benchmarks.compare.report import NO_QUEUE
from benchmarks.compare.sim import CacheAdapter, SimConfig, SimResult, simulate
from pagedkv.bench import timing
from pagedkv.bench.timing import gc_frozen
from pagedkv.params.validation import check_int
from pagedkv.workloads.traces import WORKLOADS, TraceRequest, decode_trace, ideal_hit_rates, make_trace, unique_pages

__all__ = [
    "DEFAULT_MANAGER",
    "POLICIES",
    "add_arguments",
    "command",
    "decode_costs",
    "hash_ns_per_token",
    "pagedkv_adapter",
    "run_compare",
]

# name -> KVCacheParams overrides of pagedkv's configurations
ON_ALLOC = {"commit_on_alloc": True}  # vLLM's schedule-time caching: same-step admissions share pages
DEFAULT_MANAGER = "pagedkv-lru"  # the row that runs KVCacheParams' defaults (the JSON's `config.default_manager`)
POLICIES: dict[str, dict[str, Any]] = {
    "pagedkv-lru": {},  # the defaults: LRU, pages hittable from the step that schedules them (commit_on_alloc)
    "pagedkv-lru-step": {"commit_on_alloc": False},  # pages hittable only once their step ran
    NO_QUEUE: {},  # the defaults under a scheduler that never calls `expect` (`PagedKVNoQueueAdapter`)
    "pagedkv-slru": {"eviction_policy": "slru", **ON_ALLOC},
    "pagedkv-lfu": {"eviction_policy": "lfu", **ON_ALLOC},
    "pagedkv-arc": {"eviction_policy": "arc", **ON_ALLOC},
    "pagedkv-lru-leaves": {"evict_leaves_first": True, **ON_ALLOC},
    "pagedkv-arc-partial": {"eviction_policy": "arc", "enable_partial_page_reuse": True, **ON_ALLOC},
}
FRACTIONS = (0.1, 0.2, 0.4, 1.0)

Progress = Callable[[int, int, str], None]  # (runs done, runs planned, what just ran)


def pagedkv_adapter(name: str, pages: int, page_size: int = 16) -> PagedKVAdapter:
    """The adapter of pagedkv configuration `name` (`POLICIES`; without `expect` calls for `NO_QUEUE`)."""
    cls = PagedKVNoQueueAdapter if name == NO_QUEUE else PagedKVAdapter
    return cls(name, compare_params(page_size, **POLICIES[name]), pages)


def _replay(adapter: CacheAdapter, trace: Sequence[TraceRequest], config: SimConfig) -> SimResult:
    with gc_frozen():
        return simulate(adapter, trace, config)


def _row(workload: str, pages: int, res: SimResult) -> dict[str, Any]:
    return {
        "workload": workload, "capacity_pages": pages, "manager": res.name, "hit_rate": res.hit_rate,
        "prefill_tokens_computed": res.prefill_tokens_computed, "preemptions": res.preemptions,
        "bookkeeping_us": res.bookkeeping_us, "request_steps": res.request_steps, "steps": res.steps,
        "seconds": dict(res.seconds), "peak_used_pages": res.peak_used_pages,
    }  # fmt: skip


def capacities(trace: list[TraceRequest], page_size: int, fractions: Sequence[float], floor_pages: int) -> list[int]:
    """Pool sizes for the sweep: `fractions` of the unbounded cache's pages, at least `floor_pages` and
    at least twice the longest request."""
    longest = max(-(-len(r.tokens) // page_size) for r in trace)
    total = unique_pages(trace, page_size)
    return sorted({max(floor_pages, 2 * longest, int(total * f)) for f in fractions})


def run_compare(
    workloads: Sequence[str] = tuple(WORKLOADS),
    num_requests: int = 1000,
    fractions: Sequence[float] = FRACTIONS,
    peers: Sequence[str] = ("vllm", "sglang", "max"),
    policies: Sequence[str] = tuple(POLICIES),
    belady: bool = True,
    page_size: int = 16,
    floor_pages: int = 1024,
    config: SimConfig | None = None,
    seed: int = 0,
    progress: Progress | None = None,
    repeats: int = 1,
) -> dict[str, Any]:
    """Run the sweep; returns {"rows", "ideal", "skipped", "hashing", "config"} (see `report`). With `repeats`
    > 1 every pagedkv configuration and peer replays each cell that many times, one after the other in turn,
    and its row is the replay with the least bookkeeping time (the counters and hit rates of every replay are
    the same: the replays are deterministic), so a burst of load on a shared machine does not decide a cell."""
    check_int("repeats", repeats, 1)
    config = config or SimConfig()
    rows: list[dict[str, Any]] = []
    planned = len(workloads) * len(fractions) * (len(policies) + len(peers) + int(belady))
    ticker = _Ticker(progress, planned)
    ideal: dict[str, dict[str, float]] = {}
    skipped: dict[str, str] = {}
    hashing: dict[str, dict[str, float]] = {}
    max_worker: list[MaxWorker] = []  # started at MAX's first replay, closed at the end
    for workload in workloads:
        trace = make_trace(workload, num_requests, seed)
        page_ideal, token_ideal = ideal_hit_rates(trace, page_size)
        ideal[workload] = {"page": page_ideal, "token": token_ideal}
        hashing[workload] = hash_ns_per_token(trace, page_size, peers, skipped)
        for pages in capacities(trace, page_size, fractions, floor_pages):
            best: dict[str, SimResult] = {}
            for _ in range(repeats):
                for name in policies:
                    _keep_best(best, _replay(pagedkv_adapter(name, pages, page_size), trace, config))
                for peer in peers:
                    if peer in skipped:
                        continue
                    try:
                        _keep_best(best, _replay_peer(peer, pages, page_size, config, trace, max_worker,
                                                      workload=workload, num_requests=num_requests, seed=seed))  # fmt: skip
                    except PeerUnavailable as exc:
                        skipped[peer] = str(exc)
            for name in (*policies, *peers):
                if name in best:
                    rows.append(_row(workload, pages, best[name]))
                ticker(workload, pages, best.get(name), "" if name in best else f"{name} skipped")
            order = best[policies[0]].first_admission_order if policies else []
            if belady:
                res = _belady(trace, pages, page_size, order, config)
                rows.append(_row(workload, pages, res))
                ticker(workload, pages, res)
    decode = decode_costs(peers, skipped, page_size, config, max_worker)
    for worker in max_worker:
        worker.close()
    return {
        "rows": rows, "ideal": ideal, "skipped": skipped, "hashing": hashing, "decode": decode,
        "config": {"workloads": list(workloads), "num_requests": num_requests, "fractions": list(fractions),
                   "page_size": page_size, "max_num_seqs": config.max_num_seqs,
                   "max_num_batched_tokens": config.max_num_batched_tokens, "seed": seed,
                   "default_manager": DEFAULT_MANAGER, "repeats": repeats},
    }  # fmt: skip


def _keep_best(best: dict[str, SimResult], res: SimResult) -> None:
    """Keep `res` as its manager's row unless an earlier replay spent less bookkeeping time."""
    if res.name not in best or res.bookkeeping_us < best[res.name].bookkeeping_us:
        best[res.name] = res


def _replay_peer(peer: str, pages: int, page_size: int, config: SimConfig, trace: Sequence[TraceRequest],
                 max_worker: list[MaxWorker], **workload: Any) -> SimResult:  # fmt: skip
    """One replay of `peer`: vLLM and SGLang in this process; MAX in its own environment, where the worker
    (started on first use into `max_worker`) replays and times it, rebuilding the trace from `workload`'s
    `make_trace` arguments when given, else receiving `trace`. Raises `PeerUnavailable`."""
    if peer != "max":
        return _replay(load_peer(peer, num_pages=pages, page_size=page_size), trace, config)
    max_worker[:] = max_worker or [MaxWorker()]
    if workload:
        return max_worker[0].replay(pages, page_size, config, **workload)
    return max_worker[0].replay(pages, page_size, config, trace=trace)


def _belady(trace: list[TraceRequest], pages: int, page_size: int, order: list[int], config: SimConfig) -> SimResult:
    """The better of two Belady passes (each reads the future from the previous pass's admission order)."""
    best: SimResult | None = None
    for _ in range(2):
        res = _replay(BeladyAdapter(compare_params(page_size), pages, trace, order), trace, config)
        order = res.first_admission_order
        if best is None or res.hit_rate > best.hit_rate:
            best = res
    assert best is not None
    return best


def decode_costs(peers: Sequence[str], skipped: dict[str, str], page_size: int, config: SimConfig,
                 max_worker: list[MaxWorker], repeats: int = 5) -> dict[str, float]:  # fmt: skip
    """Microseconds of manager calls per request of a plain decode step (one token, no page taken or filled):
    the defaults' row and each peer replay `decode_trace` (256 requests decoding together), timed by the
    driver (`SimConfig.page_size`), best of `repeats`. A missing peer is skipped (and noted in `skipped`)."""
    trace = decode_trace(page_size)
    pages = 4 * len(trace) * 3  # (ample: three pages a request)
    timed = dataclasses.replace(config, page_size=page_size)
    out: dict[str, float] = {}
    for name in (DEFAULT_MANAGER, *peers):
        if name in skipped:
            continue
        best = math.inf
        try:
            for _ in range(repeats):
                if name == DEFAULT_MANAGER:
                    res = _replay(pagedkv_adapter(name, pages, page_size), trace, timed)
                else:
                    res = _replay_peer(name, pages, page_size, timed, trace, max_worker)
                best = min(best, res.decode_us)
        except PeerUnavailable as exc:
            skipped[name] = str(exc)
            continue
        out[name] = best
    return out


class _Ticker:
    """Counts finished runs and tells `progress` about each."""

    def __init__(self, progress: Progress | None, planned: int) -> None:
        self.progress, self.planned, self.done = progress, planned, 0

    def __call__(self, workload: str, pages: int, res: SimResult | None, note: str = "") -> None:
        self.done += 1
        if self.progress is not None:
            what = note or (f"{res.name}: hit {res.hit_rate:.4f}, {res.bookkeeping_us:.2f} us/step" if res else "")
            self.progress(min(self.done, self.planned), self.planned, f"{workload} @ {pages} pages: {what}")


def hash_ns_per_token(trace: list[TraceRequest], page_size: int, peers: Sequence[str],
                      skipped: dict[str, str], repeats: int = 3) -> dict[str, float]:  # fmt: skip
    """Prompt hashing cost per token, best of `repeats` passes over every prompt of `trace`: pagedkv's
    chain (sha256 and xxh3_128, `timing.hash_ns_per_token`), the floor of its sha256 chain (the two
    `hashlib` calls a page, `timing.sha256_chain_floor_ns`) and vLLM's own block hasher when installed."""
    prompts = [r.tokens[: r.prompt_len] for r in trace]
    out = {f"pagedkv_{algo}": timing.hash_ns_per_token(prompts, page_size, algo, repeats, last_page=True)
           for algo in ("sha256", "xxh3_128")}  # fmt: skip
    out["sha256_chain_floor"] = timing.sha256_chain_floor_ns(prompts, page_size, repeats)
    if "vllm" in peers and "vllm" not in skipped:
        try:
            from benchmarks.compare.peer_vllm import vllm_hash_ns_per_token

            for name in ("sha256", "xxhash"):
                out[f"vllm_{name}"] = vllm_hash_ns_per_token(prompts, page_size, name)
        except (ImportError, PeerUnavailable) as exc:
            skipped["vllm"] = str(exc)
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `python -m benchmarks.compare` (--json and --plots come with every bench)."""
    p.add_argument(
        "--workloads", default=",".join(WORKLOADS), help="comma-separated workloads (pagedkv.workloads.traces)"
    )
    p.add_argument("--requests", type=int, default=1000, help="requests per workload")
    p.add_argument("--fractions", default=",".join(map(str, FRACTIONS)),
                   help="capacities, as fractions of the pages an unbounded cache would hold")  # fmt: skip
    p.add_argument("--peers", default="vllm,sglang,max",
                   help="peer managers to load ('' for none); max runs in $PAGEDKV_MAX_PYTHON or .venv-max")  # fmt: skip
    p.add_argument(
        "--policies", default=",".join(POLICIES), help="pagedkv configurations (POLICIES in benchmarks/compare/run.py)"
    )
    p.add_argument("--no-belady", action="store_true", help="skip the offline-optimal (Belady) bound")
    p.add_argument("--seed", type=int, default=0, help="seed of the workloads")
    p.add_argument("--repeats", type=int, default=1,
                   help="replays of each manager per cell, in turn; the least bookkeeping time is kept")  # fmt: skip
    p.add_argument("--markdown", type=Path, help="also write the tables to this markdown file")
    p.add_argument("--from-json", type=Path, help="render the tables and plots of an earlier --json run")


def command(args: argparse.Namespace) -> int:
    """`python -m benchmarks.compare`: run the sweep (or read --from-json), print the tables, write the files."""
    from benchmarks.compare.report import format_markdown, plots
    from pagedkv.bench import report

    if args.from_json:
        result = json.loads(args.from_json.read_text())
    else:
        with report.Progress("runs") as progress:
            result = run_compare(
                workloads=[w for w in args.workloads.split(",") if w], num_requests=args.requests,
                fractions=[float(f) for f in args.fractions.split(",") if f],
                peers=[p for p in args.peers.split(",") if p], policies=[p for p in args.policies.split(",") if p],
                belady=not args.no_belady, seed=args.seed, progress=progress, repeats=args.repeats,
            )  # fmt: skip
    text = format_markdown(result)
    if args.markdown:
        args.markdown.write_text(text)
    report.finish(args, text, result, plots)
    return 0
