"""State checkpoints: prefix-cache hits on models with recurrent state (pure Python + numpy).

A recurrent layer (Mamba, gated delta net, short convolution) keeps one
state per request and updates it in place, so a cached attention prefix is a
hit only where a copy of the state *at its end* was kept. `StateCheckpoints`
keeps those copies.

Rows. State lives in its own pool of rows (a `BlockPool`; one row holds one
request's state for every state layer, whatever the attention page size). A
running request holds `slots` rows (its live state and its draft slots); the
other rows hold checkpoints: free, cached rows that the pool's eviction policy
(LRU, SLRU, ARC, LFU) takes back when a request needs a row or a newer
checkpoint is saved. The pool's size is the cap on checkpoints the user sets
(`KVCacheParams.max_state_checkpoints`, plus the live rows).

Keys. A checkpoint at token position ``P = k * page_size + m`` (``0 <= m <
page_size``) is indexed under the prefix-cache key of page ``k - 1`` (the
chain's root for ``k = 0``, so salts and weights versions carry over) and its
``m`` tail tokens; its pool key is SHA-256 of both. `find` takes the
longest tail that equals the request's next tokens.

Tails. When ``m > 0`` the checkpoint holds a reference on the page ``k`` of
each attention group that wrote it: its first ``m`` slots are written and
never rewritten (tables are append-only), so a hit copies them into the new
request's own page ``k`` (`PageCopy`, copy-on-write) while the state row is
copied into its live row (`StateCopy`). Evicting a checkpoint drops those
references.

Value. A checkpoint saved where a cached prefix diverged from a request (a "shared" one: two requests
proved the prefix) gets a higher retention priority than the rest, and a request's own prompt-end
checkpoint, and the one it resumed from, drop to the lowest when its release saves a deeper one on the
same chain (`demote`): the next turn of a conversation resumes from that one. The pool's policy orders
checkpoints within a priority.

Data moves on the tensor side: the owner of the buffers takes the pending
copies (`take`) and runs them in order, saves before the forward pass that
overwrites their source, restores before the one that reads their target.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Hashable, Iterable, Sequence
from collections.abc import Set as AbstractSet
from typing import NamedTuple

import numpy as np

from pagedkv.core.block_pool import BlockPool
from pagedkv.core.errors import InsufficientBlocksError
from pagedkv.core.errors import require as _require
from pagedkv.core.events import BlockRemoved, BlockStored, EventSink
from pagedkv.core.hashing import BlockHash
from pagedkv.core.partial_pages import PageCopy

__all__ = ["SHARED_PRIORITY", "Checkpoint", "StateCheckpoints", "StateCopy", "checkpoint_key"]

SHARED_PRIORITY = 60  # retention priority of a checkpoint at a divergence point (the pool's default: 35)

ParentKey = Hashable
"""The prefix-cache key of the page before a checkpoint's tail, or ``(root digest,)``."""


class StateCopy(NamedTuple):
    """Copy state row `src` into state row `dst` (every state layer, every shard)."""

    src: int
    dst: int


class _Pending(NamedTuple):
    """A restore not taken yet: the checkpoint row it holds (-1: adopted), its copies, the tail pages it holds."""

    row: int
    copy: StateCopy | None
    pages: list[PageCopy]
    tails: Sequence[int]


class Checkpoint(NamedTuple):
    """A kept state: its row, where it sits in the prefix chain, and its tail (see the module docstring)."""

    row: int
    parent: ParentKey
    tail: np.ndarray  # int32 [m]: the tokens after the parent page, m < page_size
    pages: tuple[int, ...]  # per attention group: the page holding the tail (empty when m == 0)
    key: BlockHash
    shared: bool = False  # saved where a cached prefix diverged from a request (kept longer)


def checkpoint_key(parent: ParentKey, tail: np.ndarray) -> bytes:
    """SHA-256 of the parent key and the tail tokens (int32 little-endian)."""
    head = parent[0] if isinstance(parent, tuple) else parent
    raw = head if isinstance(head, bytes) else int(head).to_bytes(8, "big", signed=True)  # type: ignore[arg-type]
    return hashlib.sha256(b"pagedkv-state\x00" + raw + np.ascontiguousarray(tail, dtype="<i4").tobytes()).digest()


class StateCheckpoints:
    """The state rows of one replica: live slots, checkpoints, their index and pending copies.

    `token_pool` is the attention pages' pool (tails hold references on its pages);
    `enabled` False keeps rows for live slots only (nothing is saved or found).
    """

    def __init__(
        self, num_rows: int, slots: int, token_pool: BlockPool, page_size: int, *, enabled: bool,
        eviction_policy: str = "lru",
    ) -> None:  # fmt: skip
        self.rows = BlockPool(num_rows, enabled, 1, eviction_policy, 0.0)
        self.rows.on_uncached.append(self._forget)
        self.slots = slots
        self.enabled = enabled
        self.token_pool = token_pool
        self.page_size = page_size
        self._entries: dict[int, Checkpoint] = {}  # row -> checkpoint
        self._by_parent: dict[ParentKey, dict[int, None]] = {}  # parent -> rows (insertion-ordered set)
        self._copies: list[StateCopy] = []
        self._page_copies: list[PageCopy] = []
        self._restoring: dict[Hashable, _Pending] = {}  # request -> what its restore holds and queued
        self.num_saved = 0
        self.num_hits = 0
        self.emit: EventSink | None = None  # KV events: a checkpoint stored / removed, once per state group
        self.groups: tuple[int, ...] = (0,)  # the state groups' indices (events name each)
        self.saved: list[Checkpoint] | None = None  # when a list, every checkpoint saved (for the tiers below)

    # ----------------------------------------------------------------- queries
    def __len__(self) -> int:
        return len(self._entries)

    def is_current(self, entry: Checkpoint) -> bool:
        """Whether `entry` is still kept (not evicted, reset or adopted since it was saved)."""
        kept = self._entries.get(entry.row)
        return kept is not None and kept.key == entry.key

    def find(self, parent: ParentKey, tokens: np.ndarray, start: int = 0, stop: int | None = None) -> Checkpoint | None:
        """The checkpoint under `parent` whose tail equals ``tokens[start:stop][:m]``, m largest (ties: the
        oldest); ``tokens[start:stop]`` holds the candidate tail positions (at most ``page_size - 1``). No side
        effects; a parent with no checkpoint costs one dict lookup."""
        rows = self._by_parent.get(parent)
        if not rows:
            return None
        tokens = tokens[start:stop]
        best: Checkpoint | None = None
        for row in rows:
            entry = self._entries[row]
            m = len(entry.tail)
            if m <= len(tokens) and (best is None or m > len(best.tail)) and np.array_equal(entry.tail, tokens[:m]):
                best = entry
        return best

    def num_available(self, hit: Checkpoint | None = None) -> int:
        """Rows an allocation can take (free or holding an evictable checkpoint), the row of `hit`
        excepted when it is free (a restore holds it)."""
        free = self.rows.num_free
        return free - (hit is not None and self.rows.ref_count(hit.row) == 0)

    def check_rows(self, n: int, hit: Checkpoint | None, request_id: Hashable) -> None:
        """`InsufficientBlocksError` unless `n` rows can be allocated once `hit` is held."""
        available = self.num_available(hit)
        if n > available:
            raise InsufficientBlocksError(
                f"Cannot get {n} state rows for request {request_id!r} (only {available} available of "
                f"{self.rows.num_blocks}; every other row holds a running request's state)",
                needed=n,
                available=available,
            )

    # ----------------------------------------------------------------- rows
    def allocate(self, n: int) -> list[int]:
        """`n` rows for a request's live and draft slots (may evict checkpoints). The caller checked
        `num_available`."""
        return self.rows.allocate(n)

    def free(self, rows: Sequence[int]) -> None:
        """Give back a request's rows (a row converted by `save_in_place` stays as a checkpoint)."""
        self.rows.free(rows)

    # ----------------------------------------------------------------- saving
    def save(
        self, src: int, parent: ParentKey, tail: np.ndarray, pages: Sequence[int], *, shared: bool = False
    ) -> Checkpoint | None:
        """Keep a copy of live row `src` as the checkpoint (`parent`, `tail`), its tail on `pages` (`shared`:
        at a divergence point, kept longer). An existing checkpoint of that key is refreshed instead; with
        every row held, nothing is saved (None). Queues ``StateCopy(src, row)``. Returns the checkpoint."""
        key = checkpoint_key(parent, tail)
        existing = self.rows.cached_page(key)
        if existing is not None:
            return self._refresh(existing, shared)
        if self.rows.num_free == 0:
            return None
        (row,) = self.rows.allocate(1)
        entry = self._add(row, parent, tail, pages, key, shared)
        self._copies.append(StateCopy(src, row))
        self.rows.free((row,))
        return entry

    def save_in_place(self, row: int, parent: ParentKey, tail: np.ndarray, pages: Sequence[int]) -> Checkpoint:
        """Turn live row `row` (about to be freed by its request) into the checkpoint (`parent`, `tail`):
        no copy (an existing checkpoint of that key is refreshed instead). Returns the checkpoint."""
        key = checkpoint_key(parent, tail)
        existing = self.rows.cached_page(key)
        if existing is not None:
            return self._refresh(existing, False)
        return self._add(row, parent, tail, pages, key, False)

    def _add(
        self, row: int, parent: ParentKey, tail: np.ndarray, pages: Sequence[int], key: bytes, shared: bool
    ) -> Checkpoint:
        self.rows.commit(row, key)
        self.token_pool.touch(pages)
        entry = self._entries[row] = Checkpoint(row, parent, np.array(tail, dtype=np.int32), tuple(pages), key, shared)
        self._by_parent.setdefault(parent, {})[row] = None
        self.num_saved += 1
        if self.saved is not None:
            self.saved.append(entry)
        if shared:
            self.rows.set_priority((row,), SHARED_PRIORITY)
        if self.emit is not None:
            ids = [int(t) for t in tail]
            head: BlockHash | None = None if isinstance(parent, tuple) else parent  # type: ignore[assignment]
            for g in self.groups:
                self.emit(BlockStored([key], head, ids, self.page_size, "GPU", g, "mamba"))

        return entry

    def _refresh(self, row: int, shared: bool) -> Checkpoint:
        """A recency refresh of the checkpoint in `row` (as a hit would give it); `shared` raises it."""
        entry = self._entries[row]
        if shared and not entry.shared:
            entry = self._entries[row] = entry._replace(shared=True)
            self.rows.set_priority((row,), SHARED_PRIORITY)
        self.rows.touch((row,))
        self.rows.free((row,))
        return entry

    def demote(self, entry: Checkpoint) -> None:
        """Send a checkpoint a deeper one superseded to the front of the eviction order (a shared one, or
        one evicted or replaced since, is left alone)."""
        if not entry.shared and self._entries.get(entry.row) is entry:
            self.rows.set_priority((entry.row,), 0)

    def _forget(self, row: int) -> None:
        """The pool uncached `row` (evicted or reset): drop its entry and its tail references."""
        entry = self._entries.pop(row, None)
        if entry is None:
            return
        rows = self._by_parent[entry.parent]
        del rows[row]
        if not rows:
            del self._by_parent[entry.parent]
        self.token_pool.free(entry.pages)
        if self.emit is not None:
            for g in self.groups:
                self.emit(BlockRemoved([entry.key], "GPU", g))

    def _gains(self, page: int, exclude: AbstractSet[int]) -> bool:
        """Whether freeing `page` adds an allocatable attention page (not a hit the caller takes, not pinned:
        a pinned page would go to the protected list)."""
        return page not in exclude and self.token_pool.pin_count(page) == 0

    def reclaimable(self, keep: Checkpoint | None = None, exclude: AbstractSet[int] = frozenset()) -> int:
        """Allocatable attention pages (see `_gains`; `exclude`: pages the caller's hit takes) that only
        checkpoints hold (their tails) and that evicting every checkpoint nobody restores (`keep`
        excepted) would free. No side effects."""
        refs: Counter[int] = Counter()
        for row, entry in self._entries.items():
            if entry.pages and self.rows.ref_count(row) == 0 and (keep is None or row != keep.row):
                refs.update(entry.pages)
        return sum(1 for page, n in refs.items() if self.token_pool.ref_count(page) == n and self._gains(page, exclude))

    def reclaim(self, n: int, keep: Checkpoint | None = None, exclude: AbstractSet[int] = frozenset()) -> bool:
        """When at least `n` attention pages are `reclaimable`, evict checkpoints that hold tail pages (`keep`
        and restored ones excepted), lowest retention priority first and then in the rows' list order, until
        `n` allocatable pages are freed, and return True; else change nothing and return False."""
        if not n or self.reclaimable(keep, exclude) < n:
            return False
        order = self.rows.keyed_order().priority
        listed = [r for r in self.rows.free_order() if r in self._entries and self._entries[r].pages]
        freed = 0
        for row in sorted(listed, key=lambda r: order[r]):  # (stable: list order within a priority)
            if freed >= n:
                break
            if keep is not None and row == keep.row:
                continue
            pages = set(self._entries[row].pages)
            self.rows.uncache((row,))  # (`_forget` drops its tail references)
            freed += sum(1 for page in pages if self.token_pool.ref_count(page) == 0 and self._gains(page, exclude))
        return True

    # ----------------------------------------------------------------- restoring
    def take_rows(self, n: int, hit: Checkpoint | None = None, adopt: bool = False) -> list[int]:
        """`n` rows for a request's live and draft slots. With `hit`: its row is held first, so no
        allocation evicts it before `restore` queues its copy; with `adopt` (rows are short and its row is
        free) the hit's row itself becomes the live row: the checkpoint ends and no state copy is needed
        (its tail pages stay referenced until the tail copies are taken)."""
        if hit is None:
            return self.allocate(n)
        if not adopt:
            self.rows.touch((hit.row,))
            return self.allocate(n)
        self.token_pool.touch(hit.pages)  # (`take` uncaches the row: `_forget` drops the checkpoint's references)
        return [*self.rows.take([hit.row]), *(self.allocate(n - 1) if n > 1 else [])]

    def restore(
        self, request_id: Hashable, hit: Checkpoint, dst: int, tail_pages: Sequence[int], adopted: bool = False
    ) -> None:
        """Queue the copies of a hit: state row -> live row `dst` (none when `adopted`: `dst` is its row),
        tail slots -> `tail_pages` (one per attention group, as `hit.pages`). The row, or an adopted hit's
        tail pages, stay held (`take_rows`) until `take` or `drop`."""
        copy = None if adopted else StateCopy(hit.row, dst)
        m = len(hit.tail)
        pages = [PageCopy(src, d, m) for src, d in zip(hit.pages, tail_pages, strict=True)] if m else []
        self._restoring[request_id] = _Pending(-1 if adopted else hit.row, copy, pages, hit.pages if adopted else ())
        if copy is not None:
            self._copies.append(copy)
        self._page_copies.extend(pages)
        self.num_hits += 1

    def drop(self, request_id: Hashable) -> None:
        """Forget a released request's restore that was never taken (its row and page references too)."""
        pending = self._restoring.pop(request_id, None)
        if pending is None:
            return
        if pending.copy is not None:
            self._copies.remove(pending.copy)
        for page in pending.pages:
            self._page_copies.remove(page)
        self._release((pending,))

    def take(self) -> tuple[list[StateCopy], list[PageCopy]]:
        """Hand over every pending copy in queue order (state rows; attention tail slots) and drop the
        restores' references: the caller runs the copies before the next forward pass."""
        copies, pages = self._copies, self._page_copies
        self._copies, self._page_copies = [], []
        self._release(self._restoring.values())
        self._restoring.clear()
        return copies, pages

    def _release(self, pending: Iterable[_Pending]) -> None:
        for p in list(pending):
            if p.row >= 0:
                self.rows.free((p.row,))
            self.token_pool.free(p.tails)

    def reset(self) -> int:
        """Drop every checkpoint nobody is restoring; returns how many."""
        return self.rows.reset_prefix_cache()

    # ----------------------------------------------------------------- invariants
    def tail_lengths(self) -> dict[int, int]:
        """Attention page -> the longest checkpoint tail on it (its slots below that are read by hits)."""
        out: dict[int, int] = {}
        for entry in self._entries.values():
            for page in entry.pages:
                out[page] = max(out.get(page, 0), len(entry.tail))
        return out

    def tail_refs(self) -> Counter[int]:
        """Attention pages the checkpoints' tails (and adopted hits' pending tail copies) reference (the
        attention pool's check counts them)."""
        refs = Counter(page for entry in self._entries.values() for page in entry.pages)
        refs.update(page for p in self._restoring.values() for page in p.tails)
        return refs

    def check(self, live: Counter[int]) -> None:
        """Raise `IntegrityError` unless the rows pool matches `live` (request slots) plus the pending
        restores and every cached row has its entry and index."""
        holders = Counter(live)
        holders.update(p.row for p in self._restoring.values() if p.row >= 0)
        self.rows.check_integrity(holders)
        for row, entry in self._entries.items():
            _require(self.rows.block_hash(row) == entry.key, f"checkpoint row {row} is not cached under its key")
            _require(row in self._by_parent.get(entry.parent, {}), f"checkpoint row {row} is not indexed")
            _require(len(entry.tail) < self.page_size, f"checkpoint row {row} has a tail of {len(entry.tail)}")
            _require(len(entry.pages) == 0 or len(entry.tail) > 0, f"checkpoint row {row} holds pages without a tail")
        _require(self.rows.num_cached == len(self._entries),
                 f"{self.rows.num_cached} cached rows but {len(self._entries)} checkpoints")  # fmt: skip
        _require(sum(map(len, self._by_parent.values())) == len(self._entries), "checkpoint index out of date")
