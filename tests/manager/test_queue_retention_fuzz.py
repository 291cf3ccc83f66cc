"""Random expect/alloc/step/release/unexpect/reset/version/pin sequences: integrity, wants == expected,
and every evictable page's live heap entry carries its current rank."""

from __future__ import annotations

import collections
import random

import numpy as np
import pytest

from pagedkv.core.block_manager import BlockManager
from pagedkv.core.context import Retention, TextContext
from pagedkv.core.errors import InsufficientBlocksError
from pagedkv.core.pool import EVICTION_POLICIES
from pagedkv.core.pool.eviction import LRU, PROBATION

PS = 4


def order_is_lazy(bm: BlockManager) -> bool:
    return bm.pool._order is None


def check_wants(bm: BlockManager) -> None:
    bm.check_integrity()
    want = collections.Counter()
    for keys, t, _ in bm.wants.entries.values():
        for k in keys:
            want[(k, t)] += 1
    got = collections.Counter()
    for k, ts in bm.pool._wanted.items():
        ts = list(ts) if isinstance(ts, collections.deque) else [ts]  # (a key wanted once holds its ticket)
        assert list(ts) == sorted(ts), "tickets not sorted"
        for t in ts:
            got[(k, t)] += 1
    for t, keys in bm.pool._wants.pending.items():  # (deferred until the next eviction reads them)
        assert order_is_lazy(bm), "a keyed order defers nothing"
        for k in keys:
            got[(k, t)] += 1
    assert want == got
    order = bm.pool._order
    if order is not None and order.rank is not None:
        live = {}
        for e in order.heap:
            if e[-2] == order.version[e[-1]]:
                live[e[-1]] = e
        for which in (LRU, PROBATION):
            for p in bm.pool.list_pages(which):
                e = live.get(p) or order.deferred.get(p)
                assert e is not None and e[1] == bm.pool._rank(p), f"stale rank for page {p}: {e} vs {bm.pool._rank(p)}"


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("policy,lf", [*((p, False) for p in EVICTION_POLICIES), ("lru", True)])
@pytest.mark.parametrize("coa", [False, True])
def test_fuzz(seed, policy, lf, coa):
    rng = random.Random(seed)
    bm = BlockManager(
        24, PS, enable_prefix_caching=True, eviction_policy=policy, evict_leaves_first=lf, commit_on_alloc=coa
    )
    bases = [np.arange(b, b + 40) for b in (100, 200, 300)]
    waiting: list[TextContext] = []
    running: dict[str, TextContext] = {}
    nid = 0
    for _ in range(400):
        op = rng.random()
        if op < 0.2:
            base = rng.choice(bases)
            toks = np.concatenate([base[: rng.randint(2, 30)], rng.sample(range(1000, 2000), rng.randint(1, 10))])
            c = TextContext(f"r{nid}", toks)
            nid += 1
            if rng.random() < 0.2:
                waiting.insert(0, c)
            else:
                waiting.append(c)
        elif op < 0.35 and waiting:
            k = rng.randint(1, len(waiting))
            bm.expect(waiting[:k])
        elif op < 0.5 and waiting:
            c = waiting[0]
            bm.claim(c.request_id)
            try:
                bm.alloc(c, num_scheduled_tokens=rng.choice([None, 4, 9]))
            except InsufficientBlocksError:
                bm.release(c.request_id)
                continue
            waiting.pop(0)
            running[c.request_id] = c
        elif op < 0.65 and running:
            rid = rng.choice(sorted(running))
            c = running[rid]
            if c.tokens.active_length > 9:
                pass
            c.update(7)
            bm.step(c)
            if rng.random() < 0.5:
                bm.release(rid)
                running.pop(rid)
        elif op < 0.72 and running:
            rid = rng.choice(sorted(running))
            c = running.pop(rid)
            bm.release(rid)
            c.reset()
            waiting.insert(0, c)
        elif op < 0.76 and waiting:
            c = waiting.pop(rng.randrange(len(waiting)))
            bm.unexpect(c.request_id)
        elif op < 0.8:
            bm.reset_prefix_cache()
        elif op < 0.83:
            bm.hasher.set_version(rng.choice([None, "v2"]))
        elif op < 0.9:
            base = rng.choice(bases)
            bm.pin_prefix(base[:16], Retention(priority=rng.choice([10, 35, 80])))
        check_wants(bm)
    for rid in list(running):
        bm.release(rid)
    for c in waiting:
        bm.unexpect(c.request_id)
    check_wants(bm)
    assert bm.pool.num_wanted == 0 and not bm.wants.entries


@pytest.mark.parametrize("seed", range(8))
def test_expect_of_a_moved_on_queue_wants_what_a_full_pass_wants(seed):
    """`expect` told the last queue less its admitted heads, plus newcomers, looks only at the newcomers; twin
    managers, one made to look at every context each call, end every step with the same tickets, the same wants
    and the same evictions, through admissions, a window that grows and shrinks, preemptions put back at the
    front, swapped-out requests queued at the back (started: no want) and recomputed where they stand (a want
    from then on), requests leaving from the middle and weights version changes."""
    rng = random.Random(seed)
    twins = [BlockManager(20, PS, enable_prefix_caching=True) for _ in range(2)]
    bases = [np.arange(b, b + 40) for b in (100, 200, 300)]
    waiting: list[list[TextContext]] = [[], []]  # the same requests, one context object per twin
    running: list[dict[str, TextContext]] = [{}, {}]
    nid = 0
    for _ in range(300):
        op = rng.random()
        if op < 0.3:
            toks = np.concatenate([rng.choice(bases)[: rng.randint(2, 30)], rng.sample(range(1000, 2000), 3)])
            for w in waiting:
                w.append(TextContext(f"r{nid}", toks))
            nid += 1
        elif op < 0.55 and waiting[0]:  # admit the head (recomputed first if it was swapped out)
            outcomes = []
            for bm, w, r in zip(twins, waiting, running, strict=True):
                c = w[0]
                if c.tokens.processed_length:
                    c.reset()
                bm.claim(c.request_id)
                try:
                    bm.alloc(c)
                except InsufficientBlocksError:
                    bm.release(c.request_id)
                    outcomes.append(None)
                    continue
                outcomes.append(bm.get_req_blocks(c.request_id))
                r[w.pop(0).request_id] = c
            assert outcomes[0] == outcomes[1]
        elif op < 0.7 and running[0]:  # finish one, preempt it back to the queue's front, or swap it out to the back
            rid = rng.choice(sorted(running[0]))
            back, swapped = rng.random() < 0.3, rng.random() < 0.3
            for bm, w, r in zip(twins, waiting, running, strict=True):
                c = r.pop(rid)
                c.update(7)
                bm.step(c)
                bm.release(rid)
                if swapped and not back:
                    w.append(c)  # (its processed tokens kept: started, so no want while it waits)
                if back:
                    c.reset()
                    w.insert(0, c)
        elif op < 0.75 and len(waiting[0]) > 1:  # one leaves from the middle
            i = rng.randrange(1, len(waiting[0]))
            for bm, w in zip(twins, waiting, strict=True):
                bm.unexpect(w.pop(i).request_id)
        elif op < 0.78 and any(c.tokens.processed_length for c in waiting[0]):  # recomputed where it stands
            i = next(i for i, c in enumerate(waiting[0]) if c.tokens.processed_length)
            for w in waiting:
                w[i].reset()
        elif op < 0.81:
            version = rng.choice([None, "v2"])
            for bm in twins:
                bm.hasher.set_version(version)
        window = rng.randint(0, 6)
        twins[1].wants._last = None  # (the full pass)
        added = [bm.expect(w[:window]) for bm, w in zip(twins, waiting, strict=True)]
        assert added[0] == added[1]
        entries = [{rid: (keys, t) for rid, (keys, t, _) in bm.wants.entries.items()} for bm in twins]
        assert entries[0] == entries[1]
        assert dict(twins[0].pool._wanted) == dict(twins[1].pool._wanted)
        assert twins[0].pool._wants.pending == twins[1].pool._wants.pending
        for bm in twins:
            check_wants(bm)
