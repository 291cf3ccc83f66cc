"""`python -m benchmarks.headline`: the README's headline block is what the committed benchmark JSON gives."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.command import main
from benchmarks.headline import BEGIN, END, compare_lines, render, replace_block, state_lines

ROOT = Path(__file__).resolve().parents[2]


def _row(workload: str, pages: int, manager: str, hit: float, us: float) -> dict[str, object]:
    return {"workload": workload, "capacity_pages": pages, "manager": manager, "hit_rate": hit, "bookkeeping_us": us}


def test_compare_lines_on_a_hand_made_result() -> None:
    rows = [_row("zipf", 100, "pagedkv-lru", 0.50, 1.0), _row("zipf", 100, "vllm", 0.49, 4.0),
            _row("zipf", 100, "sglang", 0.52, 9.0), _row("zipf", 100, "max", 0.40, 2.0),
            _row("multiturn", 50, "pagedkv-lru", 0.30, 2.0), _row("multiturn", 50, "vllm", 0.20, 5.0),
            _row("multiturn", 50, "sglang", 0.298, 9.0), _row("multiturn", 50, "belady", 0.31, 0.0),
            _row("multiturn", 90, "pagedkv-lru", 0.60, 1.0), _row("multiturn", 90, "vllm", 0.50, 2.0)]  # fmt: skip
    lines = compare_lines({"rows": rows, "config": {"default_manager": "pagedkv-lru"}})
    assert lines[0].endswith("in each of 3 cells of `python -m benchmarks.compare` (5 workloads x 4 pool sizes): ahead or "
                             "within half a point in 2; closest cell -2.00 points (zipf, 100 pages), largest lead "
                             "+10.00 points (multiturn, 90 pages).")  # fmt: skip
    assert lines[1] == ("- Multi-turn chat in the tightest pool (50 pages): pagedkv 0.3000, SGLang 0.5.23 0.2980, "
                        "vLLM 0.33 0.2000, Belady's bound 0.3100.")  # fmt: skip
    assert (
        lines[2]
        == "- Bookkeeping per scheduled request-step: 0.25 to 0.50 of vLLM 0.33's and 0.50 to 0.50 of MAX 26.3's (3 cells each)."
    )
    assert len(lines) == 3  # no decode figures in that result
    decode = {"pagedkv-lru": 0.9, "vllm": 4.5, "sglang": 1.2, "max": 6.0}
    lines = compare_lines({"rows": rows, "config": {"default_manager": "pagedkv-lru"}, "decode": decode})
    assert lines[3] == ("- A plain decode step (no page taken or filled): 0.90 µs per request, 0.20 of vLLM 0.33's "
                        "(4.50) and 0.15 of MAX 26.3's (6.00).")  # fmt: skip
    rows += [
        _row("zipf", 100, "pagedkv-lru-noqueue", 0.49, 0.8),
        _row("multiturn", 50, "pagedkv-lru-noqueue", 0.21, 1.5),
    ]
    lines = compare_lines({"rows": rows, "config": {"default_manager": "pagedkv-lru"}, "decode": decode})
    assert lines[4] == ("- The same manager under a scheduler that never tells it the queue (`pagedkv-lru-noqueue`: "
                        "no queue-aware retention, hit rates within 1.00 points of vLLM 0.33's): 0.20 to 0.30 of "
                        "vLLM 0.33's and 0.40 to 0.40 of MAX 26.3's.")  # fmt: skip


def test_state_lines_count_cells_against_the_ceiling_and_vllm() -> None:
    def row(budget: int, manager: str, hit: float) -> dict[str, object]:
        return {"workload": "zipf", "budget_bytes": budget, "manager": manager, "fits": True, "hit_rate": hit}

    rows = [row(1, "ceiling", 0.5), row(1, "pagedkv", 0.46), row(1, "vllm-hybrid", 0.2),
            row(2, "ceiling", 0.6), row(2, "pagedkv", 0.53), row(2, "vllm-hybrid", 0.53)]  # fmt: skip
    (line,) = state_lines({"rows": rows, "bytes": {"state_row": 3 * 2**20, "checkpoint_pages": 6}})
    assert "2 cells): at least 90% of the same model with every layer full attention in 1, above vLLM" in line
    assert "align mode in 1 of 2; a state checkpoint is 3.0 MiB, a run of 6 attention pages." in line


def test_the_readme_block_is_rendered_from_docs_figures(capsys: pytest.CaptureFixture[str]) -> None:
    readme = (ROOT / "README.md").read_text()
    assert readme.count(BEGIN) == 1 and readme.count(END) == 1
    argv = [
        "--check",
        "--figures",
        str(ROOT / "docs" / "figures"),
        "--readme",
        str(ROOT / "README.md"),
    ]
    assert main("benchmarks.headline", argv=argv) == 0, capsys.readouterr().out  # (typed-by-hand figures would differ)
    assert replace_block("a\n" + BEGIN + "\nold\n" + END + "\nb", render(None, None)) == f"a\n{BEGIN}\n\n\n{END}\nb"
    with pytest.raises(ValueError, match="markers are missing"):
        replace_block("no block here", render(None, None))
