"""A real redis-server on a free loopback port, for the Redis tier tests (no mocks).

    with RedisServer.running(tmp_path) as server:    # or the `redis_server` fixtures of the test modules
        server.url; server.stop(); server.start()    # kill -9, then restart on the same port (empty)
    with RedisServer.running(tmp_path, tls=True):    # TLS only (rediss://), client certificates required

Without `redis-server` on PATH the tests skip, unless PAGEDKV_REQUIRE_REDIS=1 (CI), where they fail.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import ssl
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


def require_binary(name: str, package: str) -> str:
    """Path of the program `name`; skips the test (fails it under PAGEDKV_REQUIRE_REDIS=1) when missing."""
    path = shutil.which(name)
    if path is None:
        message = f"{name} is not installed (apt-get install {package})"
        if os.environ.get("PAGEDKV_REQUIRE_REDIS") == "1":
            pytest.fail(f"{message}, and PAGEDKV_REQUIRE_REDIS=1")
        pytest.skip(message)
    return path


def redis_server_binary() -> str:
    """Path of redis-server (see `require_binary`)."""
    return require_binary("redis-server", "redis-server")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """One redis-server process: loopback only, no persistence (a restart comes back empty)."""

    def __init__(self, directory: Path, *args: str, tls: bool = False) -> None:
        self.binary = redis_server_binary()
        self.port = free_port()
        self.directory = directory
        self.args = list(args)
        self.proc: subprocess.Popen[bytes] | None = None
        self.cert = directory / "cert.pem"  # with tls: a self-signed certificate for 127.0.0.1, also the CA
        self.key = directory / "key.pem"
        self.tls = tls
        if tls:
            subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
                            "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(self.key),
                            "-out", str(self.cert)], check=True, capture_output=True)  # fmt: skip
            self.args = ["--tls-port", str(self.port), "--tls-cert-file", str(self.cert), "--tls-key-file",
                         str(self.key), "--tls-ca-cert-file", str(self.cert), "--tls-auth-clients", "yes", *args]  # fmt: skip

    @property
    def url(self) -> str:
        return f"{'rediss' if self.tls else 'redis'}://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> None:
        """Start (or restart, on the same port) and wait until it answers PING."""
        assert self.proc is None or self.proc.poll() is not None, "already running"
        cmd = [self.binary, "--port", "0" if self.tls else str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
               "--dir", str(self.directory), *self.args]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while not self.answers():
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}: {cmd}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis-server on port {self.port} did not answer PING in {timeout}s")
            time.sleep(0.01)

    def answers(self) -> bool:
        """True when the server replies to PING (a NOAUTH error counts: it is up)."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as raw:
                s = raw
                if self.tls:
                    context = ssl.create_default_context(cafile=self.cert)
                    context.load_cert_chain(self.cert, self.key)
                    s = context.wrap_socket(raw, server_hostname="127.0.0.1")
                s.sendall(b"PING\r\n")
                return s.recv(64).startswith((b"+PONG", b"-NOAUTH"))
        except OSError:
            return False

    def stop(self) -> None:
        """kill -9: no clean shutdown, connections drop."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # in case it was paused
            self.proc.kill()
            self.proc.wait()

    def pause(self) -> None:
        """SIGSTOP: the port still accepts connections, nothing answers (a hung server)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def client(self, **kwargs: Any) -> Any:
        """A plain redis-py client of this server (bytes replies)."""
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5, **kwargs)

    @classmethod
    @contextlib.contextmanager
    def running(cls, directory: Path, *args: str, tls: bool = False) -> Iterator[RedisServer]:
        server = cls(directory, *args, tls=tls)
        server.start()
        try:
            yield server
        finally:
            server.stop()
