"""PrefixIndex against pagedkv engines in child processes (real ZMQ sockets on loopback): for a scripted
run of stores, evictions, tier copies and clears, `score` equals the cached prefix each engine's manager
reports when the request arrives."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("zmq")
pytest.importorskip("msgspec")
pytest.importorskip("aiohttp")

from engines import engines, synced  # noqa: E402

from pagedkv.router import EngineSpec, PagedKVHasher, PrefixIndex  # noqa: E402

PAGE = 4


def test_scores_equal_the_cached_prefix_each_engine_reports() -> None:
    # a: 24 device pages (evicts); b: 16 device pages over a 64-page host tier (CPU events, tier hits)
    specs = {"a": ["--page-size", str(PAGE), "--num-pages", "24"],
             "b": ["--page-size", str(PAGE), "--num-pages", "16", "--host-pages", "64"]}  # fmt: skip
    rng = np.random.default_rng(0)
    prefixes = [rng.integers(1, 256, size=int(n)).tolist() for n in (9, 17, 30, 41)]
    with engines(specs) as procs:
        hasher = PagedKVHasher(PAGE)  # the engines' seed: the suite's seed file, inherited
        index = PrefixIndex([EngineSpec(p.name, p.events, hasher, p.replay, p.topic) for p in procs.values()])
        try:
            hits = {"a": 0, "b": 0}
            for step in range(36):
                name = "ab"[int(rng.integers(2))]
                engine = procs[name]
                if step in (20, 29):
                    engine.post("/reset", {})  # AllBlocksCleared
                prefix = prefixes[int(rng.integers(len(prefixes)))]
                prompt = prefix + rng.integers(1, 256, size=int(rng.integers(0, 9))).tolist()
                salt = "tenant" if step % 7 == 6 else None
                for p in procs.values():
                    synced(index, p)
                predicted = index.score(prompt, salt)
                answer = engine.complete(prompt, max_tokens=int(rng.integers(1, 6)), salt=salt)
                reported = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
                assert predicted[name] == reported, (step, name, predicted, reported)
                hits[name] += reported > 0
            assert hits["a"] > 3 and hits["b"] > 3  # the script did hit
            a, b = index.stats("a"), index.stats("b")
            assert a.clears + b.clears == 2 and a.malformed == b.malformed == 0
            assert index.num_blocks("b").get("CPU", 0) > 0  # the host tier announced its copies
            assert a.removals > 0 and b.removals > 0  # evictions were announced and applied
        finally:
            index.close()
