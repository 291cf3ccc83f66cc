"""`pagedkv bench engine --compare-hf` on a tiny Llama: every way runs, fp32 greedy tokens are identical."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

from pagedkv.bench import engine_hf
from pagedkv.cli import main

TINY = {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "intermediate": 128, "vocab": 256, "prompts": 4,
        "prompt_len": 40, "new_tokens": 6}  # fmt: skip


def test_compare_hf_runs_every_way_with_identical_fp32_tokens() -> None:
    result = engine_hf.compare_hf(engine_hf.CompareConfig(**TINY), dtypes=("float32",), repeats=1)  # type: ignore[arg-type]
    row = result["dtypes"]["float32"]
    assert row["errors"] == {}
    for way in engine_hf.WAYS:
        assert row[f"tok_s_{way}"] > 0, way
    assert row["same_tokens_generate"] and row["same_tokens_generate_batch"]
    table = engine_hf.format_compare_report(result)
    assert "| float32 |" in table and "pagedkv / generate_batch" in table


def test_bench_engine_compare_only(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                   monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.setattr(engine_hf, "CompareConfig", functools.partial(engine_hf.CompareConfig, **TINY))
    path = tmp_path / "compare.json"
    args = ["bench", "engine", "--compare-only", "--compare-repeats", "1", "--compare-dtypes", "float32",
            "--json", str(path)]  # fmt: skip
    assert main(args) == 0
    row = json.loads(path.read_text())["compare_hf"]["dtypes"]["float32"]
    assert row["same_tokens_generate"] and row["same_tokens_generate_batch"]
    assert "pagedkv tok/s" in capsys.readouterr().out
