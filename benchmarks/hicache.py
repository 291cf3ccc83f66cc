"""`python -m benchmarks.hicache`: `PagedKVStorage` (SGLang HiCache L3 backend) against the raw medium, side by side.

Runs where SGLang imports (``.venv-peers``). The pages live in SGLang's own `MHATokenToKVPoolHost`
(CPU, not pinned), Llama-3.1-8B-shaped by default: bf16, 32 layers, 8 KV heads x 128, 16 tokens per
page = 2 MiB per page (K and V). `pages` page keys map onto a host pool of `pool_pages` pages
(key i -> host page i mod pool_pages), so a few thousand pages fit in memory; SGLang's controller
calls the backend `batch` (128, its STORAGE_BATCH_SIZE) pages at a time, and so does this bench.
Per medium, pages per second each way:

- redis: ours = ``batch_set_v1`` / ``batch_get_v1`` (zero-copy, interface_v1) on a `redis-server` this
  bench starts (or ``--redis-url``); raw = redis-py pipelined SET / GET of the same bytes (header +
  page, built before the clock starts), one pipeline per batch on one connection; the raw GET only
  receives the values, ours also checks them and copies them into the host pool.
- disk: ours with ``disk_offload_dir``; raw = the same bytes written / read sequentially, one file per page
  (write, close; read into one buffer per host page, the same memory ours reads into); SGLang's `HiCacheFile` through the calls its controller
  makes for it (legacy ``batch_set`` of ``get_data_page`` / ``batch_get`` of dummy flat pages, then
  ``set_from_flat_data_page``). No fsync anywhere: the disk rows measure the page cache.

Each repeat runs every side once per direction (set, then get), in an order that rotates per repeat;
the medium is emptied before each set and after each get (not timed), and each figure is the side's
best repeat. Target: ours >= 0.7 of the raw medium (`TARGET`).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

from pagedkv.bench import report

__all__ = ["TARGET", "add_arguments", "command", "format_hicache_report", "run_hicache_bench"]

TARGET = 0.7  # ours / raw medium, pages per second, each way
LAYERS, KV_HEADS, HEAD_DIM = 32, 8, 128  # Llama-3.1-8B, bf16
SHAPE: dict[str, Any] = {"layers": LAYERS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "dtype": "bfloat16"}


def _keys(n: int) -> list[str]:
    return [hashlib.sha256(f"pagedkv-bench-hicache-{i}".encode()).hexdigest() for i in range(n)]


class _Setup:
    """SGLang's host pool (filled with random bits), page keys, and host slots per batch."""

    def __init__(self, pages: int, page_tokens: int, pool_pages: int, batch: int, layout: str) -> None:
        from benchmarks.compare.peers import import_peer

        def load() -> Any:
            from sglang.srt.mem_cache import hicache_storage
            from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
            from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
            from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

            return hicache_storage, MHATokenToKVPool, MHATokenToKVPoolHost, host_memory_budget_scope

        import torch

        # SGLang refuses a host pool that would leave less than 10 GB of the machine free; this bench
        # books exactly its pool instead (it is small: `pool_pages` pages)
        self.storage, device_cls, host_cls, budget = import_peer("sglang", load)
        tokens = pool_pages * page_tokens // 2
        device = device_cls(tokens, page_tokens, torch.bfloat16, KV_HEADS, HEAD_DIM, LAYERS, "cpu", False,
                            start_layer=0, end_layer=LAYERS)  # fmt: skip
        with budget(4 * tokens * 2 * LAYERS * KV_HEADS * HEAD_DIM * 2):
            self.pool = host_cls(device.get_device_pool_infos()[0].buffer_info, 2.0, 0, page_tokens, layout,
                                 pin_memory=False, device="cpu", device_capacity_tokens=device.size, start_layer=0,
                                 end_layer=LAYERS)  # fmt: skip
        del device
        raw = self.pool.kv_buffer.view(torch.uint8).view(-1)
        gen = torch.Generator().manual_seed(0)
        for lo in range(0, raw.numel(), 1 << 26):
            chunk = raw[lo : lo + (1 << 26)]
            chunk.copy_(torch.randint(0, 256, chunk.shape, dtype=torch.uint8, generator=gen))
        self.page_tokens, self.batch, self.layout = page_tokens, batch, layout
        self.pool_pages = min(pool_pages, self.pool.page_num)
        self.keys = _keys(pages)
        self.host_page = [i % self.pool_pages for i in range(pages)]
        self.batches = [range(lo, min(lo + batch, pages)) for lo in range(0, pages, batch)]
        self.slots = [torch.tensor([self.host_page[i] * page_tokens + t for i in part for t in range(page_tokens)])
                      for part in self.batches]  # fmt: skip

    def config(self, extra: dict[str, Any]) -> Any:
        return self.storage.HiCacheStorageConfig(
            tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
            enable_storage_metrics=False, is_page_first_layout=self.layout == "page_first",
            model_name="meta-llama/Llama-3.1-8B", extra_config=extra,
        )  # fmt: skip


class _Ours:
    """`PagedKVStorage` through its zero-copy calls."""

    def __init__(self, setup: _Setup, extra: dict[str, Any]) -> None:
        from pagedkv.integrations.sglang.storage import PagedKVStorage

        self.setup = setup
        self.store = PagedKVStorage(setup.config({"interface_v1": 1, **extra}), {})
        self.store.register_mem_pool_host(setup.pool)
        self.row_bytes = self.store.pages.row_bytes  # type: ignore[union-attr]

    def set(self) -> int:
        s = self.setup
        return sum(sum(self.store.batch_set_v1([s.keys[i] for i in part], slots))
                   for part, slots in zip(s.batches, s.slots, strict=True))  # fmt: skip

    def get(self) -> int:
        s = self.setup
        return sum(sum(self.store.batch_get_v1([s.keys[i] for i in part], slots))
                   for part, slots in zip(s.batches, s.slots, strict=True))  # fmt: skip

    def clear(self) -> None:
        self.store.clear()

    def close(self) -> None:
        self.store.close()


def _values_of(setup: _Setup, row_bytes: int) -> list[bytes]:
    import torch

    from pagedkv.offload.format import encode_header, layout_fingerprint

    fp, out = layout_fingerprint(["bench"]), []
    for page in range(setup.pool_pages):
        payload = setup.pool.get_data_page(page * setup.page_tokens).contiguous().view(-1).view(torch.uint8)
        data = payload.numpy().tobytes()
        assert len(data) == row_bytes
        out.append(encode_header(bytes(32), data, fp, "sha256") + data)
    return out


class _RawRedis:
    """redis-py pipelined SET / GET of the same bytes (header + page), one connection."""

    def __init__(self, setup: _Setup, url: str, row_bytes: int) -> None:
        import redis

        self.setup, self.client = setup, redis.Redis.from_url(url)
        self.names = [f"pagedkv-bench-raw:{k}" for k in setup.keys]
        self.values = _values_of(setup, row_bytes)

    def set(self) -> int:
        s, done = self.setup, 0
        for part in s.batches:
            with self.client.pipeline(transaction=False) as pipe:
                for i in part:
                    pipe.set(self.names[i], self.values[s.host_page[i]])
                done += sum(1 for ok in pipe.execute() if ok)
        return done

    def get(self) -> int:
        done = 0
        for part in self.setup.batches:
            with self.client.pipeline(transaction=False) as pipe:
                for i in part:
                    pipe.get(self.names[i])
                done += sum(1 for v in pipe.execute() if v is not None)
        return done

    def clear(self) -> None:
        for lo in range(0, len(self.names), 512):
            self.client.unlink(*self.names[lo : lo + 512])

    def close(self) -> None:
        self.clear()
        self.client.close()


class _RawFiles:
    """The same bytes, one file per page, written and read sequentially."""

    def __init__(self, setup: _Setup, directory: str, row_bytes: int) -> None:
        self.setup, self.dir = setup, directory
        self.values = _values_of(setup, row_bytes)
        self.paths = [os.path.join(directory, f"{k}.page") for k in setup.keys]
        # read into one buffer per host page, as ours reads into the pool (not one cache-hot buffer)
        self.buffers = [memoryview(bytearray(len(v))) for v in self.values]
        os.makedirs(directory, exist_ok=True)

    def set(self) -> int:
        for i, path in enumerate(self.paths):
            with open(path, "wb", buffering=0) as f:
                f.write(self.values[self.setup.host_page[i]])
        return len(self.paths)

    def get(self) -> int:
        done, host_page = 0, self.setup.host_page
        for i, path in enumerate(self.paths):
            buffer = self.buffers[host_page[i]]
            with open(path, "rb", buffering=0) as f:
                done += f.readinto(buffer) == len(buffer)
        return done

    def clear(self) -> None:
        for path in self.paths:
            if os.path.exists(path):
                os.unlink(path)

    def close(self) -> None:
        self.clear()


class _HiCacheFile:
    """SGLang's `HiCacheFile`, called as its controller calls a non-zero-copy backend."""

    def __init__(self, setup: _Setup, directory: str) -> None:
        self.setup = setup
        self.store = setup.storage.HiCacheFile(setup.config({"file_storage_path": directory}))
        self.store.register_mem_pool_host(setup.pool)

    def set(self) -> int:
        s, done = self.setup, 0
        for part in s.batches:
            data = [s.pool.get_data_page(s.host_page[i] * s.page_tokens) for i in part]
            done += len(part) if self.store.batch_set([s.keys[i] for i in part], data) else 0
        return done

    def get(self) -> int:
        s, done = self.setup, 0
        for part in s.batches:
            flats = self.store.batch_get([s.keys[i] for i in part], [s.pool.get_dummy_flat_data_page() for _ in part])
            for i, page in zip(part, flats, strict=True):
                if page is not None:
                    s.pool.set_from_flat_data_page(s.host_page[i] * s.page_tokens, page)
                    done += 1
        return done

    def clear(self) -> None:
        self.store.clear()

    def close(self) -> None:
        self.clear()


def _measure(sides: dict[str, Any], pages: int, repeats: int, progress: Callable[[str], None]) -> dict[str, Any]:
    best: dict[str, dict[str, float]] = {name: {"set": 0.0, "get": 0.0} for name in sides}
    names = list(sides)
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            side = sides[name]
            side.clear()
            for op in ("set", "get"):
                start = time.perf_counter()
                moved = getattr(side, op)()
                seconds = time.perf_counter() - start
                if moved != pages:
                    raise RuntimeError(f"{name} {op}: {moved} of {pages} pages")
                best[name][op] = max(best[name][op], pages / seconds)
            side.clear()
            progress(f"{name} repeat {r + 1}")
    return best


def run_hicache_bench(*, pages: int = 2048, page_tokens: int = 16, pool_pages: int = 256, batch: int = 128,
                      repeats: int = 3, layout: str = "page_first", media: tuple[str, ...] = ("redis", "disk"),
                      redis_url: str | None = None, directory: str | None = None, io_threads: int = 4,
                      progress: Callable[[str], None] = lambda note: None) -> dict[str, Any]:  # fmt: skip
    """Measure every side of every medium; the JSON-able result (see the module docstring)."""
    setup = _Setup(pages, page_tokens, pool_pages, batch, layout)
    row_bytes = 2 * LAYERS * KV_HEADS * HEAD_DIM * 2 * page_tokens
    result: dict[str, Any] = {
        "shape": {**SHAPE, "page_tokens": page_tokens, "page_bytes": row_bytes, "layout": layout},
        "pages": pages, "pool_pages": setup.pool_pages, "batch": batch, "repeats": repeats, "io_threads": io_threads,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores", "target": TARGET, "rows": [],
    }  # fmt: skip
    if "redis" in media:
        server = None
        if redis_url is None:
            from pagedkv.bench.tiers_redis import start_redis

            server = start_redis()
            redis_url = server.url
        try:
            ours = _Ours(
                setup, {"redis_url": redis_url, "io_threads": io_threads, "redis_key_prefix": "pagedkv-bench:"}
            )
            sides: dict[str, Any] = {
                "pagedkv (Redis)": ours,
                "raw redis-py pipelined SET/GET": _RawRedis(setup, redis_url, row_bytes),
            }
            _rows(result, "redis", _measure(sides, pages, repeats, progress), "raw redis-py pipelined SET/GET")
            for side in sides.values():
                side.close()
        finally:
            if server is not None:
                server.stop()
    if "disk" in media:
        root = tempfile.mkdtemp(prefix="pagedkv-bench-hicache-", dir=directory)
        try:
            sides = {
                "pagedkv (directory)": _Ours(setup, {"disk_offload_dir": os.path.join(root, "ours"), "io_threads": io_threads,
                                                     "disk_offload_max_gb": 2 * pages * row_bytes / 2**30}),
                "raw files, sequential": _RawFiles(setup, os.path.join(root, "raw"), row_bytes),
                "SGLang HiCacheFile": _HiCacheFile(setup, os.path.join(root, "hicachefile")),
            }  # fmt: skip
            _rows(result, "disk", _measure(sides, pages, repeats, progress), "raw files, sequential")
            for side in sides.values():
                side.close()
        finally:
            shutil.rmtree(root, ignore_errors=True)
    return result


def _rows(result: dict[str, Any], medium: str, best: dict[str, dict[str, float]], raw: str) -> None:
    for name, rates in best.items():
        result["rows"].append({
            "medium": medium, "backend": name, "set_pages_s": rates["set"], "get_pages_s": rates["get"],
            "set_ratio": rates["set"] / best[raw]["set"], "get_ratio": rates["get"] / best[raw]["get"],
        })  # fmt: skip


def format_hicache_report(result: dict[str, Any]) -> str:
    """The markdown table of `run_hicache_bench`'s result."""
    shape = result["shape"]
    mib = shape["page_bytes"] / 2**20
    lines = [
        f"SGLang HiCache storage, {result['pages']} pages of {mib:g} MiB (bf16, {shape['layers']} layers, "
        f"{shape['kv_heads']} KV heads x {shape['head_dim']}, {shape['page_tokens']} tokens; host layout "
        f"{shape['layout']}), batches of {result['batch']}, best of {result['repeats']}; {result['machine']}",
        "",
        *report.table(
            ["medium", "backend", "set pages/s", "get pages/s", "set GiB/s", "get GiB/s", "set / raw", "get / raw"],
            [
                [
                    r["medium"],
                    r["backend"],
                    f"{r['set_pages_s']:.0f}",
                    f"{r['get_pages_s']:.0f}",
                    f"{r['set_pages_s'] * mib / 1024:.2f}",
                    f"{r['get_pages_s'] * mib / 1024:.2f}",
                    f"{r['set_ratio']:.2f}",
                    f"{r['get_ratio']:.2f}",
                ]
                for r in result["rows"]
            ],
        ),  # fmt: skip
        "",
        f"target: pagedkv >= {result['target']} of the raw medium each way",
    ]
    return "\n".join(lines)


def plots(result: dict[str, Any]) -> list[report.Plot]:
    """Pages per second of every side, each way."""
    rows = result["rows"]
    return [report.Plot("hicache_pages_per_s", "SGLang HiCache storage: pages per second", "pages/s",
                        [f"{r['medium']}: {r['backend']}" for r in rows],
                        {"set": [r["set_pages_s"] for r in rows], "get": [r["get_pages_s"] for r in rows]})]  # fmt: skip


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `python -m benchmarks.hicache`."""
    p.add_argument("--pages", type=int, default=2048, help="page keys written and read per pass")
    p.add_argument("--page-tokens", type=int, default=16, help="tokens per page (16: 2 MiB pages)")
    p.add_argument("--pool-pages", type=int, default=256, help="host pool pages the keys map onto (memory)")
    p.add_argument("--batch", type=int, default=128, help="pages per backend call (SGLang's STORAGE_BATCH_SIZE)")
    p.add_argument("--repeats", type=int, default=3, help="rotated runs; each side's best is kept")
    p.add_argument("--layout", default="page_first", choices=["page_first", "page_first_direct"],
                   help="host pool layout (--hicache-mem-layout)")  # fmt: skip
    p.add_argument("--media", default="redis,disk", help="which media to measure (comma-separated)")
    p.add_argument("--io-threads", type=int, default=4, help="pagedkv tier threads (extra_config io_threads)")
    p.add_argument("--redis-url", help="use this Redis server instead of starting redis-server")
    p.add_argument("--dir", help="parent directory of the disk files (default: the system's temp directory)")


def command(args: argparse.Namespace) -> int:
    """`python -m benchmarks.hicache`: measure, print the table, write --json / --plots (needs SGLang)."""
    from benchmarks.compare.peers import PeerUnavailable

    with report.Progress("runs") as bar:
        count = [0]

        def progress(note: str) -> None:
            count[0] += 1
            bar(count[0], 0, note)

        try:
            result = run_hicache_bench(
                pages=args.pages, page_tokens=args.page_tokens, pool_pages=args.pool_pages, batch=args.batch,
                repeats=args.repeats, layout=args.layout, media=tuple(args.media.split(",")),
                redis_url=args.redis_url, directory=args.dir, io_threads=args.io_threads, progress=progress,
            )  # fmt: skip
        except PeerUnavailable as exc:
            print(f"python -m benchmarks.hicache: {exc} (run it in the environment of `make peers`)")
            return 2
    report.finish(args, format_hicache_report(result), result, plots)
    return 0


if __name__ == "__main__":  # python -m benchmarks.hicache
    import sys

    from benchmarks.command import main

    sys.exit(main("benchmarks.hicache", sys.modules[__name__]))
