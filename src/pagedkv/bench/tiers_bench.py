"""`pagedkv bench tiers`: each offload tier against its raw medium, and TTFT from a warm tier.

1. Throughput of offload and load per tier, as a ratio to the raw medium
   measured in the same run, on realistic pages (a Llama-3-8B-like page: bf16,
   32 layers, 8 KV heads x 128, page 16 = 2 MiB; and a Llama-3.2-1B-like one,
   16 layers, 8 x 64 = 512 KiB), in batches of `batch` pages:

   - host: `KVConnector` (host tier only) `offload` + `flush` / `load` between the
     page buffer and host rows, vs `torch` copies of the same pages (target >= 0.8);
   - disk: `DiskTier.store` + `wait` / `fetch` (one file per page, header and
     checksum, temp + rename, io threads) vs one file written / read sequentially
     with the same header bytes (target >= 0.8); no fsync on either side, so
     "load" reads the page cache and "load_cold" reads after both sides' files
     were written back and evicted from it;
   - redis: `RedisTier.store` + `wait` / `fetch` vs redis-py pipelined SET / GET of
     values of the same size, on a `redis-server` this bench starts (or `redis_url`)
     (target >= 0.7).

   Ours and raw alternate within each repeat (their order flips every repeat),
   and each side's figure is its best run, so a noisy machine slows both alike.
2. Time to first token of a fresh engine whose tier is warm vs one that
   recomputes (`pagedkv.bench.tiers_ttft`).
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from pagedkv.bench import report
from pagedkv.bench.tiers_cases import DiskCase, HostCase, TierCase
from pagedkv.dtype import DeviceRef, DType
from pagedkv.params.kv import KVCacheParams

__all__ = [
    "SHAPES",
    "TARGETS",
    "PageShape",
    "add_arguments",
    "command",
    "format_tiers_report",
    "measure",
    "plots",
    "run_tiers_bench",
]

GiB = 1024**3
TARGETS = {"host": 0.8, "disk": 0.8, "redis": 0.7}  # throughput ratio ours / raw, at least


@dataclass(frozen=True)
class PageShape:
    """The KV page of a model: bf16, K and V of every layer for `page_size` tokens."""

    label: str
    num_layers: int
    n_kv_heads: int
    head_dim: int
    page_size: int = 16

    def params(self) -> KVCacheParams:
        """Single-device CPU params of this page, prefix caching on."""
        return KVCacheParams(
            dtype=DType.bfloat16, n_kv_heads=self.n_kv_heads, head_dim=self.head_dim, num_layers=self.num_layers,
            devices=[DeviceRef.CPU()], page_size=self.page_size, enable_prefix_caching=True,
        )  # fmt: skip

    @property
    def row_bytes(self) -> int:
        """Bytes of one page."""
        return 2 * self.num_layers * self.page_size * self.n_kv_heads * self.head_dim * 2


SHAPES = {
    "llama3-8b": PageShape("Llama-3-8B-like (32 layers, 8 KV heads x 128)", 32, 8, 128),
    "llama3.2-1b": PageShape("Llama-3.2-1B-like (16 layers, 8 KV heads x 64)", 16, 8, 64),
}


def measure(case: TierCase, repeats: int) -> list[dict[str, Any]]:
    """Time every phase of `case` on every side, `repeats` times alternated, after one untimed warm-up
    repeat (it also checks what was loaded): one row per phase."""
    times: dict[tuple[str, str], list[float]] = {(p, s): [] for p in case.phases for s in case.sides}
    moved: dict[tuple[str, str], int] = {}
    verified = True
    gc.collect()
    gc.disable()  # no collection inside a timed run (one per repeat, untimed)
    try:
        for rep in range(repeats * case.repeat_factor + 1):
            case.begin()
            for phase in case.phases:
                for side in case.sides if rep % 2 == 0 else case.sides[::-1]:
                    case.prepare(phase, side)
                    start = time.perf_counter()
                    moved[phase, side] = case.run(phase, side)
                    if rep:  # the first repeat warms memory, files and connections up: untimed
                        times[phase, side].append(time.perf_counter() - start)
                    elif side == "ours" and phase != "offload":
                        verified = verified and case.verify()
            case.end()
            gc.collect()
    finally:
        gc.enable()
    rows = []
    for phase in case.phases:
        raw_sides = [s for s in case.sides if s != "ours"]
        best_raw = min(raw_sides, key=lambda s: min(times[phase, s]))
        ours_s, raw_s = min(times[phase, "ours"]), min(times[phase, best_raw])
        rows.append({
            "tier": case.tier, "phase": phase, "medium": case.medium, "pages": case.num_pages,
            "row_bytes": case.row_bytes, "batch": case.batch,
            "ours_gibps": moved[phase, "ours"] / ours_s / GiB, "raw_gibps": moved[phase, best_raw] / raw_s / GiB,
            "ratio": raw_s / ours_s, "target": TARGETS[case.tier], "raw_side": best_raw,
            "ours_bytes": moved[phase, "ours"], "raw_bytes": {s: moved[phase, s] for s in raw_sides},
            "ours_s": times[phase, "ours"], "raw_s": {s: times[phase, s] for s in raw_sides},
            "ours_median_s": statistics.median(times[phase, "ours"]),
            "raw_median_s": statistics.median(times[phase, best_raw]), "verified": verified,
        })  # fmt: skip
    return rows


def _cases(
    shape: PageShape, num_pages: int, batch: int, tiers: tuple[str, ...], work: Path, cold: bool, io_threads: int,
    redis_url: str | None,
) -> list[Callable[[], TierCase]]:  # fmt: skip
    """Constructors of the cases to run (built one at a time, so only one case's memory is held)."""
    makers: list[Callable[[], TierCase]] = []
    if "host" in tiers:
        makers.append(lambda: HostCase(shape.params(), num_pages, batch))
    if "disk" in tiers:
        makers.append(lambda: DiskCase(work, num_pages, shape.row_bytes, batch, cold=cold, io_threads=io_threads))
    if "redis" in tiers and redis_url is not None:
        from pagedkv.bench.tiers_redis import RedisCase

        makers.append(lambda: RedisCase(redis_url, num_pages, shape.row_bytes, batch, io_threads=io_threads))
    return makers


def run_tiers_bench(
    shapes: tuple[str, ...] = ("llama3-8b", "llama3.2-1b"), mib: int = 256, batch: int = 64, repeats: int = 5,
    tiers: tuple[str, ...] = ("host", "disk", "redis"), directory: str | None = None, redis_url: str | None = None,
    cold: bool = True, io_threads: int = 4, ttft: bool = True, ttft_options: dict[str, Any] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Every figure of the module docstring. `mib` of pages per pass and shape; `directory` holds the
    disk files (a temporary directory under it, removed afterwards; default: the system's temp dir)."""
    import torch

    result: dict[str, Any] = {
        "repeats": repeats, "batch": batch, "mib": mib, "io_threads": io_threads, "throughput": [], "skipped": [],
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__},
    }  # fmt: skip
    work = Path(tempfile.mkdtemp(prefix="pagedkv-bench-tiers-", dir=directory))
    server = None
    try:
        if "redis" in tiers or ttft:
            from pagedkv.bench.tiers_redis import redis_unavailable, start_redis

            why = redis_unavailable(redis_url)
            if why is not None:
                result["skipped"].append(f"redis rows skipped: {why}")
                redis_url = None
            elif redis_url is None:
                server = start_redis()
                redis_url = server.url
        result["redis"] = "skipped" if redis_url is None else "started" if server else _public(redis_url)
        for key in shapes:
            shape = SHAPES[key]
            num_pages = max(1, mib * 2**20 // shape.row_bytes)
            for make in _cases(shape, num_pages, batch, tiers, work, cold, io_threads, redis_url):
                case = make()
                try:
                    rows = measure(case, repeats)
                finally:
                    case.close()
                result["throughput"] += [{"shape": key, "label": shape.label, **row} for row in rows]
        if ttft:
            from pagedkv.bench.tiers_ttft import run_ttft

            result["ttft"] = run_ttft(work / "ttft", redis_url, **(ttft_options or {}))
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(work, ignore_errors=True)
    return result


def _public(url: str) -> str:
    """`url` without its credentials (the JSON report may be shared)."""
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))


def format_tiers_report(r: dict[str, Any]) -> str:
    """Markdown tables of the figures."""
    lines = [
        f"Tier throughput: GiB/s of page payload, best of {r['repeats']} alternated runs (host: {HostCase.repeat_factor * r['repeats']}) after "
        f"a warm-up run, batches of {r['batch']} "
        f"pages, {r['mib']} MiB per pass",
        "",
        "| page | tier | direction | pagedkv GiB/s | raw GiB/s | raw medium | pagedkv / raw | target |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for t in r["throughput"]:
        direction = {"offload": "offload", "load": "load (page cache)" if t["tier"] == "disk" else "load",
                     "load_cold": "load (cold: from disk)"}[t["phase"]]  # fmt: skip
        met = "met" if t["ratio"] >= t["target"] else "**miss**"
        lines.append(
            f"| {t['label']}, {t['row_bytes'] // 1024} KiB | {t['tier']} | {direction} | {t['ours_gibps']:.2f} | "
            f"{t['raw_gibps']:.2f} | {t['medium']} | {t['ratio']:.3f} | >= {t['target']} {met} |"
        )
    bad = [f"{t['shape']} {t['tier']} {t['phase']}" for t in r["throughput"] if not t["verified"]]
    lines += ["", f"Loaded pages equal the stored ones: {'yes' if not bad else 'NO: ' + ', '.join(bad)}"]
    lines += list(r["skipped"])
    if "ttft" in r:
        from pagedkv.bench.tiers_ttft import format_ttft_report

        lines += ["", format_ttft_report(r["ttft"])]
    return "\n".join(lines)


def plots(r: dict[str, Any]) -> list[report.Plot]:
    """Throughput of each tier and its raw medium; time to first token per engine when measured."""
    rows = r["throughput"]
    out = [report.Plot("tiers_throughput", "tier throughput vs the raw medium", "GiB/s of page payload",
                       [f"{t['shape']} {t['tier']} {t['phase']}" for t in rows],
                       {"pagedkv": [t["ours_gibps"] for t in rows], "raw": [t["raw_gibps"] for t in rows]})]  # fmt: skip
    if "ttft" in r:
        modes = r["ttft"]["modes"]
        out.append(report.Plot("tiers_ttft_ms", "time to first token, fresh engine", "ms", list(modes),
                               {"TTFT": [1e3 * m["ttft_mean_best"] for m in modes.values()],
                                "of which tier load": [1e3 * m["load_mean"] for m in modes.values()]}))  # fmt: skip
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `pagedkv bench tiers`."""
    p.add_argument("--shapes", default="llama3-8b,llama3.2-1b", help=f"page shapes, of {', '.join(SHAPES)}")
    p.add_argument("--tiers", default="host,disk,redis", help="which tiers to measure (comma-separated)")
    p.add_argument("--mib", type=int, default=256, help="MiB of pages moved per pass, per shape")
    p.add_argument("--batch", type=int, default=64, help="pages per offload / load call")
    p.add_argument("--repeats", type=int, default=5, help="alternated runs; the best of each side is kept")
    p.add_argument("--io-threads", type=int, default=4, help="disk / Redis tier threads (KVConnectorConfig)")
    p.add_argument("--dir", help="directory for the disk files (default: the system's temp directory)")
    p.add_argument("--redis-url", help="use this Redis server instead of starting redis-server")
    p.add_argument("--no-cold", action="store_true", help="skip the disk reads after dropping the page cache")
    p.add_argument("--no-ttft", action="store_true", help="skip the time-to-first-token part")
    p.add_argument("--ttft-prompts", type=int, default=4, help="prompts served one at a time in the TTFT part")
    p.add_argument("--ttft-prompt-len", type=int, default=1024, help="tokens per TTFT prompt")
    p.add_argument("--ttft-repeats", type=int, default=3, help="alternated TTFT runs; the best is kept")
    p.add_argument("--ttft-hidden", type=int, default=512, help="hidden size of the TTFT model")
    p.add_argument("--ttft-layers", type=int, default=8, help="layers of the TTFT model")


def command(args: argparse.Namespace) -> int:
    """`pagedkv bench tiers`: measure, print the tables, write --json / --plots."""
    ttft_options = dict(num_prompts=args.ttft_prompts, prompt_len=args.ttft_prompt_len,
                        repeats=args.ttft_repeats, hidden=args.ttft_hidden, layers=args.ttft_layers)  # fmt: skip
    result = run_tiers_bench(
        shapes=tuple(args.shapes.split(",")), mib=args.mib, batch=args.batch, repeats=args.repeats,
        tiers=tuple(args.tiers.split(",")), directory=args.dir, redis_url=args.redis_url, cold=not args.no_cold,
        io_threads=args.io_threads, ttft=not args.no_ttft, ttft_options=ttft_options,
    )  # fmt: skip
    report.finish(args, format_tiers_report(result), result, plots)
    return 0
