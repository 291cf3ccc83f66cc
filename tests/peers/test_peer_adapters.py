"""The real vLLM `KVCacheManager` and SGLang `RadixCache` driven by the benchmark loop (`sim.simulate`).

Run in `.venv-peers` (`make test-peers`). Where vLLM / SGLang do not import the
tests skip, unless PAGEDKV_REQUIRE_PEERS=1, where they fail. Every expected value
below is derived by hand from the trace (page 16):

- 40 requests, request i = system prompt i % 4 (64 tokens) + 20 unique tokens,
  8 generated. All 40 fit the first step (3360 tokens <= 8192, 40 <= 256 seqs).
  vLLM registers block hashes at schedule time, so requests 4..39 hit their
  prefix in that same step: 36 * 64 = 2304 hit tokens. SGLang inserts into the
  tree after the forward pass, so nothing hits in step 1: 0. One request at a
  time, both reach 2304. Pinned pages after a step: 4 prefixes * 4 shared pages
  + 40 * 2 own pages (tokens 64..91) = 96.
- Conversation: turn 1 = 84-token prompt + 20 generated (104 tokens, KV for
  103); turn 2 = those 104 + 10 new tokens. Full pages of turn 1 (prompt and
  output) are cached: 96 tokens hit. Turn 3 repeats turn 1's first 96 tokens
  exactly: the hit is capped at num_tokens - 1 = 95, page-aligned: 80.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest

from benchmarks.compare.peers import PeerUnavailable, load_peer
from benchmarks.compare.sim import SimConfig, simulate
from pagedkv.workloads.traces import TraceRequest

pytestmark = pytest.mark.filterwarnings(
    "ignore:Only CUDA:UserWarning", "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"
)  # SGLang's import-time notices on a CPU-only torch
PEERS = ["vllm", "sglang"]
PAGE = 16


def _peer(name: str, **kwargs: Any) -> Any:
    """The adapter, or skip (fail under PAGEDKV_REQUIRE_PEERS=1) when the engine does not import."""
    try:
        return load_peer(name, **kwargs)
    except PeerUnavailable as exc:
        if os.environ.get("PAGEDKV_REQUIRE_PEERS") == "1":
            pytest.fail(f"{exc}, and PAGEDKV_REQUIRE_PEERS=1")
        pytest.skip(str(exc))


def _tokens(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(0, 32_000, size=n, dtype=np.int32)


def _shared_prefix_trace(suffix: int = 20, output: int = 8, n: int = 40) -> list[TraceRequest]:
    rng = np.random.default_rng(0)
    prefixes = [_tokens(rng, 64) for _ in range(4)]
    reqs = []
    for i in range(n):
        prompt = np.concatenate([prefixes[i % 4], _tokens(rng, suffix)])
        reqs.append(TraceRequest(i, np.concatenate([prompt, _tokens(rng, output)]), len(prompt)))
    return reqs


def _conversation() -> list[TraceRequest]:
    rng = np.random.default_rng(1)
    first = TraceRequest(0, _tokens(rng, 84 + 20), 84)
    prompt2 = np.concatenate([first.tokens, _tokens(rng, 10)])
    second = TraceRequest(1, np.concatenate([prompt2, _tokens(rng, 8)]), len(prompt2), after=0)
    third = TraceRequest(2, np.concatenate([first.tokens[:96], _tokens(rng, 4)]), 96, after=1)
    return [first, second, third]


def _run_one(adapter: Any, req: TraceRequest, budget: int = 8192) -> tuple[int, int] | None:
    """Admit `req` and run its first chunk through the forward pass, as the driver does."""
    got = adapter.admit(req, budget)
    if got is not None:
        adapter.new_step()
        hit, n = got
        req.num_computed = hit + n
        if req.num_computed == req.num_tokens:
            req.num_output += 1
        adapter.advance([(req, n)])
    return got


def test_unknown_peer_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        load_peer("tensorrt")


@pytest.mark.parametrize("name", PEERS)
def test_ample_pages_hits_and_pinned_pages(name: str) -> None:
    trace = _shared_prefix_trace()
    adapter = _peer(name, num_pages=1000)
    res = simulate(adapter, trace)
    assert res.first_prompt_tokens == 40 * 84
    assert res.first_hit_tokens == (2304 if name == "vllm" else 0)
    assert res.preemptions == 0
    assert (res.steps, res.request_steps) == (8, 320)  # one prefill step, then 7 decode steps
    assert res.peak_used_pages == 96
    assert adapter.used_pages() == 0
    if name == "vllm":  # vLLM's own PrefixCacheStats agree with the driver's count
        assert adapter.prefix_cache_stats() == (3360, 2304, 0, 0)

    one_at_a_time = simulate(_peer(name, num_pages=1000), trace, SimConfig(max_num_seqs=1))
    assert one_at_a_time.first_hit_tokens == 2304  # the ideal, for both
    assert one_at_a_time.hit_rate == pytest.approx(2304 / 3360)
    assert (one_at_a_time.preemptions, one_at_a_time.steps, one_at_a_time.peak_used_pages) == (0, 320, 6)


@pytest.mark.parametrize("name", PEERS)
def test_few_pages_preempt_and_complete(name: str) -> None:
    # 92-token prompts take 6 pages and grow into a 7th while decoding (KV up to 99 tokens).
    trace = _shared_prefix_trace(suffix=28)
    adapter = _peer(name, num_pages=12)
    res = simulate(adapter, trace)
    assert res.preemptions > 0
    assert sorted(res.first_admission_order) == list(range(40))
    assert res.prefill_tokens_computed > res.first_prompt_tokens - res.first_hit_tokens  # recomputed work
    assert res.peak_used_pages <= 12
    assert adapter.used_pages() == 0


@pytest.mark.parametrize("name", PEERS)
def test_refused_admission_changes_nothing(name: str) -> None:
    rng = np.random.default_rng(2)
    adapter = _peer(name, num_pages=4)
    a = TraceRequest(0, _tokens(rng, 41), 40)  # 40-token prompt, 1 generated: 3 pages
    assert _run_one(adapter, a) == (0, 40)
    assert adapter.used_pages() == 3
    adapter.free(a, preempted=False)  # 2 full pages stay cached (evictable), 2 pages free
    assert adapter.used_pages() == 0

    big = TraceRequest(1, np.concatenate([a.tokens[:32], _tokens(rng, 61)]), 92)  # hits 32, needs 4 more pages
    assert adapter.admit(big, 8192) is None
    assert adapter.used_pages() == 0
    if name == "vllm":
        assert adapter.manager.block_pool.get_num_free_blocks() == 4
    else:
        assert (adapter.allocator.available_size(), adapter.tree.evictable_size()) == (2 * PAGE, 2 * PAGE)

    small = TraceRequest(2, np.concatenate([a.tokens[:32], _tokens(rng, 11)]), 42)  # hits 32, needs 1 page
    assert _run_one(adapter, small) == (32, 10)
    assert adapter.used_pages() == 3


@pytest.mark.parametrize("name", PEERS)
def test_multi_turn_hits_prompt_and_output_pages(name: str) -> None:
    adapter = _peer(name, num_pages=100)
    res = simulate(adapter, _conversation())
    assert res.first_admission_order == [0, 1, 2]
    assert res.first_prompt_tokens == 84 + 114 + 96
    assert res.first_hit_tokens == 0 + 96 + 80
    assert res.preemptions == 0
    if name == "vllm":
        assert adapter.prefix_cache_stats() == (84 + 114 + 96, 176, 0, 0)


def test_versions_and_hash_cost() -> None:
    _peer("vllm", num_pages=1)
    _peer("sglang", num_pages=1)
    from benchmarks.compare.peer_sglang import sglang_version
    from benchmarks.compare.peer_vllm import vllm_hash_ns_per_token, vllm_version

    assert (vllm_version(), sglang_version()) == ("0.33.0", "0.5.23")
    prompts = [t.tokens[: t.prompt_len] for t in _shared_prefix_trace(n=8)]
    assert vllm_hash_ns_per_token(prompts, PAGE, "sha256") > 0
    assert vllm_hash_ns_per_token(prompts, PAGE, "xxhash") > 0
    with pytest.raises(ValueError):
        vllm_hash_ns_per_token(prompts, PAGE, "md5")
