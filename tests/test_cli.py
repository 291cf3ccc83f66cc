"""The `pagedkv` command line: demo and bench run end to end and report what they measured."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from pagedkv.cli import BENCH_COMMANDS, main, parser


@pytest.mark.parametrize("argv", [["--help"], ["bench", "--help"], ["demo", "--help"]])
def test_help_answers_without_importing_torch(argv: list[str]) -> None:
    """`pagedkv --help` and `pagedkv bench --help` list the commands without importing torch or any
    benchmark: in this process `import torch` raises, and no module of pagedkv but the CLI is loaded."""
    code = (
        "import sys\n"
        "sys.modules['torch'] = None  # any `import torch` now raises ImportError\n"
        "from pagedkv.cli import main\n"
        "try:\n"
        f"    main({argv!r})\n"
        "except SystemExit as exit_:\n"
        "    assert exit_.code == 0, exit_.code\n"
        "print(sorted(m for m in sys.modules if m.startswith('pagedkv')))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "['pagedkv', 'pagedkv.cli', 'pagedkv.lazy']"
    assert "usage: pagedkv" in result.stdout
    if argv[0] == "bench":
        assert all(name in result.stdout for name in BENCH_COMMANDS)


def test_a_bench_command_imports_only_its_own_module() -> None:
    code = (
        "import json, sys\n"
        "from pagedkv.cli import parser\n"
        "argv = ['bench', 'manager', '--requests', '3']\n"
        "assert parser(argv).parse_args(argv).requests == 3\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    loaded = set(json.loads(result.stdout.splitlines()[-1]))
    assert BENCH_COMMANDS["manager"].module in loaded
    others = {cmd.module for name, cmd in BENCH_COMMANDS.items() if name != "manager"}
    assert not loaded & others and not any(m.startswith("pagedkv.router") for m in loaded)


def test_demo_verifies_and_leaks_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--manager-only", "--requests", "6"]) == 0
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


def test_engine_demo_with_a_local_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from hf_models import build

    build("qwen3").save_pretrained(tmp_path / "ckpt")
    assert main(["demo", "--requests", "6", "--model", str(tmp_path / "ckpt")]) == 0
    out = capsys.readouterr().out
    assert "6/6 outputs identical" in out and "OK: every output equals" in out


def test_engine_demo_and_bench(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--requests", "12"]) == 0
    assert "12/12 outputs identical" in capsys.readouterr().out
    path = tmp_path / "engine.json"
    assert main(["bench", "engine", "--requests", "12", "--repeats", "1", "--json", str(path)]) == 0
    result = json.loads(path.read_text())
    assert result["same_outputs"] and result["prefill_tokens_skipped"] > 0
    assert result["prefill_tokens_computed_off"] == result["prompt_tokens_off"]  # nothing reused without caching


def test_hybrid_bench(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "hybrid.json"
    assert main(["bench", "hybrid", "--requests", "40", "--repeats", "1", "--json", str(path)]) == 0
    assert "| gemma3-like (48 layers, 5:1, W=1024) | 8192 | 832.0 MiB | 3072.0 MiB | 832.0 MiB | 1.000" in (
        capsys.readouterr().out
    )
    result = json.loads(path.read_text())
    assert [m["paged"] == m["minimum"] < m["all_full"] for m in result["memory"]] == [True] * 4
    hits = {(h["scenario"][0], h["policy"], h["protected_fraction"]): h for h in result["hits"]}
    # (the all-full model shares pages within a step, schedule-time caching, which the hybrid does not)
    assert (
        hits["E", "slru", 0.25]["hit_rate"] <= hits["B", "slru", 0.25]["hit_rate"] <= hits["B", "slru", 0.25]["ideal"]
    )
    assert [d["decode_us"] > 0 for d in result["decode"]] == [True, True]


def test_tier_demo_second_process_reads_the_first_ones_pages_from_disk(capsys: pytest.CaptureFixture[str]) -> None:
    from pagedkv.demos.tiers import run_tier_demo

    r = run_tier_demo("tiered", requests=6, groups=3, prefix_len=64)
    fill, warm, cold = r["fill"], r["warm"], r["recompute"]
    # 3 system prompts of 64 tokens = 4 pages each. Fill: all 6 requests start in one step; requests 4-6 hit
    # the pages requests 1-3 commit when they are scheduled (schedule-time caching, the default). Warm:
    # requests 1-3 load their prompt's pages from disk, which makes them device hits for requests 4-6 at once.
    assert (fill["from_tiers"]["disk"], fill["from_device"], fill["cached_tokens"]) == (0, 3 * 64, 3 * 64)
    assert (warm["from_tiers"]["disk"], warm["from_device"]) == (3 * 64, 3 * 64)
    assert warm["tier_stats"]["disk"]["refused"] == 0 and cold["from_tiers"] == {}
    assert r["identical"] == 6 and warm["outputs"] == cold["outputs"]
    out = capsys.readouterr().out
    assert "outputs: 6/6 identical" in out and "TTFT speedup" in out
    with pytest.raises(ValueError, match="--connector redis needs --redis-url"):
        run_tier_demo("redis")


def _bench_parsers() -> dict[str, argparse.ArgumentParser]:
    """`pagedkv bench`'s subcommand parsers by name (read from the parser, nothing runs)."""
    top = parser()
    [bench] = [a for a in top._actions if isinstance(a, argparse._SubParsersAction)]
    [kinds] = [a for a in bench.choices["bench"]._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(kinds.choices)


def test_state_bench(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "state.json"
    argv = ["bench", "state", "--hidden", "32", "--batch", "2", "--prompt", "8", "--new-tokens", "3", "--repeats", "1",
            "--dtypes", "fp32", "--turn-prompt", "24", "--json", str(path)]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    result = json.loads(path.read_text())
    # Qwen3.5-9B's shapes: 24 GDN layers of 8192 * 3 * 2 + 32 * 128 * 128 * 4 bytes, 8 full layers of 4096 B/token.
    # pagedkv: pages of 16 tokens for the attention layers, one state row for every GDN layer (no padding);
    # vLLM's layout: blocks of 528 tokens, groups of 8 layers: 3 state pages + ceil(tokens / 528) attention pages
    state_row = 24 * (8192 * 3 * 2 + 32 * 128 * 128 * 4)
    for row in result["memory"]:
        assert row["hybrid_bytes"] == -(-row["tokens"] // 16) * 16 * 8 * 4096 + state_row == row["hybrid_content_bytes"]
        assert row["vllm_attention_block"] == 528 and row["state_rows"] == 1
        assert row["vllm_layout_bytes"] == (3 + -(-row["tokens"] // 528)) * 8 * 528 * 4096
        assert row["all_full_bytes"] == 32 * row["tokens"] * 4096
    assert "| 32,768 | 1073.1 MiB | 1073.1 MiB | 1089.0 MiB (528-token blocks) | 4096.0 MiB | 0.262 |" in out
    warm = result["warm_turn"]  # 25 prompt tokens + 3 generated + 32: resumed after 25 + 3 - 1
    assert warm["turn_prompt_tokens"] == 60 and warm["cached_tokens"] == 27 and warm["same_outputs"]
    assert warm["disk_cached_tokens"] == 27  # the restarted engine loads the same checkpoint from disk
    (fp32,) = result["throughput"]
    assert fp32["dtype"] == "fp32" and fp32["requests"] == 2 and fp32["engine_decode_tokens_per_second"] > 0


def test_every_bench_command_is_registered_and_takes_json_and_plots_where_it_has_tables(tmp_path: Path) -> None:
    parsers = _bench_parsers()
    assert set(parsers) == set(BENCH_COMMANDS)
    # the benchmarks that ship; the research harness is `python -m benchmarks.<name>` (tests/benchmarks)
    assert set(parsers) == {"manager", "attention", "triton", "fp8", "engine", "hybrid", "state", "tiers"}
    for name, cmd in BENCH_COMMANDS.items():
        argv = ["bench", name, "--json", str(tmp_path / "r.json")]
        args = parser().parse_args(argv)
        assert args.json == tmp_path / "r.json", name
        if cmd.tables:
            args = parser().parse_args([*argv, "--plots", str(tmp_path / "plots")])
            assert args.plots == tmp_path / "plots", name
        else:
            assert "--plots" not in parsers[name]._option_string_actions, name
    assert not BENCH_COMMANDS["triton"].tables  # one line of figures, no table


def test_bench_help_shows_every_flags_meaning_and_default(capsys: pytest.CaptureFixture[str]) -> None:
    for name, p in _bench_parsers().items():
        for action in p._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            assert action.help and action.help != argparse.SUPPRESS, (name, action.dest)
        with pytest.raises(SystemExit) as exit_:
            main(["bench", name, "--help"])
        assert exit_.value.code == 0
        text = "".join(capsys.readouterr().out.split())  # argparse wraps lines, also inside long defaults
        for action in p._actions:
            if action.default not in (None, False, argparse.SUPPRESS) and action.option_strings:
                assert f"(default:{action.default})".replace(" ", "") in text, (name, action.dest)
    out = " ".join(_bench_parsers()["manager"].format_help().split())
    assert "--requests REQUESTS requests in the trace (default: 2000)" in out


def test_bench_json_and_plots_at_the_smallest_size(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    args = ["bench", "attention", "--batch", "2", "--context", "32", "--repeats", "1",
            "--json", str(tmp_path / "a.json"), "--plots", str(tmp_path / "plots")]  # fmt: skip
    assert main(args) == 0
    assert json.loads((tmp_path / "a.json").read_text())["rows"][0]["device"] == "cpu"
    png = tmp_path / "plots" / "attention_ms.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"wrote {png}" in capsys.readouterr().out


def test_progress_writes_nothing_into_a_pipe(capsys: pytest.CaptureFixture[str]) -> None:
    from pagedkv.workloads.progress import Progress

    with Progress("requests") as progress:  # stderr is captured here: not a terminal
        for done in range(1, 4):
            progress(done, 3, "note")
    assert capsys.readouterr().err == ""
