"""`python -m benchmarks.compare`: the shared driver, the workloads, the bounds, the report and the CLI."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from benchmarks.command import main, parser
from benchmarks.compare.pagedkv_adapter import BeladyAdapter, PagedKVAdapter, compare_params
from benchmarks.compare.report import format_markdown, policy_verdict, write_plots
from benchmarks.compare.run import POLICIES, capacities, pagedkv_adapter, run_compare
from benchmarks.compare.sim import SimConfig, simulate
from pagedkv.workloads.traces import WORKLOADS, TraceRequest, decode_trace, ideal_hit_rates, make_trace, unique_pages

PS = 16


def req(rid: int, prompt: np.ndarray, n_out: int, after: int | None = None, seed: int = 0) -> TraceRequest:
    out = np.random.default_rng([seed, rid]).integers(0, 32000, n_out, dtype=np.int32)
    return TraceRequest(rid, np.concatenate([prompt, out]).astype(np.int32), len(prompt), after)


def shared_trace(n_out: int = 8) -> list[TraceRequest]:
    """4 system prompts of 64 tokens x 10 requests, each + 20 unique tokens, `n_out` generated."""
    rng = np.random.default_rng(7)
    systems = [rng.integers(0, 32000, 64, dtype=np.int32) for _ in range(4)]
    return [req(i, np.concatenate([systems[i % 4], rng.integers(0, 32000, 20, dtype=np.int32)]), n_out)
            for i in range(40)]  # fmt: skip


def test_ample_cache_reaches_the_ideal_exactly() -> None:
    trace = shared_trace()
    page_ideal, token_ideal = ideal_hit_rates(trace, PS)
    assert page_ideal == 36 * 64 / (40 * 84)  # all but the first of each group hit 4 full pages
    assert token_ideal == page_ideal  # the unique suffixes start on a page boundary
    one_at_a_time = SimConfig(max_num_seqs=1)  # (pages are hittable once written: after their step)
    res = simulate(PagedKVAdapter("lru", compare_params(PS), 1000), trace, one_at_a_time)
    assert res.hit_rate == page_ideal and res.preemptions == 0
    assert res.first_prompt_tokens == 40 * 84 and res.prefill_tokens_computed == 40 * 84 - 36 * 64
    assert sorted(res.first_admission_order) == list(range(40))


def test_next_turn_hits_the_previous_turns_committed_pages() -> None:
    first = req(0, np.arange(100, 150, dtype=np.int32), 10)  # 50 + 10 tokens; computes 59 -> 3 full pages
    second = req(1, np.concatenate([first.tokens, np.arange(7, dtype=np.int32)]), 5, after=0)
    res = simulate(PagedKVAdapter("lru", compare_params(PS), 100), [first, second])
    assert res.first_hit_tokens == 48  # 3 pages; the partial 4th page is not reused
    assert res.first_admission_order == [0, 1] and res.steps == 10 + 5


def test_tight_cache_preempts_and_still_finishes() -> None:
    trace = shared_trace(n_out=30)  # 84 prompt tokens take 6 pages; decoding to 113 needs 8
    res = simulate(PagedKVAdapter("lru", compare_params(PS), 12), trace, SimConfig(max_num_seqs=8))
    assert res.preemptions > 0 and len(res.first_admission_order) == 40
    assert res.prefill_tokens_computed > res.first_prompt_tokens - res.first_hit_tokens  # recomputation


def test_workloads_are_seeded_and_shaped_as_documented() -> None:
    for name in WORKLOADS:
        a, b = make_trace(name, 50), make_trace(name, 50)
        assert all(np.array_equal(x.tokens, y.tokens) and x.after == y.after for x, y in zip(a, b, strict=True))
        assert not np.array_equal(a[0].tokens, make_trace(name, 50, seed=1)[0].tokens)
    turns = make_trace("multiturn", 200)
    assert len(turns) == 200
    for r in turns[1:5]:  # the first conversation: each turn extends the previous turn's whole context
        prev = turns[r.after]  # type: ignore[index]
        assert r.prompt_len == len(prev.tokens) + 90 and np.array_equal(r.tokens[: len(prev.tokens)], prev.tokens)
    assert turns[32 * 5].after == turns[4].rid  # conversation 32 starts when conversation 0 ends
    assert [len(r.tokens) for r in make_trace("docqa", 3)] == [3990 + 30 + 64] * 3
    assert ideal_hit_rates(make_trace("nosharing", 20), PS) == (0.0, 0.0)
    with pytest.raises(ValueError, match="workload='chat' must be one of"):
        make_trace("chat", 10)


def test_token_granular_ideal_counts_the_matching_part_of_the_next_page() -> None:
    base = np.arange(1000, 1040, dtype=np.int32)
    a = req(0, base, 1)  # computes 40 tokens (its only output is never computed)
    b = req(1, np.concatenate([base[:37], np.array([5, 6, 7], dtype=np.int32)]), 1)  # shares 37 tokens
    page, token = ideal_hit_rates([a, b], PS)
    assert page == 32 / 80 and token == 37 / 80
    assert unique_pages([a, b], PS) == 2 + 0  # b's 39 computed tokens: pages 0, 1 are a's


def test_belady_evicts_the_page_needed_last_and_never_trails_lru() -> None:
    trace = make_trace("zipf", 120)
    pages = capacities(trace, PS, [0.1], 256)[0]
    lru = simulate(PagedKVAdapter("lru", compare_params(PS), pages), trace)
    belady = BeladyAdapter(compare_params(PS), pages, trace, lru.first_admission_order)
    bel = simulate(belady, trace)
    assert bel.hit_rate >= lru.hit_rate > 0
    key = belady.oracle.prompt_keys[lru.first_admission_order[-1]][0]  # the last admission's first page
    assert belady.oracle.uses[key][-1] == len(trace) - 1


def test_policy_verdict_picks_the_best_policy_that_never_loses_a_point() -> None:
    def row(m: str, hit: float, cap: int) -> dict:
        return {"workload": "w", "capacity_pages": cap, "manager": m, "hit_rate": hit}

    rows = [row("pagedkv-lru", 0.50, 1), row("pagedkv-a", 0.60, 1), row("pagedkv-b", 0.52, 1),
            row("pagedkv-lru", 0.50, 2), row("pagedkv-a", 0.48, 2), row("pagedkv-b", 0.505, 2)]  # fmt: skip
    verdict = policy_verdict({"rows": rows}, candidates=("pagedkv-a", "pagedkv-b"))
    assert verdict["winner"] == "pagedkv-b"  # a gains more on average but loses 2 points at capacity 2
    assert verdict["policies"]["pagedkv-a"]["worst"] == pytest.approx(-0.02)


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="matplotlib (extra pagedkv[bench])")
def test_run_compare_writes_tables_and_plots(tmp_path: Path) -> None:
    result = run_compare(["fewshot"], 40, fractions=[0.3, 1.0], peers=["vllm"], floor_pages=64)
    managers = {r["manager"] for r in result["rows"]}
    if importlib.util.find_spec("vllm") is None:
        assert "vllm" in result["skipped"] and "vllm" not in managers  # reported, not faked
    assert {"pagedkv-lru", "pagedkv-lru-step", "pagedkv-lru-noqueue", "pagedkv-slru", "pagedkv-lfu", "pagedkv-arc",
            "pagedkv-lru-leaves", "belady"} <= managers  # fmt: skip
    lru, step = ({r["capacity_pages"]: r["hit_rate"] for r in result["rows"] if r["manager"] == m}
                 for m in ("pagedkv-lru", "pagedkv-lru-step"))  # fmt: skip
    assert all(lru[c] >= step[c] for c in lru)  # schedule-time caching (the default) never hits less
    caps = sorted({r["capacity_pages"] for r in result["rows"]})
    assert len(caps) == 2 and caps[-1] == unique_pages(make_trace("fewshot", 40), PS)
    top = {r["manager"]: r for r in result["rows"] if r["capacity_pages"] == caps[-1]}
    assert 0 < top["pagedkv-lru"]["hit_rate"] <= result["ideal"]["fewshot"]["page"]  # (same-step misses)
    text = format_markdown(result)
    assert "| fewshot |" in text and "Winner" in text and "pagedkv_sha256" in text
    assert "| lru-noqueue/vllm |" in text if "vllm" in managers else "| lru/vllm |" not in text
    paths = write_plots(result, tmp_path)
    assert [p.name for p in paths] == ["hit_rate_fewshot.png", "bookkeeping_us.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in paths)


def test_cli_compare_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "compare.json"
    argv = ["--workloads", "nosharing", "--requests", "20", "--fractions", "1.0",
            "--peers", "", "--policies", "pagedkv-lru", "--no-belady", "--json", str(out)]  # fmt: skip
    assert main("benchmarks.compare", argv=argv) == 0
    data = json.loads(out.read_text())
    assert [r["manager"] for r in data["rows"]] == ["pagedkv-lru"] and data["rows"][0]["hit_rate"] == 0.0
    assert data["config"]["default_manager"] == "pagedkv-lru"  # the row that runs KVCacheParams' defaults
    assert set(data["decode"]) == {"pagedkv-lru"} and 0 < data["decode"]["pagedkv-lru"] < 100
    text = capsys.readouterr().out
    assert "| nosharing |" in text and "### Plain decode step" in text
    head, rule, row = text.split("### Plain decode step")[1].split("\n")[2:5]  # a table of one column, one row
    assert (head, rule) == ("| pagedkv-lru |", "|---|") and row == f"| {data['decode']['pagedkv-lru']:.2f} |"
    data["decode"].update(vllm=4 * data["decode"]["pagedkv-lru"])  # with a peer: its column and the ratio
    out.write_text(json.dumps(data))
    assert main("benchmarks.compare", argv=["--from-json", str(out)]) == 0
    head, rule, row = capsys.readouterr().out.split("### Plain decode step")[1].split("\n")[2:5]
    assert (head, rule) == ("| pagedkv-lru | vllm | pagedkv-lru/vllm |", "|---|---|---|") and row.endswith("| 0.25 |")
    assert main("benchmarks.compare", argv=["--from-json", str(out)]) == 0  # re-render without replaying
    assert "| nosharing | " in capsys.readouterr().out


@pytest.mark.parametrize("page_size", [4, 16])
def test_plain_decode_steps_are_timed_on_their_own(page_size: int) -> None:
    """`decode_trace`: 2 full pages + 1 token, then page_size - 1 new tokens. The prefill step makes the first
    one; each of the other page_size - 2 is a plain decode step for all 8 requests at once."""
    trace = decode_trace(page_size, 8)
    assert [(r.prompt_len, r.output_len) for r in trace] == [(2 * page_size + 1, page_size - 1)] * 8
    adapter = PagedKVAdapter("pagedkv-lru", compare_params(page_size), 64)
    res = simulate(adapter, trace, SimConfig(page_size=page_size))
    assert res.decode_request_steps == 8 * (page_size - 2) and res.request_steps == 8 * (page_size - 1)
    assert 0 < res.decode_seconds < res.seconds["extend"] + res.seconds["advance"]
    assert res.decode_us == pytest.approx(1e6 * res.decode_seconds / res.decode_request_steps)
    untimed = simulate(PagedKVAdapter("pagedkv-lru", compare_params(page_size), 64), trace, SimConfig())
    assert untimed.decode_request_steps == 0 and untimed.decode_us == 0.0
    if page_size == 4:  # 4 prompts a step: r0-r3, then r4-r6 and 5 tokens of r7's; only steps 4 (r4-r7) and 5
        # (r7) have nobody waiting or prefilling (steps 2 and 3 had a queue, or r7's prefill)
        budget = SimConfig(max_num_batched_tokens=4 * (2 * page_size + 1), page_size=page_size)
        assert simulate(PagedKVAdapter("x", compare_params(page_size), 64), trace, budget).decode_request_steps == 5


class _Recording(PagedKVAdapter):
    """The real adapter, recording each call it gets (and refusing extends when `refuse` is set)."""

    def __init__(self, *args: object, refuse: bool = False) -> None:
        super().__init__(*args)  # type: ignore[arg-type]
        self.calls: list[tuple[object, ...]] = []
        self.refuse = refuse

    def new_step(self) -> None:
        self.calls.append(("new_step",))

    def extend(self, req: TraceRequest, n: int) -> bool:
        self.calls.append(("extend", req.rid, n))
        return not self.refuse and super().extend(req, n)

    def advance(self, batch: object) -> None:
        self.calls.append(("advance", [(r.rid, n) for r, n in batch]))  # type: ignore[attr-defined]
        super().advance(batch)  # type: ignore[arg-type]


@pytest.mark.parametrize("workload", ["multiturn", "docqa"])
def test_timing_decode_steps_changes_no_call_and_no_counter(workload: str) -> None:
    """Plain decode steps timed as one interval (`SimConfig.page_size`) make the same calls, in the same order,
    as the per-call timing, and the replay's counters are the same."""
    trace = make_trace(workload, 60, 3)
    runs = []
    for config in (SimConfig(), SimConfig(page_size=PS)):
        adapter = _Recording("pagedkv-lru", compare_params(PS), 300)
        res = simulate(adapter, trace, config)
        adapter.mgr._managers[0].check_integrity()
        runs.append((adapter.calls, res.hit_rate, res.request_steps, res.preemptions, res.steps))
    assert runs[0] == runs[1]
    assert runs[0][2] > 0 and simulate(_Recording("x", compare_params(PS), 300), trace,
                                       SimConfig(page_size=PS)).decode_request_steps > 0  # fmt: skip


class _RefusesAfterPrefill(_Recording):
    def advance(self, batch: object) -> None:
        super().advance(batch)
        self.refuse = True  # every later extend (the plain decode steps of `decode_trace`) is refused


def test_a_refused_plain_decode_token_is_a_manager_bug() -> None:
    adapter = _RefusesAfterPrefill("refusing", compare_params(PS), 64)
    with pytest.raises(RuntimeError, match="refusing: extend refused request 0's decode token"):
        simulate(adapter, decode_trace(PS, 4), SimConfig(page_size=PS))
    assert adapter.calls[-2:] == [("new_step",), ("extend", 0, 1)]


def test_cli_default_policies_are_the_benchmarks() -> None:
    args = parser("benchmarks.compare").parse_args([])
    assert tuple(args.policies.split(",")) == tuple(POLICIES)


def test_max_without_its_environment_is_reported_skipped(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PAGEDKV_MAX_PYTHON", str(tmp_path / "no-such-python"))
    result = run_compare(["nosharing"], 10, fractions=[1.0], peers=["max"], policies=["pagedkv-lru"], belady=False)
    assert [r["manager"] for r in result["rows"]] == ["pagedkv-lru"]
    assert "no-such-python" in result["skipped"]["max"] and ".venv-max" in result["skipped"]["max"]
    assert "Skipped max:" in format_markdown(result)


def test_max_python_defaults_to_the_checkouts_venv(monkeypatch: pytest.MonkeyPatch) -> None:
    from benchmarks.compare import peer_max

    monkeypatch.delenv("PAGEDKV_MAX_PYTHON", raising=False)
    root = Path(peer_max.__file__).resolve().parents[2]
    assert peer_max.max_python() == str(root / ".venv-max" / "bin" / "python")
    assert (root / "pyproject.toml").exists()


def test_repeats_keep_each_managers_fastest_replay_and_the_same_counters() -> None:
    """`repeats` replays every manager per cell in turn: the rows (hit rates, counters) are those of one replay,
    the bookkeeping time is the least of them; 0 repeats is refused."""
    once = run_compare(["zipf"], 30, fractions=[0.5], peers=[], policies=["pagedkv-lru", "pagedkv-slru"], belady=False)
    twice = run_compare(["zipf"], 30, fractions=[0.5], peers=[], policies=["pagedkv-lru", "pagedkv-slru"],
                        belady=False, repeats=2)  # fmt: skip
    strip = ("bookkeeping_us", "seconds")
    assert [{k: v for k, v in r.items() if k not in strip} for r in once["rows"]] == \
        [{k: v for k, v in r.items() if k not in strip} for r in twice["rows"]]  # fmt: skip
    assert [r["manager"] for r in twice["rows"]] == ["pagedkv-lru", "pagedkv-slru"] and twice["config"]["repeats"] == 2
    with pytest.raises(ValueError, match="repeats=0"):
        run_compare(["zipf"], 30, fractions=[0.5], peers=[], belady=False, repeats=0)


def test_the_no_queue_row_runs_the_defaults_without_expect() -> None:
    """`pagedkv-lru-noqueue`: the defaults' manager, never told the queue. With room for everything the two rows hit
    the same tokens; in a pool of 18 pages the queue-aware row keeps what the queue's head will hit (1536 tokens hit
    against 576), and only it spends time in `lookahead`."""
    trace = shared_trace()
    for pages, same in ((unique_pages(trace, PS), True), (18, False)):
        runs = {}
        for name in ("pagedkv-lru", "pagedkv-lru-noqueue"):
            adapter = pagedkv_adapter(name, pages, PS)
            runs[name] = simulate(adapter, trace, SimConfig(max_num_seqs=4))
            adapter.mgr.check_integrity()
            assert adapter.bm.pool.num_wanted == 0
        lru, noqueue = runs["pagedkv-lru"], runs["pagedkv-lru-noqueue"]
        assert noqueue.seconds["lookahead"] == 0 < lru.seconds["lookahead"]
        assert (noqueue.first_hit_tokens, lru.first_hit_tokens) == (
            (2304, 2304) if same else (576, 1536)
        )  # (36 x 64: the ideal)
