"""The soak, short: 1200 requests through a tiered (host + disk) and a redis (host + a real
redis-server) engine over one tiny Llama, every token checked against transformers, memory, fds,
threads and pages sampled after each drain (`benchmarks.soak`; the full run is
`python -m benchmarks.soak`, 20000 requests).

Without `redis-server` on PATH the test skips, unless PAGEDKV_REQUIRE_REDIS=1 (CI), where it fails."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "offload"))

from redis_server import require_binary  # noqa: E402

from benchmarks import soak  # noqa: E402

REQUESTS = 1200


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One short soak for the module (it starts its own redis-server)."""
    require_binary("redis-server", "redis-server")  # skips, or fails under PAGEDKV_REQUIRE_REDIS=1
    if importlib.util.find_spec("redis") is None:
        message = "redis-py is not installed (pip install 'pagedkv[tiers]')"
        if os.environ.get("PAGEDKV_REQUIRE_REDIS") == "1":
            pytest.fail(f"{message}, and PAGEDKV_REQUIRE_REDIS=1")
        pytest.skip(message)
    return soak.run_soak(REQUESTS, directory=str(tmp_path_factory.mktemp("soak")))  # ~10-20 s on 2 CPU cores


def test_soak_serves_exact_tokens_and_leaks_nothing(result: dict[str, Any]) -> None:
    report = soak.format_soak_report(result)
    assert result["requests"] == REQUESTS
    assert result["wrong_tokens"] == 0, report
    assert result["generated_tokens"] >= 2 * REQUESTS
    assert result["pages_in_use_after_drain"] == 0, report
    assert all(s["rows_lent"] == 0 and s["integrity"] is None for s in result["samples"]), report
    assert result["rss_growth_mib"] <= result["config"]["rss_bound_mib"], report
    assert result["rss_peak_growth_mib"] <= result["config"]["rss_bound_mib"], report
    assert result["threads_started_after_warmup"] == [], report
    assert result["left_after_shutdown"] == {"fds": [], "threads": []}, report
    assert result["after_shutdown"]["threads"] <= result["baseline"]["threads"], report
    for s in result["samples"]:
        assert s["fds"] <= result["caps"]["fds"] and s["threads"] <= result["caps"]["threads"], report
    tiers = result["tiers"]
    assert tiers["tiered.disk"]["pages_loaded"] > 0 and tiers["redis.redis"]["pages_loaded"] > 0, report
    assert tiers["tiered.disk"]["evictions"] > 0, report  # the disk cap's LRU deleted files
    assert tiers["tiered.host"]["pages_swapped_out"] > 0 or tiers["redis.host"]["pages_swapped_out"] > 0, report
    assert result["swaps"] > 0 and result["prefix_hit_rate"] > 0.3, report
    assert all(t["errors"] == t["refused"] == 0 for t in tiers.values()), report
    assert result["passed"], report


def test_soak_cli_handler_writes_json_and_exit_status(result: dict[str, Any], tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:  # fmt: skip
    from benchmarks.command import parser

    args = parser("benchmarks.soak").parse_args(["--requests", "7", "--json", str(tmp_path / "out" / "soak.json")])
    assert (args.requests, args.wave, args.rss_bound_mib, args.redis_url) == (7, 128, 4.0, None)
    seen: dict[str, Any] = {}

    def fake_run(requests: int, **kwargs: Any) -> dict[str, Any]:
        seen.update(kwargs, requests=requests)
        return result

    monkeypatch.setattr(soak, "run_soak", fake_run)
    assert soak.command(args) == 0
    assert seen["requests"] == 7 and seen["progress"] is not None
    assert "| wrong tokens == 0 | pass |" in capsys.readouterr().out
    assert json.loads((tmp_path / "out" / "soak.json").read_text())["requests"] == REQUESTS
    monkeypatch.setattr(soak, "run_soak", lambda *a, **k: {**result, "passed": False})
    assert soak.command(args) == 1
