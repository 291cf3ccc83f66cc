"""Test helpers shared by the suites (no torch import here)."""

from __future__ import annotations

from typing import Any

import numpy as np

from pagedkv.core.block_manager import BlockManager
from pagedkv.core.context import TextContext
from pagedkv.dtype import DeviceRef, DType
from pagedkv.params import KVCacheParams


def make_params(**overrides: Any) -> KVCacheParams:
    """Tiny fp32 MHA params on one CPU device; override any field."""
    base: dict[str, Any] = dict(
        dtype=DType.float32, n_kv_heads=1, head_dim=1, num_layers=1, devices=[DeviceRef.CPU()], page_size=4
    )
    base.update(overrides)
    return KVCacheParams(**base)


def ctx(request_id: Any, tokens: Any, **kwargs: Any) -> TextContext:
    """A TextContext from a list/range/array of tokens."""
    return TextContext(request_id, np.asarray(list(tokens), dtype=np.int64), **kwargs)


def snapshot(bm: BlockManager, *contexts: TextContext) -> dict[str, Any]:
    """Everything observable about a BlockManager (and contexts), for no-trace assertions."""
    pool = bm.pool
    reqs = {rid: _request_state(st) for rid, st in bm._reqs.items()}
    ctx_state = [
        (c.tokens.processed_length, c.tokens.current_position, len(c.tokens), c.cached_prefix_length) for c in contexts
    ]
    return {
        "free_order": pool.free_order(),
        "refs": list(pool._ref),
        "hashes": list(pool._hash),
        "caches": [dict(c) for c in pool._caches],
        "groups": bytes(pool._group),
        "pins": list(pool._pins),
        "stamps": list(pool._stamp),
        "reused": bytes(pool._reused),
        "reqs": reqs,
        "metrics": bm.metrics,
        "contexts": ctx_state,
        "partial": bm._partial.state() if getattr(bm, "_partial", None) is not None else None,
        "states": _states(getattr(bm, "states", None)),
    }


def _states(states: Any) -> Any:
    """The state rows pool, checkpoints and pending copies of a coordinator (None without state groups)."""
    if states is None:
        return None
    rows = states.rows
    return (
        rows.free_order(), list(rows._ref), list(rows._hash), sorted(states._entries), list(states._copies),
        list(states._page_copies), dict(states._restoring).keys(), states.num_saved, states.num_hits,
    )  # fmt: skip


def _request_state(st: Any) -> tuple[Any, ...]:
    """Every field of a BlockManager / KVCacheCoordinator request state, arrays as lists."""
    if hasattr(st, "tables"):  # a hybrid request: one table per group
        tables = [t.pages[: t.num_pages].tolist() for t in st.tables]
        return (
            tables, list(st.dropped), st.committed, list(st.hashes), st.digest, st.dummy, st.ready, st.next_drop,
            st.shared, list(st.pinned), st.state_at, st.cut,
        )  # fmt: skip
    return (st.pages[: st.num_pages].tolist(), st.committed, list(st.hashes), st.digest, st.dummy)


def drive(bm: BlockManager, c: TextContext, tokens: list[int]) -> None:
    """Run `c` through one forward per token of `tokens`: alloc, update(token), step."""
    for token in tokens:
        bm.alloc(c)
        c.update(token)
        bm.step(c)
        bm.check_integrity()


def decode(mgr: Any, model: Any, c: TextContext, steps: int, first: int = 100) -> None:
    """`steps` forwards of claimed `c` through a manager and a `PrefixStampModel` (which checks every
    cached position it reads): alloc, model.forward, update(first + t), step."""
    for t in range(steps):
        mgr.alloc(c)
        model.forward([[c]])
        c.update(first + t)
        mgr.step([[c]])


def serve(mgr: Any, model: Any, c: TextContext, new_tokens: int) -> None:
    """claim `c`, `decode` `new_tokens` tokens (100, 101, ...), release it."""
    mgr.claim(c.request_id)
    decode(mgr, model, c, new_tokens)
    mgr.release(c.request_id)
