"""pagedkv engines in child processes (`python -m pagedkv.router.engine_server`), each publishing its KV
events on loopback, and small HTTP helpers (urllib: no client library needed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SRC = str(Path(__file__).resolve().parents[2] / "src")
TINY = ["--vocab", "256", "--hidden", "32", "--layers", "1", "--max-len", "1024", "--max-batched-tokens", "512"]


@dataclass
class EngineProc:
    name: str
    proc: subprocess.Popen[str]
    url: str
    events: str
    replay: str
    topic: str
    page_size: int

    def post(self, path: str, body: dict[str, Any], timeout: float = 30.0) -> Any:
        req = urllib.request.Request(self.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())

    def get(self, path: str, timeout: float = 10.0) -> Any:
        with urllib.request.urlopen(self.url + path, timeout=timeout) as resp:
            return json.loads(resp.read())

    def complete(self, prompt: list[int], max_tokens: int = 2, salt: str | None = None) -> Any:
        body: dict[str, Any] = {"prompt": prompt, "max_tokens": max_tokens}
        if salt is not None:
            body["cache_salt"] = salt
        return self.post("/v1/completions", body)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def spawn(name: str, *args: str) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [SRC, os.environ.get("PYTHONPATH")])))
    return subprocess.Popen([sys.executable, "-m", "pagedkv.router.engine_server", "--name", name, *TINY, *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip


def ready(name: str, proc: subprocess.Popen[str]) -> EngineProc:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"engine {name} did not start: {proc.stderr.read() if proc.stderr else ''}")
    info = json.loads(line)
    return EngineProc(name, proc, info["url"], info["events"], info["replay"], info["topic"], info["page_size"])


@contextmanager
def engines(specs: dict[str, list[str]]) -> Iterator[dict[str, EngineProc]]:
    """Start one engine per name (its extra arguments), in parallel; stop them all at the end."""
    procs = {name: spawn(name, *args) for name, args in specs.items()}
    started: dict[str, EngineProc] = {}
    try:
        for name, proc in procs.items():
            started[name] = ready(name, proc)
        yield started
    finally:
        for name, proc in procs.items():
            (started[name].stop() if name in started else proc.kill())


def wait_for(cond: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


def synced(index: Any, engine: EngineProc) -> None:
    """Wait until the index has applied every batch the engine has numbered."""
    wait_for(
        lambda: (index.next_seq(engine.name) or 0) == engine.get("/load")["kv_event_batches"],
        what=f"{engine.name} sync",
    )
