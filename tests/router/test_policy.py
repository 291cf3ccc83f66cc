"""Router policy over a real index fed by two scripted publishers on loopback: longest prefix unless
overloaded, least loaded otherwise, stale and failed engines skipped and taken back, baselines."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

pytest.importorskip("zmq")
msgspec = pytest.importorskip("msgspec")

from engines import wait_for  # noqa: E402
from publisher import ScriptedPublisher, stored  # noqa: E402

from pagedkv.router import EngineSpec, PagedKVHasher, PrefixIndex, Router, RouterPolicy  # noqa: E402

HASHER = PagedKVHasher(4, seed=bytes(32))
PROMPT = list(range(1, 42))
KEYS = HASHER.hashes(PROMPT)


class Fleet:
    def __init__(self) -> None:
        self.pubs = {n: ScriptedPublisher() for n in "ab"}
        self.seq = dict.fromkeys("ab", 0)
        self.index = PrefixIndex(
            [EngineSpec(n, p.endpoint, HASHER, p.replay_endpoint, "kv") for n, p in self.pubs.items()]
        )
        for p in self.pubs.values():
            p.wait_for_subscriber()
        assert self.index.wait_ready()

    def store(self, name: str, keys: list[object]) -> None:
        self.pubs[name].send(self.seq[name], msgspec.msgpack.encode([time.time(), [stored(keys)], 0]))
        self.seq[name] += 1
        wait_for(lambda: self.index.next_seq(name) == self.seq[name])

    def close(self) -> None:
        self.index.close()
        for p in self.pubs.values():
            p.close()


@pytest.fixture
def fleet() -> Iterator[Fleet]:
    f = Fleet()
    yield f
    f.close()


def test_longest_prefix_wins_unless_overloaded(fleet: Fleet) -> None:
    router = Router(fleet.index, RouterPolicy(load_margin=2))
    fleet.store("a", KEYS[:2])
    fleet.store("b", KEYS[:5])
    for name in "ab":
        router.report_load(name, running=0, free_pages=100)
    d = router.route(PROMPT)
    assert (d.engine, d.reason, d.predicted_tokens, d.scores) == ("b", "prefix", 20, {"a": 8, "b": 20})
    router.report_load("b", running=1)  # + 1 in flight from d: still within the margin
    assert router.route(PROMPT).engine == "b"  # load 2 (in flight) vs 0
    d = router.route(PROMPT)  # b: 2 in flight + ... = 2 >= 0 + 2
    assert (d.engine, d.reason) == ("a", "overloaded")
    router.report_load("b", running=0, free_pages=1)  # too few pages for the 21 uncached tokens
    router.finished(d)
    assert router.loads()["b"].in_flight == 2
    d2 = router.route(PROMPT)
    assert d2.reason == "overloaded"


def test_no_prefix_goes_to_the_least_loaded_and_ties_rotate(fleet: Fleet) -> None:
    router = Router(fleet.index)
    router.report_load("a", running=3)
    router.report_load("b", running=1)
    d = router.route([9] * 30)
    assert (d.engine, d.reason, d.predicted_tokens) == ("b", "least-loaded", 0)
    router.finished(d, cached_tokens=0)
    router.report_load("a", running=0)
    router.report_load("b", running=0)
    chosen = []
    for _ in range(4):
        d = router.route([9] * 30)
        router.finished(d, cached_tokens=0)
        chosen.append(d.engine)
    assert sorted(chosen) == ["a", "a", "b", "b"]
    assert router.stats.outcomes == 5 and router.stats.exact == 5


def test_a_silent_engine_goes_stale_and_comes_back(fleet: Fleet) -> None:
    router = Router(fleet.index, RouterPolicy(stale_after_s=0.3))
    fleet.store("a", KEYS[:1])
    fleet.store("b", KEYS[:6])
    assert router.route(PROMPT).engine == "b"
    time.sleep(0.35)  # both silent
    d = router.route(PROMPT)
    assert d.reason == "all-stale"
    fleet.store("a", KEYS[1:2])  # a speaks again, b stays silent: b is not routed to despite its prefix
    d = router.route(PROMPT)
    assert (d.engine, d.reason, set(d.scores)) == ("a", "prefix", {"a"})
    router.report_load("b", running=0)  # b answers a load scrape: it is back
    assert router.route(PROMPT).engine == "b"


def test_a_failed_engine_is_skipped_then_retried(fleet: Fleet) -> None:
    router = Router(fleet.index, RouterPolicy(retry_after_s=0.3))
    fleet.store("b", KEYS[:6])
    router.report_load("a", running=0)
    router.mark_failed("b")
    assert router.route(PROMPT).engine == "a"
    router.mark_failed("a")
    d = router.route(PROMPT)  # both failed: the one that failed longest ago gets a retry
    assert d.engine == "b"
    time.sleep(0.35)
    router.report_load("b", running=0)
    assert router.route(PROMPT).engine == "b"
    assert router.stats.failures == {"a": 1, "b": 1}


@pytest.mark.parametrize("mode", ["round-robin", "random"])
def test_baselines_ignore_scores(fleet: Fleet, mode: str) -> None:
    router = Router(fleet.index, RouterPolicy(mode=mode, seed=1))
    fleet.store("b", KEYS[:6])
    for n in "ab":
        router.report_load(n, running=0)
    picks = [router.route(PROMPT) for _ in range(20)]
    assert {d.engine for d in picks} == {"a", "b"} and {d.reason for d in picks} == {mode}
    if mode == "round-robin":
        assert [d.engine for d in picks[:4]] in (["a", "b", "a", "b"], ["b", "a", "b", "a"])


def test_policy_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="mode='best'"):
        RouterPolicy(mode="best")
    with pytest.raises(ValueError, match="load_margin=0"):
        RouterPolicy(load_margin=0)
    with pytest.raises(ValueError, match="stale_after_s=-1"):
        RouterPolicy(stale_after_s=-1)


def test_bench_decision_latency_runs_small() -> None:
    from benchmarks.router import decision_latency

    result = decision_latency(blocks=300, decisions=20, engines=2)
    assert result["pagedkv sha256 blocks per engine"] == 300 and result["vLLM sha256"] > 0


def test_hashers_check_tokens_and_salts_as_every_entry_does() -> None:
    """One token validator and one salt rule: a bool is not token 1, "" is not "no salt" (vLLM's own hash
    reads "" as no salt, so the router refuses it rather than predict a chain the engine would not use)."""
    from pagedkv.router import VLLMHasher

    for hasher in (HASHER, VLLMHasher(4)):
        with pytest.raises(TypeError, match=r"tokens\[1\]=True is not a token id"):
            hasher.hashes([5, True, 7, 8, 9, 10])
        with pytest.raises(ValueError, match="cache_salt='' is empty"):
            hasher.hashes(list(range(9)), "")
        assert hasher.hashes([]) == [] and hasher.hashes(list(range(9)), "t") != hasher.hashes(list(range(9)))
