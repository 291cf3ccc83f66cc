"""`python -m benchmarks.faults` at a small size: under every real fault (Redis killed, disk full, corrupt
and truncated pages, slow Redis) every request completes with the recompute-only reference's tokens, no
page is lost, and the fault really happened. The Redis cases skip without `redis-server` (they fail
instead under PAGEDKV_REQUIRE_REDIS=1, as in CI)."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "offload"))

from redis_server import redis_server_binary  # noqa: E402

from benchmarks.faults import command, format_faults_report, run_faults  # noqa: E402
from benchmarks.faults_cases import CORRUPT, TRUNCATE  # noqa: E402

REQUESTS = 8  # per round: two waves of 4 (the engines' batch), so a fault can land between them
DISK = ["none-disk", "disk-full", "corrupt-disk", "truncated-disk"]
REDIS = ["none-redis", "redis-killed", "corrupt-redis", "slow-redis"]


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """As `python -m benchmarks.faults` runs: the model is tiny, one torch thread is several times faster here."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def check(result: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """The figures every case must reach; returns the cases."""
    assert result["skipped"] == {} and list(result["cases"]) == names
    for name, c in result["cases"].items():
        assert c["submitted"] == REQUESTS * len(c["rounds"]) and c["completed"] == c["submitted"], name
        assert c["wrong_tokens"] == 0, name
        assert c["pages_lost"] == 0, (name, c["lost"])
        assert c["integrity_ok"] and c["round_errors"] == [] and c["preemptions"] == 0, name
        assert c["audit"]["expected"] > 0 and c["audit"]["unknown"] == 0, (name, c["audit"])
        assert c["fault_observed"] and c["ok"], name
    report = format_faults_report(result)
    assert all(f"| {name} |" in report for name in names) and "OK: every case completed" in report
    return result["cases"]  # type: ignore[no-any-return]


def test_disk_faults() -> None:
    cases = check(run_faults(REQUESTS, cases=DISK), DISK)
    none = cases["none-disk"]
    assert none["errors"] == none["refused"] == none["skipped_writes"] == 0 and none["tier_pages_loaded"] > 0
    for name, kinds in (("corrupt-disk", CORRUPT), ("truncated-disk", TRUNCATE)):
        c = cases[name]  # one damaged page per group: each refused once (not deleted), recomputed and written over
        assert c["refused"] == len(c["damaged"]) == 4 and c["deleted_from_tier"] == 0 and c["errors"] == 0
        assert sorted(d["kind"] for d in c["damaged"]) == sorted(kinds)
        assert c["rounds"][1]["tiers"]["disk"]["pages_stored"] == 4 and c["recovery_tier_hits"] > 0
    full = cases["disk-full"]
    fill, serve, recover = (r["tiers"]["disk"] for r in full["rounds"])
    assert fill["pages_stored"] > 0 and fill["errors"] == fill["skipped_writes"] > 0  # full half-way through
    assert serve["pages_loaded"] > 0 and serve["errors"] > 0  # reads what was written; its own writes fail
    assert recover["errors"] == 0 and recover["pages_stored"] > 0  # space again: the missing pages are written
    assert any("disk full" in w for w in full["warnings"])


def test_redis_faults() -> None:
    redis_server_binary()  # skip (fail under PAGEDKV_REQUIRE_REDIS=1) without it
    cases = check(run_faults(REQUESTS, cases=REDIS), REDIS)
    assert cases["none-redis"]["errors"] == 0 and cases["none-redis"]["tier_pages_loaded"] > 0
    corrupt = cases["corrupt-redis"]
    assert corrupt["refused"] == len(corrupt["damaged"]) == 4 and corrupt["deleted_from_tier"] == 0  # written over
    killed = cases["redis-killed"]
    serve, restarted, recover = (r["tiers"]["redis"] for r in killed["rounds"][1:])
    assert serve["errors"] > 0 and serve["skipped_writes"] > 0  # killed mid-run: a miss, writes skipped
    assert restarted["errors"] == 0 and restarted["pages_stored"] > 0  # the same engine writes again
    assert recover["pages_loaded"] > 0  # and a fresh engine hits what it wrote
    logged = "\n".join(killed["warnings"])  # the outage once, the recovery once
    assert "ConnectionError" in logged and "answers again" in logged
    slow = cases["slow-redis"]
    assert slow["pauses"] >= 1 and slow["rounds"][1]["tiers"]["redis"]["errors"] > 0
    assert any("TimeoutError" in w for w in slow["warnings"])


def test_command_line(tmp_path: Path) -> None:
    from benchmarks.command import parser

    argv = ["--requests", "2", "--cases", "none-disk", "--json", str(tmp_path / "f.json")]
    args = parser("benchmarks.faults").parse_args(argv)
    torch.set_num_threads(2)
    assert command(args) == 0
    assert torch.get_num_threads() == 2  # set back after its run on one thread
    result = json.loads((tmp_path / "f.json").read_text())
    assert result["cases"]["none-disk"]["ok"] and result["cases"]["none-disk"]["submitted"] == 4
