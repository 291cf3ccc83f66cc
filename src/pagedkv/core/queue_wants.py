"""`QueueWants`: the waiting requests a manager was told about, kept in its pool as wants (pure Python).

Queue-aware retention: a scheduler tells its manager (`BlockManager.expect`, `KVCacheCoordinator.expect`)
the head of its waiting queue, in order. Each newly told request gets a ticket in queue order (lower is
sooner; one put back at the front, a preempted request, is numbered ahead of those behind it) and its
prompt's full-page prefix keys become wants of the pool (`BlockPool.want`): free cached pages nobody waiting
wants are evicted first, then wanted ones, those of the request furthest back first. A want ends when the
request's first allocation succeeds (`unexpect`), and is keyed again after a weights version change.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pagedkv.core.block_pool import BlockPool
from pagedkv.core.context import RequestID, TextContext
from pagedkv.core.hashing import BlockHash, PrefixHasher
from pagedkv.core.tables import RequestPages, more_keys

__all__ = ["QueueWants"]

_NO_REQUEST = RequestPages()  # (no hashes yet: `more_keys` reads a waiting context's keys from its memo)


class QueueWants:
    """Tickets and prefix keys of the waiting requests `expect` was told about, as wants of `pool`."""

    def __init__(self, pool: BlockPool, hasher: PrefixHasher) -> None:
        self.pool = pool
        self.hasher = hasher
        self.entries: dict[RequestID, tuple[list[BlockHash], float, bytes]] = {}  # keys, ticket, chain root
        self.ticket = 0.0  # the last ticket handed out at the back of the queue
        # more keys a waiting context wants besides its prefix pages (its state checkpoint's run: see
        # `KVCacheCoordinator`), from the context and its prefix keys
        self.extra: Callable[[TextContext, list[BlockHash]], list[BlockHash]] | None = None
        self._last: tuple[list[TextContext], str | None] | None = None  # the last call's queue and weights version
        self._keyed: object = object()  # the weights version every entry was last checked under

    def __bool__(self) -> bool:
        return bool(self.entries)

    def expect(self, contexts: Sequence[TextContext], started: Callable[[TextContext], bool]) -> int:
        """Want the prefixes of `contexts` (the waiting queue's head, in order), skipping those `started`
        says are admitted or resumed already; returns how many were newly expected. TypeError for a
        non-`TextContext`, before anything changes. The same queue as the last call, under the same weights
        version, changes nothing and costs one comparison of the same objects (the scheduler tells it every step)."""
        queue = (list(contexts), self.hasher.version)
        if queue == self._last:  # (the same context objects: checked already)
            return 0
        if not set(map(type, contexts)) <= {TextContext}:
            bad = next(c for c in contexts if type(c) is not TextContext)
            raise TypeError(f"contexts holds {type(bad).__name__}, expected TextContext")
        rekey = queue[1] != self._keyed  # (roots change with the weights version only)
        self._last, self._keyed = queue, queue[1]
        entries, added = self.entries, 0
        after: list[float | None] = [None] * len(contexts)  # the ticket of the next known context behind each
        known: float | None = None
        for i in range(len(contexts) - 1, -1, -1):
            after[i] = known
            entry = entries.get(contexts[i].request_id)
            known = entry[1] if entry is not None else known
        before: float | None = None
        for ctx, nxt in zip(contexts, after, strict=True):
            rid = ctx.request_id
            entry = entries.get(rid)
            if rekey and entry is not None and entry[2] != self.hasher.root(ctx.cache_salt):  # under other weights
                self.unexpect(rid)
                self._want(ctx, entry[1])
                entry = entries[rid]
            if entry is not None or started(ctx):
                before = entry[1] if entry is not None else before
                continue
            if nxt is None:  # behind every known one: the next ticket
                self.ticket = max(self.ticket, before or 0.0) + 1
                ticket = self.ticket
            else:  # queued ahead of a known one (a preempted request goes back to the front)
                ticket = nxt - 1 if before is None else (before + nxt) / 2
            self._want(ctx, ticket)
            before = ticket
            added += 1
        return added

    def _want(self, ctx: TextContext, ticket: float) -> None:
        n = (len(ctx.tokens) - 1) // self.hasher.page_size
        keys, _ = more_keys(self.hasher, _NO_REQUEST, ctx, n) if n > 0 else ([], b"")
        if self.extra is not None:
            keys = [*keys, *self.extra(ctx, keys)]
        self.entries[ctx.request_id] = (keys, ticket, self.hasher.root(ctx.cache_salt))
        self.pool.want(keys, ticket)

    def unexpect(self, request_id: RequestID) -> None:
        """End the want recorded for `request_id` (no-op when there is none)."""
        entry = self.entries.pop(request_id, None)
        if entry is not None:
            self._last = None  # (the next call looks at every context again)
        if entry is not None and entry[0]:
            self.pool.want(entry[0], entry[1], -1)
