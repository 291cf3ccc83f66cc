"""`pagedkv bench tiers` at toy sizes: the report's structure, equal bytes on both sides, identical tokens.

Figures are not asserted (benchmarks are CLI commands, not timed tests).
"""

from __future__ import annotations

import json
import shutil
from importlib.util import find_spec
from pathlib import Path

import pytest

from pagedkv.bench.tiers_bench import SHAPES, run_tiers_bench
from pagedkv.cli import main

HAVE_REDIS = find_spec("redis") is not None and shutil.which("redis-server") is not None


def test_throughput_rows_move_the_same_bytes_on_both_sides(tmp_path: Path) -> None:
    r = run_tiers_bench(shapes=("llama3.2-1b",), mib=4, batch=3, repeats=2, directory=str(tmp_path), ttft=False)
    rows = {(t["tier"], t["phase"]): t for t in r["throughput"]}
    expected = {("host", "offload"), ("host", "load"), ("disk", "offload"), ("disk", "load"), ("disk", "load_cold")}
    if HAVE_REDIS:
        expected |= {("redis", "offload"), ("redis", "load")}
    else:
        assert any("redis rows skipped" in s for s in r["skipped"])
    assert set(rows) == expected
    page = SHAPES["llama3.2-1b"].row_bytes
    for t in rows.values():
        assert t["pages"] == 8 and t["row_bytes"] == page and t["verified"], t
        assert t["ours_bytes"] == 8 * page and set(t["raw_bytes"].values()) == {8 * page}, t
        assert len(t["ours_s"]) == (6 if t["tier"] == "host" else 2) and t["ours_gibps"] > 0 and t["raw_gibps"] > 0
        assert t["ratio"] == pytest.approx(t["ours_gibps"] / t["raw_gibps"])
    assert list(tmp_path.iterdir()) == []  # the bench's files are gone


def test_cli_with_ttft(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "tiers.json"
    args = ["bench", "tiers", "--shapes", "llama3.2-1b", "--tiers", "host", "--mib", "1", "--repeats", "1",
            "--dir", str(tmp_path), "--ttft-prompts", "2", "--ttft-prompt-len", "40", "--ttft-repeats", "1",
            "--ttft-hidden", "64", "--ttft-layers", "2", "--json", str(path)]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "| host | offload |" in out and "Time to first token" in out
    ttft = json.loads(path.read_text())["ttft"]
    modes = ttft["modes"]
    assert set(modes) == (
        {"disk", "disk_cold", "redis", "recompute"} if HAVE_REDIS else {"disk", "disk_cold", "recompute"}
    )
    assert ttft["fill_same_outputs"] and all(m["same_outputs"] for m in modes.values())
    assert modes["recompute"]["cached_tokens"] == [0, 0]
    for name in modes.keys() - {"recompute"}:
        assert modes[name]["cached_tokens"] == [32, 32]  # 2 full pages of 16 of each 40-token prompt
        tier = "redis" if name == "redis" else "disk"
        assert modes[name]["pages_loaded"][tier] == 4


def test_disk_tier_parallel_fetch_stops_at_the_first_bad_page(tmp_path: Path) -> None:
    """The disk tier's readers (the bench's speed-ups): a prefix up to the first miss or refusal, and a
    fetch that never waits for a pool busy with other work."""
    import threading

    import torch

    from pagedkv.bench.tiers_cases import FINGERPRINT, HASH_ALGO, random_rows
    from pagedkv.offload.disk import DiskTier

    row = 4096
    src, dst = random_rows(10, row), torch.zeros((10, row), dtype=torch.uint8)
    views, out = [memoryview(r) for r in src.numpy()], [memoryview(r) for r in dst.numpy()]
    keys = [bytes([i]) * 32 for i in range(10)]
    disk = DiskTier(tmp_path, row, 1 << 30, FINGERPRINT, HASH_ALGO, threads=3)
    done: list[int] = []
    disk.store(keys, views, done.append)
    disk.wait()
    assert sorted(done) == list(range(10)) and disk.stats.pages_stored == 10
    assert disk.fetch(keys, out) == 10 and torch.equal(dst, src)
    disk.path(keys[6]).unlink()
    dst.zero_()
    assert disk.fetch(keys, out) == 6 and torch.equal(dst[:6], src[:6])
    data = bytearray(disk.path(keys[3]).read_bytes())
    data[-1] ^= 0xFF
    disk.path(keys[3]).write_bytes(bytes(data))
    assert disk.fetch(keys, out) == 3 and disk.stats.refused == 1
    assert disk.path(keys[3]).read_bytes() == bytes(data)  # a refused page is left in place
    assert disk.fetch(keys[:2], out[:2]) == 2 and disk.fetch([], []) == 0
    gate = threading.Event()
    busy = [disk._pool.submit(gate.wait) for _ in range(3)]  # every writer thread blocked
    try:
        assert disk.fetch(keys[:3], out[:3]) == 3  # reads have threads of their own
    finally:
        gate.set()
        for future in busy:
            future.result()
    disk.shutdown()
