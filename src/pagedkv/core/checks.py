"""Argument checks and invariants of the bookkeeping (each takes what it checks as arguments).

The invariants are O(pages): `check_integrity()` runs them in every core test
and, behind ``enable_runtime_checks``, after every mutating call.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

from pagedkv.core.errors import InsufficientBlocksError
from pagedkv.core.errors import require as _require
from pagedkv.core.groups import GroupManager
from pagedkv.core.hashing import check_seed
from pagedkv.core.hybrid_state import HybridRequest
from pagedkv.core.pool import BlockPool
from pagedkv.core.tables import RequestPages
from pagedkv.params.validation import INT32_MAX, check_int

__all__ = ["check_hybrid_tables", "check_manager_args", "check_swap_restore", "check_tables"]


def check_manager_args(page_size: object, caching: object, speculative: object, seed: object, *flags: object) -> None:
    """TypeError / ValueError unless a `BlockManager`'s arguments are valid (before anything is built)."""
    check_int("page_size", page_size, 1, INT32_MAX)
    check_int("num_speculative_tokens", speculative, 0, INT32_MAX)
    for name, flag in zip(("enable_prefix_caching", "evict_leaves_first", "partial_page_reuse", "commit_on_alloc"),
                          (caching, *flags), strict=False):  # fmt: skip
        if not isinstance(flag, bool):
            raise TypeError(f"{name}={flag!r} must be a bool")
    check_seed("hash_seed", seed)


def check_tables(pool: BlockPool, reqs: Mapping[Hashable, RequestPages], partial: Any = None) -> None:
    """Raise `IntegrityError` unless every request's committed pages hold its hashes, its other pages
    are private and unhashed, and the pool's states and reference counts match the tables.
    `partial`: the `PartialPages` index with its pending copies (None without partial reuse)."""
    null = pool.null_block
    holders: Counter[int] = Counter()
    for rid, st in reqs.items():
        pages = st.pages[: st.num_pages].tolist()
        holders.update(pages)
        _require(null not in pages, f"request {rid!r} holds the null page")
        _require(not (st.dummy and pages), f"dummy request {rid!r} holds pages")
        _require(
            st.committed <= min(st.num_pages, len(st.hashes)),
            f"request {rid!r}: committed={st.committed} exceeds its pages or hashes",
        )
        _require(-1 <= st.unwritten <= st.committed, f"request {rid!r}: unwritten={st.unwritten} out of range")
        for i, page in enumerate(pages):
            if i < st.committed:
                _require(pool.block_hash(page) == st.hashes[i], f"request {rid!r} page {i} ({page}) hash mismatch")
            else:
                _require(pool.block_hash(page) is None, f"request {rid!r} uncommitted page {page} has a hash")
                _require(pool.ref_count(page) == 1, f"request {rid!r} private page {page} is shared")
    if partial is not None:
        partial.check(reqs, holders)  # + the pending copies' source references
    pool.check_integrity(holders)


def check_hybrid_tables(
    pool: BlockPool,
    groups: Sequence[GroupManager],
    reqs: Mapping[Hashable, HybridRequest],
    caching: bool,
    extra: Counter[int] | None = None,
) -> None:
    """Raise `IntegrityError` unless every request's table in every group agrees with the pool: a null
    entry only where a window group dropped a page, committed entries cached under the request's hash in
    that group, the others private and unhashed, and the pool's references and live pins match the tables.
    `extra`: references held outside the tables (state checkpoints' tail pages). State groups' entries are
    rows of another pool (`StateCheckpoints.check`): only their count is checked here."""
    null, stamp = pool.null_block, pool.stamp
    extra = extra or Counter()
    holders: Counter[int] = Counter(extra)
    pins: Counter[int] = Counter()
    for rid, st in reqs.items():
        pins.update(p for p, s in st.pinned if stamp(p) == s)
        holds_tokens = any(t.num_pages for gm, t in zip(groups, st.tables, strict=True) if not gm.state_slots)
        for gm, table in zip(groups, st.tables, strict=True):  # allocated together: no pages without slots
            _require(not (gm.state_slots and holds_tokens and table.num_pages != gm.state_slots),
                     f"{rid!r} holds pages but {table.num_pages} of its {gm.state_slots} state slots in group {gm.group}")  # fmt: skip
        _require(st.committed <= len(st.hashes) or not caching,
                 f"request {rid!r}: committed={st.committed} exceeds its hashes")  # fmt: skip
        for g, (gm, table) in enumerate(zip(groups, st.tables, strict=True)):
            pages = table.pages[: table.num_pages].tolist()
            _require(not (st.dummy and pages), f"dummy request {rid!r} holds pages")
            if gm.state_slots:
                _require(len(pages) in (0, gm.state_slots),
                         f"{rid!r} state group {g} holds {len(pages)} slots, not {gm.state_slots}")  # fmt: skip
                continue
            holders.update(p for p in pages if p != null)
            for i, page in enumerate(pages):
                if page == null:
                    _require(gm.lazy and gm.kept_pages() <= i < st.dropped[g], f"{rid!r} group {g} entry {i} is null")
                    continue
                _require(
                    not (gm.lazy and max(gm.kept_pages(), st.shared) <= i < st.dropped[g]),
                    f"{rid!r} group {g} kept dropped entry {i}",
                )
                if i < st.committed and gm.cacheable:
                    _require(pool.block_hash(page) == st.hashes[i] and pool.group_of(page) == g,
                             f"{rid!r} group {g} page {i} ({page}) is not cached under its hash")  # fmt: skip
                else:
                    _require(pool.block_hash(page) is None and pool.ref_count(page) == 1 + extra[page],
                             f"{rid!r} group {g} private page {page} is shared or hashed")  # fmt: skip
    pool.check_integrity(holders, pins)


def check_swap_restore(
    request_id: Hashable, claimed: bool, groups: int, record_groups: int, stateful: bool, pool: BlockPool, need: int,
    hits: Sequence[int] = (),
) -> None:  # fmt: skip
    """Why a swapped-out request cannot be restored (`swap_restore` of `BlockManager` and `KVCacheCoordinator`):
    claimed, a record of another group count, a model with recurrent state, or `need` fresh pages more than the
    pool has once the cached pages `hits` it reuses are taken out of the free count."""
    if claimed:
        raise ValueError(f"request {request_id!r} is claimed; only a released (swapped-out) request is restored")
    if record_groups != groups:
        raise ValueError(f"record has {record_groups} groups but this bookkeeping has {groups}")
    if stateful:
        raise ValueError("a model with recurrent state is not swapped (see swap_snapshot)")
    lost = sum(1 for p in hits if pool.ref_count(p) == 0 and not pool.is_protected(p))  # (touched: no longer free)
    available = pool.num_free - pool.num_protected - lost
    if need > available:
        raise InsufficientBlocksError(
            f"Cannot get {need} free blocks to swap request {request_id!r} back in (only {available} "
            f"available; {pool.num_used}/{pool.num_blocks} blocks currently in use)",
            needed=need,
            available=available,
        )


def check_state_args(
    groups: Sequence[GroupManager], num_state_rows: object, checkpoint_pages: object, max_checkpoints: object
) -> set[int]:
    """The state slots per request of `groups` (empty: no recurrent state), after checking them and the state
    arguments: `num_state_rows` holds one request's slots, `checkpoint_pages` (pages of a checkpoint's run; 0
    keeps checkpoints in state rows) needs recurrent state and attention pages, `max_checkpoints` is None or a
    count. ValueError/TypeError naming the argument otherwise (a run longer than the pool is never saved)."""
    slots = {g.state_slots for g in groups if g.state_slots}
    if len(slots) > 1:
        raise ValueError(f"every state group must have the same slots per request, got {sorted(slots)}")
    if slots and (type(num_state_rows) is not int or num_state_rows < max(slots)):
        raise ValueError(f"num_state_rows={num_state_rows!r} must be an int >= {max(slots)} (one request's "
                         "live and draft state slots) for a model with recurrent state")  # fmt: skip
    check_int("checkpoint_pages", checkpoint_pages, 0)
    if max_checkpoints is not None:
        check_int("max_state_checkpoints", max_checkpoints, 0)
    token_pages = any(not g.state_slots and not g.reads_encoder for g in groups)
    if checkpoint_pages and not (slots and token_pages):
        raise ValueError(f"checkpoint_pages={checkpoint_pages} needs a model with recurrent state and attention "
                         "pages (a model of state layers only keeps checkpoints in state rows)")  # fmt: skip
    return slots
