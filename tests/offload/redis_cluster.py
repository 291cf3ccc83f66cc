"""A real 3-primary Redis Cluster on free loopback ports, for the cluster tests of the Redis tier (no mocks).

    with RedisCluster.running(tmp_path) as cluster:
        cluster.url                  # redis+cluster://127.0.0.1:<first port>
        cluster.clients()            # one plain redis.Redis per node (bytes replies)
        cluster.stop(1)              # kill -9 node 1: its slots are unserved
        cluster.restart(1)           # back on the same port with the same slots (empty: no persistence)

Without `redis-server` / `redis-cli` on PATH the tests skip, unless PAGEDKV_REQUIRE_REDIS=1 (CI), where they fail.
"""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from redis_server import free_port, redis_server_binary, require_binary


class RedisCluster:
    """`size` cluster-enabled redis-server processes (no replicas, no persistence) joined by
    ``redis-cli --cluster create``; ready once every node reports ``cluster_state:ok``."""

    def __init__(self, directory: Path, size: int = 3) -> None:
        self.server = redis_server_binary()
        self.cli = require_binary("redis-cli", "redis-tools")
        self.directory = directory
        self.ports: list[int] = []
        while len(self.ports) < size:
            port = free_port()
            if port not in self.ports and port + 10000 <= 65535:  # the cluster bus listens on port + 10000
                self.ports.append(port)
        self.procs: list[subprocess.Popen[bytes]] = []

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.ports[0]}"

    def _spawn(self, port: int) -> subprocess.Popen[bytes]:
        cmd = [self.server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
               "--cluster-enabled", "yes", "--cluster-config-file", str(self.directory / f"nodes-{port}.conf"),
               "--dir", str(self.directory)]  # fmt: skip
        return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def start(self, timeout: float = 15.0) -> None:
        self.procs = [self._spawn(port) for port in self.ports]
        deadline = time.monotonic() + timeout
        self._wait_ping(deadline)
        nodes = [f"127.0.0.1:{port}" for port in self.ports]
        subprocess.run([self.cli, "--cluster", "create", *nodes, "--cluster-replicas", "0", "--cluster-yes"],
                       check=True, capture_output=True, timeout=timeout)  # fmt: skip
        self._wait_ok(deadline)

    def restart(self, index: int, timeout: float = 15.0) -> None:
        """Start node `index` again after `stop`: it rejoins with its slots from its nodes-<port>.conf."""
        assert self.procs[index].poll() is not None, "still running"
        self.procs[index] = self._spawn(self.ports[index])
        deadline = time.monotonic() + timeout
        self._wait_ping(deadline)
        self._wait_ok(deadline)

    def _wait_ping(self, deadline: float) -> None:
        for port in self.ports:
            while self._cli(port, "PING") != "PONG":
                self._check(deadline, f"redis-server on port {port} did not answer PING")

    def _wait_ok(self, deadline: float) -> None:
        for port in self.ports:
            while "cluster_state:ok" not in self._cli(port, "CLUSTER", "INFO"):
                self._check(deadline, f"node {port} did not report cluster_state:ok")

    def _check(self, deadline: float, message: str) -> None:
        for proc in self.procs:
            if proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {proc.returncode}: {proc.args!r}")
        if time.monotonic() > deadline:
            raise RuntimeError(message)
        time.sleep(0.02)

    def _cli(self, port: int, *args: str) -> str:
        result = subprocess.run([self.cli, "-h", "127.0.0.1", "-p", str(port), *args], capture_output=True,
                                text=True, timeout=5)  # fmt: skip
        return result.stdout.strip()

    def clients(self, **kwargs: Any) -> list[Any]:
        """A plain redis-py client per node, in port order (bytes replies)."""
        import redis

        return [redis.Redis(host="127.0.0.1", port=port, socket_timeout=5, **kwargs) for port in self.ports]

    def stop(self, index: int | None = None) -> None:
        """kill -9 node `index` (every node when None)."""
        for i, proc in enumerate(self.procs):
            if (index is None or i == index) and proc.poll() is None:
                proc.kill()
                proc.wait()

    @classmethod
    @contextlib.contextmanager
    def running(cls, directory: Path, size: int = 3) -> Iterator[RedisCluster]:
        cluster = cls(directory, size)
        try:
            cluster.start()
            yield cluster
        finally:
            cluster.stop()
