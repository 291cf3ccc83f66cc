"""`python -m benchmarks.connector`: vLLM blocks per second through `PagedKVConnector`'s worker side vs the raw medium.

Runs where vLLM 0.33 imports (``.venv-peers``). The model is Llama-3-8B-like,
one TP rank: 32 layers, 8 KV heads x 128, block 16, bf16, so one block of every
layer is 2 MiB (the stored page). The KV cache is vLLM's own allocation
(`allocate_kv_cache`, layout LBHNC as on vLLM's CPU backend), and the connector
is loaded by vLLM's `KVConnectorFactory`. Per pass, `blocks` blocks move in
engine steps of `batch` blocks:

- save: ``bind_connector_metadata`` + ``wait_for_save`` per step (gather from the KV
  views into staging rows with header room, handed to the tier's threads, which seal
  the header in place and write each page as one buffer), then the wait for every write;
- load: ``start_load_kv`` per step (each page read straight into its block's layer
  slices and checked there), with ``get_block_ids_with_load_errors`` empty;

against the raw medium in the same run (`connector_cases.ConnectorCase`): redis-py
pipelined SET / GET of values of the same size on a `redis-server` this bench
starts (or ``--redis-url``), and one file written / read sequentially. Ours and raw
alternate within each repeat and each side keeps its best run (`tiers_bench.measure`).
LMCache is measured when it imports (it needs CUDA builds; otherwise the report says why).
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import tempfile
from pathlib import Path
from typing import Any

from pagedkv.bench import report

__all__ = ["SHAPE", "TARGET", "add_arguments", "command", "format_connector_report", "run_connector_bench"]

TARGET = 0.7  # blocks/s of ours / raw, at least
SHAPE: dict[str, Any] = {"label": "Llama-3-8B-like: 32 layers, 8 KV heads x 128, block 16, bf16, 1 TP rank", "layers": 32,
         "kv_heads": 8, "head_dim": 128, "block": 16}  # fmt: skip


def lmcache_unavailable() -> str:
    """Why LMCache is not measured here."""
    try:
        import lmcache  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means it cannot run here
        return f"LMCache is not measured: it does not import here ({type(exc).__name__}: {exc})"
    return ("LMCache imports, but is not measured: its vLLM adapter moves KV with CUDA kernels "
            "(lmcache.c_ops), which this CPU-only machine cannot run")  # fmt: skip


def run_connector_bench(
    blocks: int = 2048, kv_blocks: int = 513, batch: int = 64, repeats: int = 3, tiers: tuple[str, ...] = ("redis", "disk"),
    redis_url: str | None = None, directory: str | None = None, io_threads: int = 4,
) -> dict[str, Any]:  # fmt: skip
    """Every figure of the module docstring, one row per tier and direction."""
    import torch

    from benchmarks.connector_cases import ConnectorCase, worker_connector
    from pagedkv.bench.tiers_bench import GiB, measure

    row_bytes = 2 * SHAPE["layers"] * SHAPE["kv_heads"] * SHAPE["head_dim"] * SHAPE["block"] * 2
    result: dict[str, Any] = {
        "shape": SHAPE, "row_bytes": row_bytes, "blocks": blocks, "kv_blocks": kv_blocks, "batch": batch,
        "repeats": repeats, "io_threads": io_threads, "rows": [], "skipped": [], "lmcache": lmcache_unavailable(),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__},
    }  # fmt: skip
    work = Path(tempfile.mkdtemp(prefix="pagedkv-bench-connector-", dir=directory))
    server = None
    try:
        if "redis" in tiers:
            from pagedkv.bench.tiers_redis import redis_unavailable, start_redis

            why = redis_unavailable(redis_url)
            if why is not None:
                result["skipped"].append(f"redis rows skipped: {why}")
            elif redis_url is None:
                server = start_redis()
                redis_url = server.url
        for tier in tiers:
            if tier == "redis" and redis_url is None:
                continue
            prefix = f"pagedkv-bench-{os.getpid()}:"
            extra: dict[str, Any] = {"io_threads": io_threads}
            extra.update({"redis_url": redis_url, "redis_key_prefix": prefix} if tier == "redis" else
                         {"disk_offload_dir": str(work / "tier")})  # fmt: skip
            worker, caches = worker_connector(SHAPE["layers"], SHAPE["kv_heads"], SHAPE["head_dim"], SHAPE["block"],
                                              kv_blocks, extra)  # fmt: skip
            case = ConnectorCase(tier, worker, caches, blocks, batch, redis_url=redis_url, directory=work)
            try:
                rows = measure(case, repeats)
            finally:
                case.close()
                del case, caches, worker
            for row in rows:
                row["target"] = TARGET
                row["ours_blocks_per_s"] = row["ours_gibps"] * GiB / row_bytes
                row["raw_blocks_per_s"] = row["raw_gibps"] * GiB / row_bytes
            result["rows"] += rows
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(work, ignore_errors=True)
    return result


def format_connector_report(r: dict[str, Any]) -> str:
    """The markdown table of the figures."""
    lines = [
        f"{r['shape']['label']}: one block = {r['row_bytes'] // 2**20} MiB; {r['blocks']} blocks per pass in steps "
        f"of {r['batch']}, best of {r['repeats']} alternated runs after a warm-up run",
        "",
        *report.table(
            [
                "tier",
                "direction",
                "pagedkv blocks/s",
                "pagedkv GiB/s",
                "raw blocks/s",
                "raw medium",
                "pagedkv / raw",
                "target",
            ],
            [
                [
                    t["tier"],
                    "save" if t["phase"] == "offload" else "load",
                    f"{t['ours_blocks_per_s']:.0f}",
                    f"{t['ours_gibps']:.2f}",
                    f"{t['raw_blocks_per_s']:.0f}",
                    t["medium"],
                    f"{t['ratio']:.2f}",
                    f">= {t['target']} {'met' if t['ratio'] >= t['target'] else '**miss**'}",
                ]
                for t in r["rows"]
            ],
        ),  # fmt: skip
    ]
    bad = [f"{t['tier']} {t['phase']}" for t in r["rows"] if not t["verified"]]
    lines += ["", f"Loaded blocks equal the saved ones: {'yes' if not bad else 'NO: ' + ', '.join(bad)}"]
    lines += [*r["skipped"], r["lmcache"]]
    return "\n".join(lines)


def plots(r: dict[str, Any]) -> list[report.Plot]:
    """Blocks per second of the connector and of the raw medium, per tier and direction."""
    rows = r["rows"]
    x = [f"{t['tier']} {'save' if t['phase'] == 'offload' else 'load'}" for t in rows]
    series = {"pagedkv": [t["ours_blocks_per_s"] for t in rows], "raw": [t["raw_blocks_per_s"] for t in rows]}
    return [report.Plot("connector_blocks_per_s", "vLLM connector vs the raw medium", "blocks/s", x, series)]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `python -m benchmarks.connector`."""
    p.add_argument("--blocks", type=int, default=2048, help="blocks (2 MiB each) moved per pass")
    p.add_argument(
        "--kv-blocks", type=int, default=513, help="blocks of the vLLM KV cache (block 0 is vLLM's null block)"
    )
    p.add_argument("--batch", type=int, default=64, help="blocks per engine step")
    p.add_argument("--repeats", type=int, default=3, help="alternated runs; the best of each side is kept")
    p.add_argument("--tiers", default="redis,disk", help="which tiers to measure (comma-separated)")
    p.add_argument("--io-threads", type=int, default=4, help="tier threads (the connector's io_threads)")
    p.add_argument("--dir", help="directory for the disk files (default: the system's temp directory)")
    p.add_argument("--redis-url", help="use this Redis server instead of starting redis-server")


def command(args: argparse.Namespace) -> int:
    """`python -m benchmarks.connector`: measure, print the table, write --json / --plots."""
    result = run_connector_bench(
        blocks=args.blocks, kv_blocks=args.kv_blocks, batch=args.batch, repeats=args.repeats,
        tiers=tuple(args.tiers.split(",")), redis_url=args.redis_url, directory=args.dir, io_threads=args.io_threads,
    )  # fmt: skip
    report.finish(args, format_connector_report(result), result, plots)
    return 0


if __name__ == "__main__":  # python -m benchmarks.connector
    import sys

    from benchmarks.command import main

    sys.exit(main("benchmarks.connector", sys.modules[__name__]))
