"""Per-request page tables and the batch lookup table built from them (pure numpy)."""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

import numpy as np

from pagedkv.core.context import TextContext
from pagedkv.core.errors import MissingPagesError
from pagedkv.core.hashing import BlockHash, PrefixHasher
from pagedkv.params.validation import INT32_MAX, check_int

__all__ = ["RequestPages", "BatchTables", "SwappedRequest", "assemble_tables", "build_tables", "check_batch", "check_claimed_batch",
           "claimed_state", "claimed_states", "lut_columns", "more_keys", "required_pages"]  # fmt: skip

_NO_PAGES = np.zeros(0, dtype=np.int32)


@dataclass(slots=True, eq=False)
class RequestPages:
    """One request's page table and prefix-cache progress."""

    pages: np.ndarray = field(default_factory=lambda: _NO_PAGES)  # int32 ids; only [:num_pages] is meaningful
    num_pages: int = 0
    committed: int = 0  # leading pages committed to the prefix cache
    hashes: list[BlockHash] = field(default_factory=list)  # keys of the hashed pages so far
    digest: bytes = b""  # chain digest after hashes[-1]
    dummy: bool = False
    unwritten: int = -1  # commit_on_alloc: first page committed at alloc whose step has not run (-1: none)
    context: Any = None  # the context its last `alloc` was given (a failed tier load rewinds it: `restart_holders`)

    def append(self, new_pages: Sequence[int]) -> None:
        """Add pages at the end of the table (the array grows by doubling)."""
        n, k = self.num_pages, len(new_pages)
        if n + k > len(self.pages):
            grown = np.empty(max(2 * len(self.pages), n + k, 8), dtype=np.int32)
            grown[:n] = self.pages[:n]
            self.pages = grown
        self.pages[n : n + k] = new_pages
        self.num_pages = n + k

    def push(self, page: int) -> None:
        """Add one page at the end (a decode step's: an item store is several times cheaper)."""
        n = self.num_pages
        if n < len(self.pages):
            self.pages[n] = page
            self.num_pages = n + 1
        else:
            self.append((page,))


@dataclass(frozen=True)
class SwappedRequest:
    """A swapped-out request's page tables, enough to rebuild them entry for entry (`swap_restore` of
    `BlockManager` and `KVCacheCoordinator`): per group, which entries held a page (the others were dropped
    out of a window: the null page), and the request's progress through the prefix cache.

    The pages `swap_snapshot` hands out are the live entries, group by group in table order: the
    "index in the snapshot's page list" that `swap_restore` returns with each fresh page counts them."""

    live: tuple[tuple[bool, ...], ...]  # per group, per table entry: a page (True) or the null page
    dropped: tuple[int, ...]  # per group: the window's dropped count
    committed: int  # leading logical pages that were in the prefix cache (recommitted after the copy)
    shared: int  # leading pages it shared with the cache (never dropped)
    hashes: tuple[BlockHash, ...]
    digest: bytes

    @property
    def num_pages(self) -> int:
        """Pages the request held (the host rows its copy takes): every live entry of every group."""
        return sum(sum(entries) for entries in self.live)


def more_keys(hasher: PrefixHasher, st: Any, ctx: TextContext, n_pages: int) -> tuple[list[BlockHash], bytes]:
    """Prefix-cache keys of pages ``[len(st.hashes), n_pages)`` of request `st` (a `RequestPages` or a
    hybrid request: anything with `hashes` and `digest`) and the chain digest after them. Stores
    nothing in `st`; on a first lookup it memoises the keys in ``ctx.key_cache`` so a re-admitted
    request does not hash its prompt again."""
    have = len(st.hashes)
    if n_pages <= have:
        return [], st.digest
    if have or hasher.algo == "sha256_64":  # (sha256_64 keys are not their digests)
        ps = hasher.page_size
        data = ctx.tokens.le_bytes(have * ps, n_pages * ps)
        if have:  # (the request's own next pages: see `PrefixHasher.extend_bytes`)
            return hasher.extend_bytes(data, st.digest, memo=False)
        return hasher.extend_bytes(data, hasher.root(ctx.cache_salt))
    memo = ctx.key_cache  # a first lookup: this request's keys may be known from an earlier admission
    root = hasher.root(ctx.cache_salt)  # (a memo from another root: another weights version)
    if memo is None or memo[0] is not hasher or memo[1] != root:
        memo = (hasher, root, [], root)
    keys, digest = memo[2], memo[3]
    if n_pages > len(keys):
        more, digest = hasher.extend_bytes(
            ctx.tokens.le_bytes(len(keys) * hasher.page_size, n_pages * hasher.page_size), digest
        )
        keys = keys + more
        ctx.key_cache = (hasher, root, keys, digest)
    return keys[:n_pages], keys[n_pages - 1]


@dataclass(frozen=True, eq=False)
class BatchTables:
    """Host-side tables of one replica's batch, ready to become tensors.

    Attributes:
        lookup_table: int32 [batch, round_up(pages, 8) + 16]; row i lists request
            i's pages in logical order, every other cell is the null page id.
        cache_lengths: int32 [batch]; tokens already in the cache per request.
        max_prompt_length: longest active window in the batch.
        max_cache_length: longest ``processed + active`` in the batch.
    """

    lookup_table: np.ndarray
    cache_lengths: np.ndarray
    max_prompt_length: int
    max_cache_length: int


def lut_columns(num_pages: int) -> int:
    """Lookup-table width for `num_pages` pages: a multiple of 8 plus 16 cells of overrun room."""
    return -(-num_pages // 8) * 8 + 16


_REQUEST_ID = attrgetter("request_id")


def claimed_states(reqs: Mapping[Hashable, Any], batch: Sequence[TextContext]) -> list[Any]:
    """The request states of `batch`, in order; ValueError naming the first request not claimed
    (the hot path of `step`: one dict lookup per request, no duplicate check)."""
    try:
        return list(map(reqs.__getitem__, map(_REQUEST_ID, batch)))
    except KeyError as missing:
        raise ValueError(f"request {missing.args[0]!r} is not claimed: call claim() first") from None


def claimed_state(reqs: Mapping[Hashable, Any], request_id: Hashable) -> Any:
    """The state of claimed, non-dummy `request_id` (what `alloc` and `step` need); ValueError otherwise."""
    st = reqs.get(request_id)
    if st is None:
        raise ValueError(f"request {request_id!r} is not claimed: call claim() first")
    if st.dummy:
        raise ValueError(f"request {request_id!r} is a dummy (alloc_dummy); it cannot alloc or step")
    return st


def check_claimed_batch(reqs: Mapping[Hashable, Any], batch: Sequence[TextContext]) -> None:
    """ValueError naming the first request of `batch` not in `reqs` or there twice. No side effects. The common
    case is decided with C-level set operations (this runs once per replica per step); only a batch that fails
    them is walked again (`check_batch`) for the precise error."""
    ids = set(map(_REQUEST_ID, batch))
    if len(ids) != len(batch) or not ids <= reqs.keys():
        check_batch(reqs, batch)


def check_batch(reqs: Mapping[Hashable, Any], batch: Sequence[TextContext]) -> list[Any]:
    """The request states of `batch`, in order; ValueError for an unknown or repeated request."""
    states: list[Any] = []
    seen: set[Any] = set()
    for ctx in batch:
        rid = ctx.request_id
        st = reqs.get(rid)
        if st is None or rid in seen:
            raise ValueError(f"request {rid!r} is {'repeated in the batch' if st else 'not claimed'}")
        seen.add(rid)
        states.append(st)
    return states


def required_pages(end: int, page_size: int) -> int:
    """Pages a request needs to hold for `end` token slots."""
    return -(-end // page_size)


def assemble_tables(
    rows: Sequence[tuple[Hashable, RequestPages, int]],
    cache_lengths: Sequence[int],
    ends: Sequence[int],
    page_size: int,
    null_page: int,
    max_cache_length: int | None = None,
) -> BatchTables:
    """`BatchTables` from (request id, table, pages required) rows; `MissingPagesError` (a
    RuntimeError and ValueError) when a table is short."""
    for rid, table, required in rows:
        if table.num_pages < required:
            raise MissingPagesError(
                f"request {rid!r} holds {table.num_pages} pages but needs {required}: alloc must be called first"
            )
    width = max((r for _, _, r in rows), default=0)
    if max_cache_length is not None:
        check_int("max_cache_length", max_cache_length, 1, INT32_MAX)  # (cache lengths are int32)
        if -(-max_cache_length // page_size) < width:
            raise ValueError(f"max_cache_length={max_cache_length} is below the batch's {width} pages of {page_size}")
        width = -(-max_cache_length // page_size)
    lut = np.full((len(rows), lut_columns(width)), null_page, dtype=np.int32)  # [B, cols]
    for i, (_, table, required) in enumerate(rows):
        lut[i, :required] = table.pages[:required]
    return BatchTables(
        lookup_table=lut,
        cache_lengths=np.array(cache_lengths, dtype=np.int32),  # [B]
        max_prompt_length=max((e - p for p, e in zip(cache_lengths, ends, strict=True)), default=0),
        max_cache_length=max(ends, default=0),
    )


def build_tables(
    reqs: Mapping[Hashable, RequestPages],
    batch: Sequence[TextContext],
    page_size: int,
    num_speculative_tokens: int,
    null_page: int,
    max_cache_length: int | None = None,
) -> BatchTables:
    """The `BatchTables` of `batch`; each request must hold pages for all its tokens (+ drafts)."""
    states = check_batch(reqs, batch)
    rows = [
        (ctx.request_id, st, 0 if st.dummy else required_pages(len(ctx.tokens) + num_speculative_tokens, page_size))
        for ctx, st in zip(batch, states, strict=True)
    ]
    processed = [ctx.tokens.processed_length for ctx in batch]
    ends = [ctx.tokens.current_position for ctx in batch]
    return assemble_tables(rows, processed, ends, page_size, null_page, max_cache_length)
