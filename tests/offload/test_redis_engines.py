"""Two real engine processes share prefix pages through a real redis-server, keep serving correct
tokens while it is dead, and share again once it is back."""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO, Any

import numpy as np
from redis_server import RedisServer

WORKER = Path(__file__).with_name("engine_worker.py")
PAGE = 8
PREFIX = 40  # 5 shared pages
SUFFIX = 5  # prompts of 45 tokens
NEW = 4  # 45 + 4 tokens: the KV of 48 positions, 6 full pages per request
RETRY_S = 3.0  # longer than a round takes: one failed call per outage round, exactly


def prompts() -> list[list[int]]:
    """Six prompts sharing a 40-token prefix; suffixes differ in their first token."""
    rng = np.random.default_rng(5)
    prefix = rng.integers(3, 512, PREFIX).tolist()
    return [[*prefix, 100 + i, *rng.integers(3, 512, SUFFIX - 1).tolist()] for i in range(6)]


class Worker:
    """An engine_worker.py process and its replies."""

    def __init__(self, spec: dict[str, Any], log: Path) -> None:
        self.log = log
        self.stderr = open(log, "w")  # noqa: SIM115 - closed in `close`
        self.proc = subprocess.Popen([sys.executable, str(WORKER), json.dumps(spec)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.stderr, text=True)  # fmt: skip
        self.replies: queue.Queue[dict[str, Any] | None] = queue.Queue()
        threading.Thread(target=self._read, args=(self.proc.stdout,), daemon=True).start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            if line.startswith("@@"):
                self.replies.put(json.loads(line[2:]))
        self.replies.put(None)  # the process ended

    def send(self, **command: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()

    def recv(self, timeout: float = 120) -> dict[str, Any]:
        message = self.replies.get(timeout=timeout)
        assert message is not None, f"worker died:\n{self.log.read_text()[-4000:]}"
        return message

    def ask(self, **command: Any) -> dict[str, Any]:
        self.send(**command)
        return self.recv()

    def warnings(self) -> list[str]:
        return [line for line in self.log.read_text().splitlines() if line.startswith("redis tier:")]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.stderr.close()


def test_two_engines_share_through_redis_and_survive_an_outage(tmp_path: Path) -> None:
    p = prompts()
    with RedisServer.running(tmp_path) as server:
        spec = {"redis_url": server.url, "retry_s": RETRY_S, "timeout_s": 0.5}
        a, b = Worker(spec, tmp_path / "a.log"), Worker(spec, tmp_path / "b.log")
        try:
            assert a.recv() == b.recv() == {"ready": True}
            expected = a.ask(reference=p, new=NEW)["outputs"]  # an engine without any connector
            assert len(expected) == 6 and all(len(out) == NEW for out in expected)

            # Round 1: A computes the prefix and stores its pages; B loads the 5 prefix pages from Redis.
            ra = a.ask(prompts=[p[0]], new=NEW)
            assert ra["outputs"] == [expected[0]] and ra["cached"] == 0
            assert (ra["redis"]["pages_stored"], ra["redis"]["pages_loaded"], ra["redis"]["errors"]) == (6, 0, 0)
            rb = b.ask(prompts=[p[1]], new=NEW)
            assert rb["outputs"] == [expected[1]] and rb["cached"] == PREFIX
            assert (rb["redis"]["pages_stored"], rb["redis"]["pages_loaded"], rb["redis"]["errors"]) == (1, 5, 0)

            # Round 2: the server dies while both engines run; both serve at once, recomputing everything.
            server.stop()
            a.send(prompts=[p[2]], new=NEW)
            b.send(prompts=[p[3]], new=NEW)
            ra, rb = a.recv(), b.recv()
            assert ra["outputs"] == [expected[2]] and rb["outputs"] == [expected[3]]
            assert ra["cached"] == rb["cached"] == 0
            # one failed read each (then skipped for RETRY_S without a network call): 6 writes skipped each
            assert (ra["redis"]["errors"], ra["redis"]["skipped_writes"], ra["redis"]["pages_loaded"]) == (1, 6, 0)
            assert (rb["redis"]["errors"], rb["redis"]["skipped_writes"], rb["redis"]["pages_loaded"]) == (1, 6, 5)

            # Round 3: the server is back (empty, same port); once RETRY_S has passed both use it again.
            server.start()
            assert a.ask(wait_available=True) == b.ask(wait_available=True) == {"available": True}
            ra = a.ask(prompts=[p[4]], new=NEW)
            assert ra["outputs"] == [expected[4]] and ra["cached"] == 0
            assert (ra["redis"]["pages_stored"], ra["redis"]["errors"]) == (12, 1)
            rb = b.ask(prompts=[p[5]], new=NEW)
            assert rb["outputs"] == [expected[5]] and rb["cached"] == PREFIX
            assert (rb["redis"]["pages_stored"], rb["redis"]["pages_loaded"], rb["redis"]["errors"]) == (2, 10, 1)

            assert a.ask(exit=True) == b.ask(exit=True) == {"closed": True}
            for worker in (a, b):  # the outage was logged once, and the recovery once
                assert worker.proc.wait(timeout=30) == 0
                [failed, recovered] = worker.warnings()
                assert "read on 127.0.0.1" in failed and "ConnectionError" in failed and "answers again" in recovered
        finally:
            a.close()
            b.close()
