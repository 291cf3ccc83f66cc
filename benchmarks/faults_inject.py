"""The faults of `python -m benchmarks.faults`, for real, and `run_case`: fill, fault, serve, recover, audit.

redis-server SIGKILLed mid-run and restarted empty; the disk full by RLIMIT_FSIZE (in a child process,
`faults_child`: the limit lasts for the process); stored pages damaged (`faults_cases.DAMAGES`); Redis slowed
by ``CLIENT PAUSE`` from a second connection past ``redis_timeout_s``.
"""

from __future__ import annotations

import resource
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from benchmarks.faults_cases import CORRUPT, RETRY_S, TRUNCATE, Recorder

if TYPE_CHECKING:
    from pagedkv.bench.tiers_redis import RedisServer

__all__ = ["DAMAGING", "fill_up_disk", "run_case"]


def fill_up_disk(rec: Recorder, limit: int) -> None:
    """The disk-full rounds (in a child process: they lower its RLIMIT_FSIZE). fill: the disk fills up (no
    page file fits under `limit`: EFBIG) once half the requests finished; serve: a fresh engine reads what
    was written, its own writes fail; then the space is back."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails instead of killing us
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    fill, full = rec.engine(), [False]

    def fill_up(steps: int, finished: int) -> None:
        if finished >= rec.workload.requests // 2 and not full[0]:
            fill.manager.sync_tiers()  # what was committed so far is on disk
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
            full[0] = True

    rec.round("fill: the disk fills up half-way", fill, faulty=True, after_step=fill_up)
    fill.manager.close()
    rec.serve("serve: disk full", faulty=True)
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


DAMAGING = {"corrupt-disk", "corrupt-redis", "truncated-disk"}  # the cases that damage stored pages
PAUSE_S, GAP_S, STEP_S = 0.6, 0.15, 0.03  # slow-redis: pause, gap, a real model's step time (ours: ~5 ms)


def _restart(server: RedisServer) -> None:
    """Start it again on its port, empty, and wait (up to 10 s) until it answers."""
    import redis
    from redis.backoff import ConstantBackoff
    from redis.retry import Retry

    server.proc.wait()  # (SIGKILLed)
    server.proc = subprocess.Popen(server.proc.args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    retry = Retry(ConstantBackoff(0.02), 500, supported_errors=(redis.ConnectionError,))
    redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=1, retry=retry).ping()


@contextmanager
def _slow(url: str) -> Iterator[list[float]]:
    """Redis slow for real: ``CLIENT PAUSE <PAUSE_S> ALL`` from a second connection, again every
    PAUSE_S + GAP_S; yields the pauses' end times. On exit, waits until the last pause is over."""
    import redis

    client, stop, pauses = redis.Redis.from_url(url, socket_timeout=10), threading.Event(), []

    def pause() -> None:
        client.execute_command("CLIENT", "PAUSE", int(PAUSE_S * 1000), "ALL")
        pauses.append(time.monotonic() + PAUSE_S)

    def loop() -> None:
        while not stop.wait(PAUSE_S + GAP_S):
            pause()

    pause()  # the engine's first call surely waits past its timeout
    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield pauses
    finally:
        stop.set()
        thread.join()
        time.sleep(max(0.0, pauses[-1] - time.monotonic()) + 0.05)
        client.close()


def run_case(name: str, rec: Recorder, server: RedisServer | None = None, fsize_limit: int = 0) -> dict[str, Any]:
    """Fill, fault, serve, recover, audit: the raw figures of case `name` (`faults.summarize` sums them)."""
    extra: dict[str, Any] = {}
    if name == "disk-full":
        fill_up_disk(rec, fsize_limit)
    else:
        rec.serve("fill")
        if name in DAMAGING:
            rec.damage(TRUNCATE if name == "truncated-disk" else CORRUPT)
        if name == "redis-killed":
            assert server is not None
            engine = rec.engine()
            # SIGKILL while the engine serves: its first batch is in flight, the rest still waits
            rec.round("serve: SIGKILL after step 1", engine, faulty=True, after_step=lambda steps, _: server.proc.kill() if steps == 1 else None)  # fmt: skip
            _restart(server)
            time.sleep(RETRY_S + 0.05)  # the engine tries Redis again after redis_retry_s
            engine.manager.reset_prefix_cache()  # the device forgets: the same engine must use Redis again
            rec.round("serve: same engine, server restarted", engine)
            engine.manager.close()
        elif name == "slow-redis":
            engine = rec.engine()
            with _slow(rec.config["redis_url"]) as pauses:  # from the engine's first call on
                rec.round("serve: server paused", engine, faulty=True, after_step=lambda *_: time.sleep(STEP_S))
            engine.manager.close()
            extra["pauses"] = len(pauses)
        else:
            rec.serve("serve", faulty=True)
    if not name.startswith("none"):
        rec.serve("recover: fresh engine")
    rec.audit()
    return {**rec.result(), **extra}
