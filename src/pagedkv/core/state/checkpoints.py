"""State checkpoints: prefix-cache hits on models with recurrent state (pure Python + numpy).

A recurrent layer (Mamba, gated delta net, short convolution) keeps one
state per request and updates it in place, so a cached attention prefix is a
hit only where a copy of the state *at its end* was kept. `StateCheckpoints`
keeps those copies.

Rows and runs. A running request's state lives in rows of its own pool (a
`BlockPool`; one row holds one request's state for every state layer, whatever
the attention page size): it holds `slots` rows (its live state and its draft
slots). A checkpoint is a copy of a live row, kept in one of two places:

- runs (``run_pages > 0``, a model with attention pages): a run of
  ``run_pages`` attention pages of `token_pool`, enough bytes for a state row,
  cached there under ``run_key(key, i)`` in the first state group's prefix cache. The
  attention pages and the checkpoints then share one byte budget and one
  eviction policy: a checkpoint's pages share its recency and priority, so the
  policy weighs a checkpoint at its real cost (hundreds of pages), and evicting
  any page of a run drops the checkpoint and frees the rest of the run at once.
  `max_checkpoints` caps how many are kept (None: as many as the pool holds).
  Live rows no request holds keep checkpoints too, at no cost: a released
  request's row when no run fits (a preempted request, a full pool) and a save
  no run fits, until an admission needs the row.
- rows (``run_pages == 0``, a model of state layers only): the other rows of
  the state pool, free cached rows its eviction policy takes back; the pool's
  size is the cap (`KVCacheParams.max_state_checkpoints` plus the live rows).

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
copies (`take`: `StateCopy` row to row, `RunCopy` row to run and back) and runs
them in order, saves before the forward pass that overwrites their source,
restores before the one that reads their target.
"""

from __future__ import annotations

import hashlib
from collections import Counter, OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from collections.abc import Set as AbstractSet
from typing import NamedTuple

import numpy as np

from pagedkv.core.errors import InsufficientBlocksError
from pagedkv.core.errors import require as _require
from pagedkv.core.events import BlockRemoved, BlockStored, EventSink
from pagedkv.core.hashing import BlockHash
from pagedkv.core.partial_pages import PageCopy
from pagedkv.core.pool import BlockPool

__all__ = ["SHARED_PRIORITY", "Checkpoint", "RunCopy", "StateCheckpoints", "StateCopy", "checkpoint_key", "run_key"]

SHARED_PRIORITY = 60  # retention priority of a checkpoint at a divergence point (the pool's default: 35)
_DEFAULT_PRIORITY = 35  # (`BlockPool`'s default retention priority)

ParentKey = Hashable
"""The prefix-cache key of the page before a checkpoint's tail, or ``(root digest,)``."""


class StateCopy(NamedTuple):
    """Copy state row `src` into state row `dst` (every state layer, every shard)."""

    src: int
    dst: int


class RunCopy(NamedTuple):
    """Copy state row `row` into the attention pages `pages` (`save`), or those pages into the row: the row's
    bytes (every state layer, every shard) laid end to end over the pages, the last one partly filled."""

    row: int
    pages: tuple[int, ...]
    save: bool


class _Pending(NamedTuple):
    """A restore not taken yet: the checkpoint row it holds (-1: adopted or a run), its copies, the attention
    pages it holds (an adopted hit's tail pages, or a run's pages)."""

    row: int
    copy: StateCopy | RunCopy | None
    pages: list[PageCopy]
    tails: Sequence[int]


class Checkpoint(NamedTuple):
    """A kept state: its row (for a run: its first page), where it sits in the prefix chain, its tail and,
    for a run, its pages (see the module docstring)."""

    row: int
    parent: ParentKey
    tail: np.ndarray  # int32 [m]: the tokens after the parent page, m < page_size
    pages: tuple[int, ...]  # per attention group: the page holding the tail (empty when m == 0)
    key: bytes
    shared: bool = False  # saved where a cached prefix diverged from a request (kept longer)
    run: tuple[int, ...] = ()  # the attention pages holding the state (run mode; empty: `row` holds it)


def checkpoint_key(parent: ParentKey, tail: np.ndarray) -> bytes:
    """SHA-256 of the parent key and the tail tokens (int32 little-endian)."""
    head = parent[0] if isinstance(parent, tuple) else parent
    raw = head if isinstance(head, bytes) else int(head).to_bytes(8, "big", signed=True)  # type: ignore[arg-type]
    return hashlib.sha256(b"pagedkv-state\x00" + raw + np.ascontiguousarray(tail, dtype="<i4").tobytes()).digest()


def run_key(key: bytes, i: int) -> bytes:
    """The prefix-cache key of page `i` of the run holding the checkpoint `key`."""
    return key + i.to_bytes(4, "big")


class StateCheckpoints:
    """The state rows of one replica: live slots, checkpoints, their index and pending copies.

    `token_pool` is the attention pages' pool (tails hold references on its pages);
    `enabled` False keeps rows for live slots only (nothing is saved or found). `run_pages` > 0 keeps
    checkpoints in runs of that many `token_pool` pages (then `num_rows` counts live slots only), at most
    `max_checkpoints` of them (None: no cap); 0 keeps them in rows (see the module docstring).
    """

    def __init__(
        self, num_rows: int, slots: int, token_pool: BlockPool, page_size: int, *, enabled: bool,
        eviction_policy: str = "lru", run_pages: int = 0, max_checkpoints: int | None = None,
    ) -> None:  # fmt: skip
        self.run_pages = run_pages
        self.max_checkpoints = max_checkpoints
        self.rows = BlockPool(num_rows, enabled, 1, eviction_policy, 0.0)
        self.run_base = num_rows + 1  # a run's checkpoint id: run_base + its first page (row ids are below)
        self.rows.on_uncached.append(self._forget)
        if run_pages:
            token_pool.on_uncached.append(self._run_uncached)
        self.slots = slots
        self.enabled = enabled
        self.token_pool = token_pool
        self.page_size = page_size
        self._entries: dict[int, Checkpoint] = {}  # row (a run: `run_base` + its first page) -> checkpoint
        self._by_parent: dict[ParentKey, dict[int, None]] = {}  # parent -> rows (insertion-ordered set)
        self._run_of: dict[int, int] = {}  # run mode: page -> the checkpoint (first page) whose run it is in
        self._recency: OrderedDict[int, int] = OrderedDict()  # run mode: checkpoint -> priority, oldest first
        self._copies: list[StateCopy | RunCopy] = []
        self._page_copies: list[PageCopy] = []
        self._restoring: dict[Hashable, _Pending] = {}  # request -> what its restore holds and queued
        self.num_saved = 0
        self.num_hits = 0
        self.num_dropped = 0  # checkpoints evicted, reset or adopted
        self.emit: EventSink | None = None  # KV events: a checkpoint stored / removed, once per state group
        self.groups: tuple[int, ...] = (0,)  # state groups' indices (events name each; runs cached in the first's)
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

    def _held(self, entry: Checkpoint) -> bool:
        """Whether a restore holds `entry` (its row, or its run's pages)."""
        return self.token_pool.ref_count(entry.run[0]) > 0 if entry.run else self.rows.ref_count(entry.row) > 0

    def num_available(self, hit: Checkpoint | None = None) -> int:
        """Rows an allocation can take (free or holding an evictable checkpoint), the row of `hit`
        excepted when it is free (a restore holds it)."""
        free = self.rows.num_free
        return free - (hit is not None and not hit.run and self.rows.ref_count(hit.row) == 0)

    def can_adopt(self, hit: Checkpoint) -> bool:
        """Whether `hit`'s row can become a live row (a free checkpoint row; never a run)."""
        return not hit.run and self.rows.ref_count(hit.row) == 0

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
        every row held (runs: fewer free pages than a run, or the cap reached with every checkpoint held),
        nothing is saved (None). Queues the copy. Returns the checkpoint."""
        key, entry = self._kept_or_run(src, parent, tail, pages, shared)
        if entry is not None:
            return entry
        if self.rows.num_free == 0:  # (runs: a free row, when no run fits)
            return None
        (row,) = self.rows.allocate(1)
        entry = self._add(row, parent, tail, pages, key, shared)
        self._copies.append(StateCopy(src, row))
        self.rows.free((row,))
        return entry

    def _kept_or_run(
        self, src: int, parent: ParentKey, tail: np.ndarray, pages: Sequence[int], shared: bool
    ) -> tuple[bytes, Checkpoint | None]:
        """The key of (`parent`, `tail`) and its checkpoint: the one kept under it, refreshed, else a new one in
        a run copied from row `src` (runs only, when one fits), else None."""
        key = checkpoint_key(parent, tail)
        existing = self._cached(key)
        if existing is not None:
            return key, self._refresh(existing, shared)
        return key, self._save_run(src, parent, tail, pages, key, shared) if self.run_pages else None

    def _cached(self, key: bytes) -> int | None:
        """The id of the checkpoint kept under `key` (in a run, else in a row), or None."""
        first = self.token_pool.cached_page(run_key(key, 0), self.groups[0]) if self.run_pages else None
        return self.rows.cached_page(key) if first is None else self.run_base + first

    def _save_run(
        self, src: int, parent: ParentKey, tail: np.ndarray, pages: Sequence[int], key: bytes, shared: bool
    ) -> Checkpoint | None:
        pool, n = self.token_pool, self.run_pages
        if not pool.can_allocate_unwanted(n):
            return None  # (a save never evicts what a waiting request will hit)
        if self.max_checkpoints is not None and len(self._recency) >= self.max_checkpoints:
            free = [r for r in self._recency if not self._held(self._entries[r])]
            if not free:
                return None
            victim = min(free, key=self._recency.__getitem__)  # lowest priority, then oldest
            self._drop_entry(self._entries[victim])
        run = pool.allocate(n)  # (may evict pages: of other checkpoints' runs too)
        for i, page in enumerate(run):
            pool.commit(page, run_key(key, i), self.groups[0])
        entry = self._add(self.run_base + run[0], parent, tail, pages, key, shared, tuple(run))
        self._copies.append(RunCopy(src, tuple(run), True))
        pool.free(run)
        return entry

    def save_in_place(self, row: int, parent: ParentKey, tail: np.ndarray, pages: Sequence[int]) -> Checkpoint | None:
        """Turn live row `row` (about to be freed by its request) into the checkpoint (`parent`, `tail`):
        no copy (an existing checkpoint of that key is refreshed instead). With runs, a copy into a run
        first (it outlives the row's next use); the row itself when no run fits. Returns the checkpoint."""
        key, entry = self._kept_or_run(row, parent, tail, pages, False)
        return entry if entry is not None else self._add(row, parent, tail, pages, key, False)

    def _add(
        self, row: int, parent: ParentKey, tail: np.ndarray, pages: Sequence[int], key: bytes, shared: bool,
        run: tuple[int, ...] = (),
    ) -> Checkpoint:  # fmt: skip
        if run:
            for page in run:
                self._run_of[page] = row
            self._recency[row] = _DEFAULT_PRIORITY
        else:
            self.rows.commit(row, key)
        self.token_pool.touch(pages)
        entry = Checkpoint(row, parent, np.array(tail, dtype=np.int32), tuple(pages), key, shared, run)
        self._entries[row] = entry
        self._by_parent.setdefault(parent, {})[row] = None
        self.num_saved += 1
        if self.saved is not None:
            self.saved.append(entry)
        if shared:
            self._prioritize(entry, SHARED_PRIORITY)
        if self.emit is not None:
            ids = [int(t) for t in tail]
            head: BlockHash | None = None if isinstance(parent, tuple) else parent  # type: ignore[assignment]
            for g in self.groups:
                self.emit(BlockStored([key], head, ids, self.page_size, "GPU", g, "mamba"))
        return entry

    def _prioritize(self, entry: Checkpoint, priority: int) -> None:
        if entry.run:
            self.token_pool.set_priority(entry.run, priority)
            self._recency[entry.row] = priority
        else:
            self.rows.set_priority((entry.row,), priority)

    def _refresh(self, row: int, shared: bool) -> Checkpoint:
        """A recency refresh of the checkpoint in `row` (as a hit would give it); `shared` raises it."""
        entry = self._entries[row]
        if shared and not entry.shared:
            entry = self._entries[row] = entry._replace(shared=True)
            self._prioritize(entry, SHARED_PRIORITY)
        if entry.run:
            self.token_pool.touch(entry.run)
            self.token_pool.free(entry.run)
            self._recency.move_to_end(row)
        else:
            self.rows.touch((row,))
            self.rows.free((row,))
        return entry

    def demote(self, entry: Checkpoint) -> None:
        """Send a checkpoint a deeper one superseded to the front of the eviction order (a shared one, or
        one evicted or replaced since, is left alone)."""
        if not entry.shared and self._entries.get(entry.row) is entry:
            self._prioritize(entry, 0)

    def _run_uncached(self, page: int) -> None:
        """The token pool uncached `page` (evicted or reset): when it is in a run, the checkpoint is gone and
        the rest of its run is uncached too (those pages become fresh)."""
        row = self._run_of.get(page)
        if row is None:
            return
        run = self._entries[row].run
        for p in run:
            del self._run_of[p]
        del self._recency[row]
        self._forget(row)
        self.token_pool.uncache([p for p in run if p != page])

    def _forget(self, row: int) -> None:
        """The pool uncached `row` (evicted or reset): drop its entry and its tail references."""
        entry = self._entries.pop(row, None)
        if entry is None:
            return
        self.num_dropped += 1
        rows = self._by_parent[entry.parent]
        del rows[row]
        if not rows:
            del self._by_parent[entry.parent]
        self.token_pool.free(entry.pages)
        if self.emit is not None:
            for g in self.groups:
                self.emit(BlockRemoved([entry.key], "GPU", g))

    def _drop_entry(self, entry: Checkpoint) -> None:
        """Evict `entry` (not held): its row or its run leaves the cache."""
        if entry.run:
            self.token_pool.uncache(entry.run)
        else:
            self.rows.uncache((entry.row,))

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
            if entry.pages and not self._held(entry) and (keep is None or row != keep.row):
                refs.update(entry.pages)
        return sum(1 for page, n in refs.items() if self.token_pool.ref_count(page) == n and self._gains(page, exclude))

    def _eviction_order(self) -> list[int]:
        """Free checkpoints holding tail pages, lowest retention priority first, then oldest first (within a
        priority: runs before rows, each in its own order)."""
        runs = [r for r in self._recency if self._entries[r].pages and not self._held(self._entries[r])]
        ranked = [(self._recency[r], r) for r in runs]
        if self.rows.num_cached:
            priority = self.rows.keyed_order().priority
            listed = [r for r in self.rows.free_order() if r in self._entries and self._entries[r].pages]
            ranked.extend((priority[r], r) for r in listed)
        return [r for _, r in sorted(ranked, key=lambda x: x[0])]  # (stable: each source's order kept)

    def reclaim(self, n: int, keep: Checkpoint | None = None, exclude: AbstractSet[int] = frozenset()) -> bool:
        """When at least `n` attention pages are `reclaimable`, evict checkpoints that hold tail pages (`keep`
        and restored ones excepted), lowest retention priority first and then oldest first, until `n`
        allocatable pages are freed, and return True; else change nothing and return False."""
        if not n or self.reclaimable(keep, exclude) < n:
            return False
        freed = 0
        for row in self._eviction_order():
            if freed >= n:
                break
            if keep is not None and row == keep.row:
                continue
            entry = self._entries[row]
            pages = set(entry.pages)
            self._drop_entry(entry)  # (`_forget` drops its tail references)
            freed += sum(1 for page in pages if self.token_pool.ref_count(page) == 0 and self._gains(page, exclude))
        return True

    # ----------------------------------------------------------------- restoring
    def take_rows(self, n: int, hit: Checkpoint | None = None, adopt: bool = False) -> list[int]:
        """`n` rows for a request's live and draft slots. With `hit`: its row (or run) is held first, so no
        allocation evicts it before `restore` queues its copy; with `adopt` (rows are short and its row is
        free) the hit's row itself becomes the live row: the checkpoint ends and no state copy is needed
        (its tail pages stay referenced until the tail copies are taken)."""
        if hit is None:
            return self.allocate(n)
        if hit.run:
            self.token_pool.touch(hit.run)
            self._recency.move_to_end(hit.row)
            return self.allocate(n)
        if not adopt:
            self.rows.touch((hit.row,))
            return self.allocate(n)
        self.token_pool.touch(hit.pages)  # (`take` uncaches the row: `_forget` drops the checkpoint's references)
        return [*self.rows.take([hit.row]), *(self.allocate(n - 1) if n > 1 else [])]

    def restore(
        self, request_id: Hashable, hit: Checkpoint, dst: int, tail_pages: Sequence[int], adopted: bool = False
    ) -> None:
        """Queue the copies of a hit: state row (or run) -> live row `dst` (none when `adopted`: `dst` is its
        row), tail slots -> `tail_pages` (one per attention group, as `hit.pages`). The row or run, or an
        adopted hit's tail pages, stay held (`take_rows`) until `take` or `drop`."""
        copy: StateCopy | RunCopy | None
        if hit.run:
            copy = RunCopy(dst, hit.run, False)
        else:
            copy = None if adopted else StateCopy(hit.row, dst)
        m = len(hit.tail)
        pages = [PageCopy(src, d, m) for src, d in zip(hit.pages, tail_pages, strict=True)] if m else []
        held = hit.run if hit.run else hit.pages if adopted else ()
        self._restoring[request_id] = _Pending(-1 if adopted or hit.run else hit.row, copy, pages, held)
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

    def take(self) -> tuple[list[StateCopy | RunCopy], list[PageCopy]]:
        """Hand over every pending copy in queue order (state rows and runs; attention tail slots) and drop
        the restores' references: the caller runs the copies before the next forward pass."""
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
        runs = [e for e in self._entries.values() if e.run and not self._held(e)]
        for entry in runs:
            self._drop_entry(entry)
        return len(runs) + self.rows.reset_prefix_cache()

    # ----------------------------------------------------------------- invariants
    def tail_lengths(self) -> dict[int, int]:
        """Attention page -> the longest checkpoint tail on it (its slots below that are read by hits)."""
        out: dict[int, int] = {}
        for entry in self._entries.values():
            for page in entry.pages:
                out[page] = max(out.get(page, 0), len(entry.tail))
        return out

    def tail_refs(self) -> Counter[int]:
        """Attention pages the checkpoints' tails, adopted hits' pending tail copies and held runs reference
        (the attention pool's check counts them)."""
        refs = Counter(page for entry in self._entries.values() for page in entry.pages)
        refs.update(page for p in self._restoring.values() for page in p.tails)
        return refs

    def page_usage(self) -> tuple[int, int]:
        """(pages the attention pool counts as referenced that only checkpoints hold, pages checkpoints take).
        The first: tail pages no request holds any more and the runs a pending restore holds; the second: those
        and every page of every run (cached free pages of the pool). Both are evictable: a tail page goes back
        when an allocation needs it (`reclaim`), a run with any of its pages (the pool's policy). No side
        effects; costs one pass over the checkpoints."""
        ref, only = self.token_pool.ref_count, 0
        tails = 0
        for page, n in self.tail_refs().items():
            if ref(page) == n:
                only += 1
                tails += page not in self._run_of
        return only, len(self._run_of) + tails

    def check(self, live: Counter[int]) -> None:
        """Raise `IntegrityError` unless the rows pool matches `live` (request slots) plus the pending
        restores, every cached row (or run) has its entry and index, and every run is cached whole."""
        holders = Counter(live)
        holders.update(p.row for p in self._restoring.values() if p.row >= 0)
        self.rows.check_integrity(holders)
        for row, entry in self._entries.items():
            if entry.run:
                _require(entry.run[0] + self.run_base == row and len(entry.run) == self.run_pages,
                         f"checkpoint {row} has a bad run")  # fmt: skip
                for i, page in enumerate(entry.run):
                    _require(self.token_pool.block_hash(page) == run_key(entry.key, i) and self._run_of.get(page) == row,
                             f"page {page} of checkpoint {row}'s run is not cached under its key")  # fmt: skip
            else:
                _require(self.rows.block_hash(row) == entry.key, f"checkpoint row {row} is not cached under its key")
            _require(row in self._by_parent.get(entry.parent, {}), f"checkpoint row {row} is not indexed")
            _require(len(entry.tail) < self.page_size, f"checkpoint row {row} has a tail of {len(entry.tail)}")
            _require(len(entry.pages) == 0 or len(entry.tail) > 0, f"checkpoint row {row} holds pages without a tail")
        runs = sum(1 for e in self._entries.values() if e.run)
        _require(len(self._run_of) == self.run_pages * runs and set(self._recency) == {
            r for r, e in self._entries.items() if e.run}, "run index out of date")  # fmt: skip
        _require(self.max_checkpoints is None or runs <= self.max_checkpoints,
                 f"{runs} checkpoints in runs over the cap of {self.max_checkpoints}")  # fmt: skip
        _require(self.rows.num_cached == len(self._entries) - runs,
                 f"{self.rows.num_cached} cached rows but {len(self._entries) - runs} checkpoints in rows")  # fmt: skip
        _require(sum(map(len, self._by_parent.values())) == len(self._entries), "checkpoint index out of date")
