"""The Redis case of `pagedkv bench tiers`, and the `redis-server` the bench starts for it.

Ours: `RedisTier.store` + `wait` / `RedisTier.fetch` into host rows. Raw:
redis-py pipelined SET / GET of values of the same size (80-byte header +
row, built before the clock starts), one pipeline per batch of pages, on one
connection; the raw GET only receives the values (no copy into rows).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from importlib.util import find_spec
from typing import Any

import torch

from pagedkv.bench.tiers_cases import FINGERPRINT, HASH_ALGO, DiskTierCase
from pagedkv.offload.format import HEADER_SIZE
from pagedkv.params.connector import KVConnectorConfig

__all__ = ["RedisCase", "RedisServer", "redis_unavailable", "start_redis"]


def redis_unavailable(url: str | None) -> str | None:
    """Why the Redis rows cannot run (None when they can): redis-py, the tier, a server."""
    if find_spec("redis") is None:
        return "redis-py is not installed (pip install redis)"
    if find_spec("pagedkv.offload.redis_tier") is None:
        return "pagedkv.offload.redis_tier is missing"
    if url is None and shutil.which("redis-server") is None:
        return "redis-server is not installed and no --redis-url was given"
    return None


@dataclass
class RedisServer:
    """A `redis-server` subprocess on a free loopback port, without persistence."""

    proc: subprocess.Popen[bytes]
    port: int

    @property
    def url(self) -> str:
        """Its ``redis://`` URL."""
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        """Terminate the server and wait for it."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_redis(timeout: float = 10.0) -> RedisServer:
    """Start ``redis-server --port <free> --save '' --appendonly no`` and wait until it answers PING."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    binary = shutil.which("redis-server")
    assert binary is not None
    cmd = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    server = RedisServer(proc, port)
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as conn:
                conn.sendall(b"PING\r\n")
                if conn.recv(64).startswith(b"+PONG"):
                    return server
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            server.stop()
            raise RuntimeError(f"redis-server did not start: {cmd}")
        time.sleep(0.02)


class RedisCase(DiskTierCase):
    """`RedisTier` vs redis-py pipelined SET / GET, under a key prefix of this run (removed at the end)."""

    tier, medium = "redis", "redis-py pipelined SET / GET, same-size values"

    def __init__(self, url: str, num_pages: int, row_bytes: int, batch: int, *, io_threads: int = 4,
                 seed: int = 0) -> None:  # fmt: skip
        import redis

        from pagedkv.offload.redis_tier import RedisTier

        super().__init__(num_pages, row_bytes, batch, seed)
        prefix = f"pagedkv-bench-{os.getpid()}-{os.urandom(4).hex()}:"
        config = KVConnectorConfig(redis_url=url, redis_key_prefix=prefix, io_threads=io_threads)
        self.redis = RedisTier(config, row_bytes, FINGERPRINT, HASH_ALGO)
        self.client: Any = redis.Redis.from_url(url)
        self.raw_prefix = f"{prefix}raw:"
        self.values = torch.empty((num_pages, HEADER_SIZE + row_bytes), dtype=torch.uint8)  # [N, header + row]
        self.values[:, HEADER_SIZE:] = self.src
        self.value_views = [memoryview(v) for v in self.values.numpy()]
        self.raw_keys: list[str] = []

    def begin(self) -> None:
        super().begin()
        for view, header in zip(self.value_views, self.headers, strict=True):
            view[:HEADER_SIZE] = header
        self.raw_keys = [f"{self.raw_prefix}{k.hex()}" for k in self.keys]

    def run(self, phase: str, side: str) -> int:
        if side == "ours" and phase == "offload":
            before = self.redis.stats.bytes_stored
            for part in self.batches():
                self.redis.store(self.keys[part.start : part.stop], self.src_views[part.start : part.stop], _ignore)
            self.redis.wait()
            if self.redis.stats.errors:
                raise RuntimeError(f"redis tier: {self.redis.stats.errors} errors while storing")
            return self.redis.stats.bytes_stored - before
        if side == "ours":
            got = 0
            for part in self.batches():
                got += self.redis.fetch(self.keys[part.start : part.stop], self.dst_views[part.start : part.stop])
            if got != self.num_pages:
                raise RuntimeError(f"redis tier: {got} of {self.num_pages} stored pages read back")
            return got * self.row_bytes
        moved = 0
        for part in self.batches():
            with self.client.pipeline(transaction=False) as pipe:
                for i in part:
                    pipe.set(self.raw_keys[i], self.value_views[i]) if phase == "offload" else pipe.get(
                        self.raw_keys[i]
                    )
                replies = pipe.execute()
            if phase == "offload":
                moved += self.row_bytes * sum(1 for ok in replies if ok)
            else:
                moved += sum(len(v) - HEADER_SIZE for v in replies if v is not None)
        return moved

    def end(self) -> None:
        self.redis.reset()
        for lo in range(0, len(self.raw_keys), 512):
            self.client.unlink(*self.raw_keys[lo : lo + 512])

    def close(self) -> None:
        self.redis.shutdown()
        self.client.close()


def _ignore(i: int) -> None:
    """A `done` callback that keeps nothing alive (the case owns the rows)."""
