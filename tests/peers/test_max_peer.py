"""Modular MAX 26.3's `PagedKVCacheManager` as the `benchmarks.compare` peer "max", driven by its worker.

Run in `.venv-peers` (`make test-peers`): the worker process runs in `.venv-max` (or
``$PAGEDKV_MAX_PYTHON``). Where that environment is missing the tests skip, unless
PAGEDKV_REQUIRE_PEERS=1, where they fail. MAX commits full pages at `step` and knows nothing of the
waiting queue, as pagedkv with ``commit_on_alloc=False`` and no queue-aware retention (`StepCommit`), so
the hit counts are compared with that configuration on the same traces, page size and capacity; every
expected value is also derived by hand (page 16):

- 40 requests, request i = system prompt i % 4 (64 tokens) + 20 unique tokens, 8 generated, all
  admitted in the first step: nothing is committed before the first forward pass, so 0 hits. One at
  a time: 36 * 64 = 2304.
- Conversation: turn 2 hits the 96 tokens of turn 1's full pages; turn 3 (turn 1's first 96 tokens)
  is capped at 95 tokens, page-aligned: 80.
- Eviction, one request at a time in a 10-page pool: six distinct 48-token prompts (3 pages each,
  all cached when they finish), then prompt 2 and prompt 3 again. Both managers free a request's
  pages tail first and evict the least recently freed, so prompts 0 and 1 and the tails of prompt 2
  go first: prompt 2 again hits its first page (16 tokens) and takes two pages of prompt 3, so
  prompt 3 again hits its first page only (16).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_peer_adapters import _conversation, _shared_prefix_trace, _tokens  # (the same traces as the other peers)

from benchmarks.command import main
from benchmarks.compare.pagedkv_adapter import PagedKVAdapter, compare_params
from benchmarks.compare.peer_max import MaxWorker
from benchmarks.compare.peers import PeerUnavailable
from benchmarks.compare.sim import SimConfig, SimResult, simulate
from pagedkv.workloads.traces import TraceRequest

PAGE = 16


@pytest.fixture(scope="module")
def worker() -> Any:
    try:
        w = MaxWorker()
    except PeerUnavailable as exc:
        if os.environ.get("PAGEDKV_REQUIRE_PEERS") == "1":
            pytest.fail(f"{exc}, and PAGEDKV_REQUIRE_PEERS=1")
        pytest.skip(str(exc))
    yield w
    w.close()


def _eviction_trace() -> list[TraceRequest]:
    rng = np.random.default_rng(3)
    prompts = [_tokens(rng, 48) for _ in range(6)]
    reqs = [TraceRequest(i, np.concatenate([p, _tokens(rng, 1)]), 48) for i, p in enumerate(prompts)]
    for rid, again in ((6, 2), (7, 3)):
        reqs.append(TraceRequest(rid, np.concatenate([prompts[again], _tokens(rng, 1)]), 48))
    return reqs


class StepCommit(PagedKVAdapter):
    """pagedkv as MAX schedules: pages hittable once their step ran, no queue-aware retention."""

    def lookahead(self, waiting: Any) -> None:
        pass


def _both(worker: MaxWorker, trace: list[TraceRequest], pages: int, config: SimConfig) -> tuple[SimResult, SimResult]:
    theirs = worker.replay(pages, PAGE, config, trace=trace)
    ours = simulate(StepCommit("pagedkv-lru-step", compare_params(PAGE, commit_on_alloc=False), pages), trace, config)
    assert theirs.name == "max"
    return theirs, ours


@pytest.mark.parametrize(("seqs", "hits", "steps"), [(256, 0, 8), (1, 2304, 320)])
def test_shared_prefix_hits_match_pagedkv(worker: MaxWorker, seqs: int, hits: int, steps: int) -> None:
    theirs, ours = _both(worker, _shared_prefix_trace(), 1000, SimConfig(max_num_seqs=seqs))
    assert (theirs.first_prompt_tokens, theirs.first_hit_tokens) == (40 * 84, hits)
    assert (ours.first_prompt_tokens, ours.first_hit_tokens) == (40 * 84, hits)
    assert (theirs.steps, theirs.request_steps, theirs.preemptions) == (steps, 320, 0)
    assert theirs.first_admission_order == ours.first_admission_order == list(range(40))
    assert theirs.prefill_tokens_computed == ours.prefill_tokens_computed == 40 * 84 - hits
    assert theirs.bookkeeping_us > 0 and set(theirs.seconds) == {"admit", "extend", "advance", "free", "lookahead"}


def test_conversation_hits_prompt_and_output_pages(worker: MaxWorker) -> None:
    theirs, ours = _both(worker, _conversation(), 100, SimConfig())
    assert theirs.first_admission_order == [0, 1, 2]
    assert theirs.first_prompt_tokens == ours.first_prompt_tokens == 84 + 114 + 96
    assert theirs.first_hit_tokens == ours.first_hit_tokens == 0 + 96 + 80


def test_small_pool_evicts_alike(worker: MaxWorker) -> None:
    theirs, ours = _both(worker, _eviction_trace(), 10, SimConfig(max_num_seqs=1))
    assert theirs.first_hit_tokens == ours.first_hit_tokens == 16 + 16
    assert theirs.peak_used_pages == ours.peak_used_pages == 3
    assert theirs.preemptions == ours.preemptions == 0


def test_a_tight_pool_preempts_and_completes(worker: MaxWorker) -> None:
    trace = _shared_prefix_trace(suffix=28)  # 92-token prompts take 6 pages and grow into a 7th (KV up to 99)
    theirs = worker.replay(12, PAGE, SimConfig(), trace=trace)
    assert theirs.preemptions > 0
    assert theirs.prefill_tokens_computed > theirs.first_prompt_tokens - theirs.first_hit_tokens  # recomputed
    assert sorted(theirs.first_admission_order) == list(range(40))
    assert theirs.peak_used_pages <= 12


def test_bench_compare_has_a_max_column(worker: MaxWorker, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "compare.json"
    argv = ["--workloads", "fewshot", "--requests", "40", "--fractions", "1.0",
            "--peers", "max", "--policies", "pagedkv-lru-step", "--no-belady", "--json", str(out)]  # fmt: skip
    assert main("benchmarks.compare", argv=argv) == 0
    data = json.loads(out.read_text())
    rows = {r["manager"]: r for r in data["rows"]}
    assert set(rows) == {"pagedkv-lru-step", "max"} and "max" not in data["skipped"]
    assert rows["max"]["hit_rate"] > 0 and rows["max"]["bookkeeping_us"] > 0
    assert rows["max"]["request_steps"] == rows["pagedkv-lru-step"]["request_steps"]
    header = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| workload | pages |"))
    assert header.rstrip(" |").endswith("max")


def test_plain_decode_steps_are_timed_in_maxs_process(worker: MaxWorker) -> None:
    """The decode-step figure of `benchmarks.compare`: MAX's worker times the same plain decode steps."""
    from pagedkv.workloads.traces import decode_trace

    res = worker.replay(64, 4, SimConfig(page_size=4), trace=decode_trace(4, 8))
    assert res.decode_request_steps == 8 * 2 and res.decode_us > 0
    assert worker.replay(64, 4, SimConfig(), trace=decode_trace(4, 8)).decode_request_steps == 0
