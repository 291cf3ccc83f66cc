"""`python -m benchmarks.compare.state_prefix`: the hybrid adapter (state checkpoints) on hand-derived traces, the byte
arithmetic, the ceiling, and the sweep's tables and CLI (without vLLM: its tests are tests/peers)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from benchmarks.command import main
from benchmarks.compare.pagedkv_adapter import PagedKVAdapter
from benchmarks.compare.pagedkv_hybrid import (
    StateCheckpointAdapter,
    budget_pages,
    ceiling_params,
    gdn_spec,
    hybrid_params,
)
from benchmarks.compare.sim import SimConfig, simulate
from benchmarks.compare.state_prefix import budgets, format_markdown, run_state_prefix, verdict
from pagedkv.core.errors import InsufficientBlocksError
from pagedkv.core.memory import checkpoint_pages, num_state_rows, pool_page_bytes, state_row_bytes
from pagedkv.params.state import StateCacheParams
from pagedkv.workloads.traces import TraceRequest, ideal_hit_rates, make_trace

ROW = 24 * (8192 * 3 * 2 + 32 * 128 * 128 * 4)  # 24 GDN layers: conv (8192, 3) bf16 + recurrent (32, 128, 128) fp32
PAGE = 8 * 16 * 4 * 256 * 2 * 2  # 8 attention layers x 16 tokens x K and V of 4 heads x 256 in bf16
CEILING_PAGE = 4 * PAGE  # all 32 layers


def req(rid: int, prompt: np.ndarray | list[int], outputs: list[int], after: int | None = None) -> TraceRequest:
    tokens = np.concatenate([np.asarray(prompt, dtype=np.int32), np.asarray(outputs, dtype=np.int32)])
    return TraceRequest(rid, tokens, len(prompt), after)


def test_params_and_bytes_are_the_qwen35_shapes() -> None:
    params = hybrid_params(max_state_checkpoints=5)
    leaves = params.leaves()
    assert [leaf.num_layers for leaf in leaves] == [8, 8, 8, 8]  # attention first, then 3 state groups
    assert not isinstance(leaves[0], StateCacheParams) and all(isinstance(x, StateCacheParams) for x in leaves[1:])
    assert gdn_spec().shapes == ((8192, 3), (32, 128, 128))
    assert pool_page_bytes(params) == PAGE == 524_288 and state_row_bytes(params) == ROW == 51_511_296
    assert ceiling_params().bytes_per_block == CEILING_PAGE == 2 * 1024 * 1024
    assert num_state_rows(params, 4) == 4 == num_state_rows(hybrid_params(), 4)  # live rows only
    assert checkpoint_pages(params) == -(-ROW // PAGE) == 99  # a checkpoint is a run of attention pages
    budget = 4 * ROW + 100 * PAGE + PAGE - 1
    assert budget_pages(params, budget, 4) == 100  # the live rows are paid first, the rest buys whole pages
    with pytest.raises(InsufficientBlocksError, match="state rows"):
        budget_pages(params, 4 * ROW - 1, 4)


def test_hits_on_a_hand_derived_trace_against_the_ceiling() -> None:
    """One request at a time (S = 1), pages and rows ample. A system prompt of 40 tokens (2 full pages + 8):

    - r0 = SYS + 10 (50 tokens), 2 generated: no hit. Checkpoints before its prompt's last token (49: a chunk ends
      there) and at release (51, the state after its decode step). Its pages 0-2 are committed (51 computed tokens).
    - r1 = SYS + 10 others: pages 0, 1 are cached but no state sits at 32: hit 0, and the chunk ends at the cut 32,
      where the state is saved. The ceiling hits 32.
    - r2 = SYS + 10 others: pages 0, 1 and r1's checkpoint at 32 (empty tail): hit 32 (ceiling 32).
    - r3 = r0's 52 tokens + 5 (r0's next turn): r0's release checkpoint at 51 (tail of 3 on page 3): hit 51, token
      granular; the ceiling stops at r0's 3 committed pages, 48.
    Hybrid 0 + 0 + 32 + 51 = 83, ceiling 0 + 32 + 32 + 48 = 112 of 3 * 50 + 57 prompt tokens."""
    system = list(range(1000, 1040))
    r0 = req(0, [*system, *range(2000, 2010)], [7, 8])
    trace = [r0, req(1, [*system, *range(3000, 3010)], [5, 6]), req(2, [*system, *range(4000, 4010)], [5, 6]),
             req(3, [*r0.tokens.tolist(), *range(5000, 5005)], [9, 9], after=0)]  # fmt: skip
    one = SimConfig(max_num_seqs=1)
    hybrid = StateCheckpointAdapter("hybrid", hybrid_params(max_state_checkpoints=16), 1000, 1)
    res = simulate(hybrid, trace, one)
    assert res.first_admission_order == [0, 1, 2, 3] and res.first_prompt_tokens == 207
    assert res.first_hit_tokens == 83 and res.prefill_tokens_computed == 207 - 83
    states = hybrid.states
    assert states.num_hits == 2 and hybrid.cut_chunks == 1 + 4  # r1's divergence cut, each prompt's end
    assert states.num_saved == 2 + 3 + 2 + 2  # r1 adds the cut
    assert len(states) == 9 and all(len(e.run) == 99 for e in states._entries.values())  # every save in a run
    assert hybrid.state_copies == 5 + 4 + 2 and hybrid.tail_copies == 1  # 5 saves, 4 releases, 2 restores; r3's tail
    hybrid.coord.check_integrity()
    ceiling = simulate(PagedKVAdapter("ceiling", ceiling_params(commit_on_alloc=True), 1000, 1), trace, one)
    assert ceiling.first_hit_tokens == 112
    assert ideal_hit_rates(trace, 16)[0] == 112 / 207


def test_a_small_checkpoint_cap_loses_the_divergence_checkpoint() -> None:
    """C = 1: r1's cut checkpoint at 32 is evicted (LRU) by its own prompt-end save, so r2 misses; C = 3 keeps it
    (r1's three saves fill the three rows, r0's two are the oldest)."""
    system = list(range(1000, 1040))
    trace = [req(i, [*system, *range(2000 + 10 * i, 2010 + 10 * i)], [5, 6]) for i in range(3)]
    one = SimConfig(max_num_seqs=1)
    hits = {c: simulate(StateCheckpointAdapter("h", hybrid_params(max_state_checkpoints=c), 1000, 1), trace,
                        one).first_hit_tokens for c in (1, 3)}  # fmt: skip
    assert hits == {1: 0, 3: 32}


def test_checkpoint_tails_never_block_a_request_that_fits_alone() -> None:
    """8 pages, S = 1, C = 3. r0-r2 (20-token prompts, 1 generated) each leave a checkpoint at 20 whose tail holds
    their page 1; the 4 rows are never short, so none is evicted by rows. r3 needs all 8 pages (126 tokens): 5
    are free, and the checkpoints give their 3 tail pages back (least recently used first) instead of a stall."""
    trace = [req(i, list(range(100 * i, 100 * i + 20)), [1]) for i in range(3)]
    trace.append(req(3, list(range(5000, 5126)), [1]))
    assert simulate(PagedKVAdapter("c", ceiling_params(), 8, 1), trace, SimConfig(max_num_seqs=1)).steps > 0
    adapter = StateCheckpointAdapter("h", hybrid_params(max_state_checkpoints=3), 8, 1)
    assert simulate(adapter, trace, SimConfig(max_num_seqs=1)).steps > 0


def test_budgets_start_where_the_smallest_checkpoint_cap_runs() -> None:
    trace = make_trace("fewshot", 40)
    longest = max(-(-len(r.tokens) // 16) for r in trace)
    rows = 8  # S = 8 live rows
    floor = rows * ROW + (2 * longest + rows) * PAGE
    got = budgets(trace, [0.001, 1e6], 8)
    assert got[0] == -(-floor // 2**20) * 2**20 and len(got) == 2 and got[1] > got[0]


def test_sweep_tables_verdict_and_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = run_state_prefix(["docqa"], 24, fractions=[0.5, 2.0], checkpoint_multiples=[1, 2], max_num_seqs=4,
                              peers=[])  # fmt: skip
    managers = {r["manager"] for r in result["rows"]}
    assert managers == {"ceiling", "ceiling-step", "pagedkv-c4", "pagedkv-c8", "pagedkv-nocap", "pagedkv"}
    assert result["config"]["default_checkpoints"] is None and result["bytes"]["state_row"] == ROW
    assert result["bytes"]["checkpoint_pages"] == 99
    top = max(r["budget_bytes"] for r in result["rows"])
    cell = {r["manager"]: r for r in result["rows"] if r["budget_bytes"] == top}
    assert cell["ceiling"]["hit_rate"] == pytest.approx(result["workloads"]["docqa"]["ideal"]["page"])
    # the default (no cap set) keeps two runs per batch slot, in its pages; a cap keeps at most that many
    assert cell["pagedkv"]["default"] and cell["pagedkv"]["checkpoints"] is None
    kept = {m: cell[m]["checkpoints_kept"] for m in ("pagedkv", "pagedkv-c4")}
    assert kept["pagedkv-c4"] <= 4 + 4 and kept["pagedkv"] <= 8 + 4  # (+ at most one in each of the 4 live rows)
    assert cell["pagedkv-nocap"]["checkpoints_kept"] <= cell["pagedkv-nocap"]["pages"] // 99 + 4
    assert cell["pagedkv"]["hit_rate"] > 0
    text = format_markdown(result)
    assert "| docqa |" in text and "pagedkv C=8" in text and "51,511,296 B" in text
    assert verdict(result)["manager"] == "pagedkv" and not verdict(result)["vllm_compared"]
    out = tmp_path / "sp.json"
    argv = ["--workloads", "fewshot", "--requests", "12", "--fractions", "1.0",
            "--max-seqs", "2", "--checkpoints", "2", "--peers", "", "--json", str(out)]  # fmt: skip
    assert main("benchmarks.compare.state_prefix", argv=argv) == 0
    data = json.loads(out.read_text())
    assert {r["manager"] for r in data["rows"]} == {"ceiling", "ceiling-step", "pagedkv-c4", "pagedkv-nocap", "pagedkv"}
    assert "| fewshot |" in capsys.readouterr().out
    assert main("benchmarks.compare.state_prefix", argv=["--from-json", str(out)]) == 0
    assert "pagedkv C=4" in capsys.readouterr().out
