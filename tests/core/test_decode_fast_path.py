"""The coordinator's decode fast path (`_decode_step`) against its general path, op by op.

Two coordinators receive the same random lifecycle (shared prefixes, decode
runs past windows, chunks, draft slots, tight pools, releases); in one the
fast path is switched off. After every call both must be in the same state
(same page ids, pins, lists, metrics), or fail with the same error.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from helpers import ctx, snapshot
from pagedkv.core.coordinator import KVCacheCoordinator
from pagedkv.core.errors import InsufficientBlocksError
from pagedkv.core.groups import (
    ChunkedLocalAttentionManager,
    FullAttentionManager,
    SinkAttentionManager,
    SlidingWindowManager,
)

LAYOUTS = {
    "full+window": lambda: [FullAttentionManager(0, 4), SlidingWindowManager(1, 4, 6)],
    "windows": lambda: [SlidingWindowManager(0, 4, 5), SlidingWindowManager(1, 4, 9)],
    "full+chunk+sink": lambda: [
        FullAttentionManager(0, 4), ChunkedLocalAttentionManager(1, 4, 8), SinkAttentionManager(2, 4, 4, 3)
    ],
}  # fmt: skip


def pair(layout: str, blocks: int, spec: int, fraction: float) -> tuple[KVCacheCoordinator, KVCacheCoordinator]:
    def make() -> KVCacheCoordinator:
        return KVCacheCoordinator(blocks, 4, LAYOUTS[layout](), enable_prefix_caching=True,
                                  num_speculative_tokens=spec, protected_fraction=fraction)  # fmt: skip

    fast, slow = make(), make()
    slow._decode_step = lambda *args: False  # type: ignore[method-assign]
    real = fast._decode_step
    fast.fast_steps = 0  # type: ignore[attr-defined]

    def counted(*args: object) -> bool:
        done = real(*args)  # type: ignore[arg-type]
        fast.fast_steps += done  # type: ignore[attr-defined]
        return done

    fast._decode_step = counted  # type: ignore[method-assign]
    return fast, slow


def call(c: Any, op: str, arg: object) -> str | None:
    try:
        getattr(c, op)(arg)
    except InsufficientBlocksError as exc:
        return str(exc)
    return None


def lifecycle(fast: Any, slow: Any, rng: random.Random, steps: int, release: float, longest: int) -> None:
    """The same random lifecycle on two managers (up to 3 requests over 2 shared prefixes, each released with
    probability `release` a step or once longer than `longest`; alloc, update, step): after every call both are
    in the same state or failed with the same error, and `fast` passes `check_integrity()`."""
    prefixes = [list(range(100, 113)), list(range(200, 209))]
    live: dict[int, tuple] = {}
    for step in range(steps):
        if len(live) < 3 and rng.random() < 0.3:
            tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 6))]
            live[step] = (ctx(step, tokens), ctx(step, tokens))
            fast.claim(step)
            slow.claim(step)
        if not live:
            continue
        rid = rng.choice(sorted(live))
        a, b = live[rid]
        if rng.random() < release or len(a.tokens) > longest:
            fast.release(rid)
            slow.release(rid)
            del live[rid]
        else:
            err = call(fast, "alloc", a)
            assert err == call(slow, "alloc", b)
            if err is None:
                token = rng.randrange(50)
                a.update(token)
                b.update(token)
                fast.step(a)
                slow.step(b)
        assert snapshot(fast, *(x for x, _ in live.values())) == snapshot(slow, *(y for _, y in live.values()))
        fast.check_integrity()


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("seed", range(6))
def test_fast_path_matches_general_path(layout: str, seed: int) -> None:
    rng = random.Random(seed)
    blocks, spec = rng.choice([14, 20, 40]), rng.choice([0, 0, 2])
    fast, slow = pair(layout, blocks, spec, rng.choice([0.0, 0.25, 1.0]))
    lifecycle(fast, slow, rng, steps=160, release=0.08, longest=40)
    assert fast.fast_steps > 10  # type: ignore[attr-defined]  # the fast path really ran (not just the hot one)


@pytest.mark.parametrize("seed", range(6))
def test_block_manager_decode_page_path_matches_general_path(seed: int) -> None:
    """`BlockManager._alloc_decode` (a decode token that needs a new page) against the general `alloc` path:
    the same random lifecycle (shared prefixes, draft slots, a tight pool with protected pins off or on,
    schedule-time commits) leaves both managers in the same state after every call, or fails both with the
    same error (the fast path hands every refusal to the general path)."""
    from pagedkv.core.block_manager import BlockManager

    rng = random.Random(seed)
    spec = rng.choice([0, 0, 2])

    def make() -> BlockManager:
        return BlockManager(rng_blocks, 4, enable_prefix_caching=True, num_speculative_tokens=spec,
                            commit_on_alloc=commit)  # fmt: skip

    rng_blocks, commit = rng.choice([10, 16, 30]), rng.choice([False, True])
    fast, slow = make(), make()
    slow._alloc_decode = lambda *args: False  # type: ignore[method-assign]
    real, taken = fast._alloc_decode, []

    def counted(*args: object) -> bool:
        done = real(*args)  # type: ignore[arg-type]
        taken.append(done)
        return done

    fast._alloc_decode = counted  # type: ignore[method-assign]
    lifecycle(fast, slow, rng, steps=300, release=0.06, longest=48)
    assert sum(taken) > 5  # the decode page path really ran (and in tight pools declined: seed 2)
