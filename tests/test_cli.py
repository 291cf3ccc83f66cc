"""The `pagedkv` command line: demo and bench run end to end and report what they measured."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedkv.cli import main


def test_demo_verifies_and_leaks_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--requests", "30"]) == 0
    out = capsys.readouterr().out
    assert "OK: integrity checks passed, no page leaked" in out
    assert "each held its own prefix's KV" in out and "prefix hit rate" in out


def test_bench_manager_small(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bench.json"
    args = ["bench", "manager", "--requests", "40", "--prefix-len", "64", "--suffix-len", "32", "--decode-steps", "8",
            "--max-batch-size", "8", "--pool-pages", "10000", "--repeats", "1", "--json", str(path)]  # fmt: skip
    assert main(args) == 0
    result = json.loads(path.read_text())
    # 40 requests in 16 groups share a 64-token prefix: every request after its group's first hits 64 tokens
    groups_seen = result["groups"]
    assert 0 < result["prompt_hit_rate"] <= (40 - 1) * 64 / (40 * 96)
    assert result["preemptions"] == 0 and result["steps"] > 0 and groups_seen == 16
    assert result["bytes_per_page"] < 48 and result["pool_pages"] == 8192
    for key in ("decode_step_us", "prefill_alloc_us", "release_us", "hash_ns_per_token_sha256", "pool_1m_ms"):
        assert result[key] > 0, key
    assert "| decode step, no new page" in capsys.readouterr().out
