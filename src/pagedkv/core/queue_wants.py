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

from pagedkv.core.context import RequestID, TextContext
from pagedkv.core.hashing import BlockHash, PrefixHasher
from pagedkv.core.pool import BlockPool
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
        self._gone: list[RequestID] = []  # requests `unexpect`ed since the last call
        self._started: dict[RequestID, TextContext] = {}  # contexts the last queues skipped as started (no want)

    def __bool__(self) -> bool:
        return bool(self.entries)

    def expect(self, contexts: Sequence[TextContext], started: Callable[[TextContext], bool]) -> int:
        """Want the prefixes of `contexts` (the waiting queue's head, in order), skipping those `started`
        says are admitted or resumed already; returns how many were newly expected. TypeError for a
        non-`TextContext`, before anything changes. The same queue as the last call, under the same weights
        version, changes nothing and costs one comparison of the same objects (the scheduler tells it every step);
        the last queue less its admitted heads, newcomers behind, costs C-level comparisons and the newcomers' wants."""
        queue = (list(contexts), self.hasher.version)
        last, gone = self._last, self._gone
        still = all(map(started, self._started.values()))  # (each context skipped as started still is)
        if queue == last and not gone and still:  # (the same context objects: checked already)
            return 0
        moved = None  # (the last queue, less its first k contexts, then newcomers from m on: only those are new)
        if last is not None and queue[1] == last[1] == self._keyed and still:
            moved = self._moved_on(last[0], queue[0], gone)
        if not set(map(type, queue[0][moved[1] if moved else 0 :])) <= {TextContext}:
            bad = next(c for c in queue[0] if type(c) is not TextContext)
            raise TypeError(f"contexts holds {type(bad).__name__}, expected TextContext")
        self._gone = []
        if moved is not None and last is not None:
            for ctx in last[0][: moved[0]]:  # (out of the queue: admitted, resumed or gone)
                self._started.pop(ctx.request_id, None)
            self._last = queue
            return self._want_each(queue[0], moved[1], started)
        rekey = queue[1] != self._keyed  # (roots change with the weights version only)
        self._last, self._keyed, self._started = queue, queue[1], {}
        entries = self.entries
        if rekey:
            for ctx in queue[0]:
                entry = entries.get(ctx.request_id)
                if entry is not None and entry[2] != self.hasher.root(ctx.cache_salt):  # under other weights
                    self.unexpect(ctx.request_id)
                    self._want(ctx, entry[1])
            self._gone = []
        return self._want_each(queue[0], 0, started)

    @staticmethod
    def _moved_on(old: list[TextContext], new: list[TextContext], gone: list[RequestID]) -> tuple[int, int] | None:
        """(k, m) when `old` less its first k contexts starts `new` with its first m (or `new` is a prefix of it), and
        every request unexpected since lies in those k; None when the queue changed otherwise."""
        if not new:
            return (len(old), 0) if {c.request_id for c in old}.issuperset(gone) else None
        first = new[0]
        k = next((i for i, ctx in enumerate(old) if ctx is first), -1)
        if k < 0:
            return None
        m = min(len(old) - k, len(new))
        if new[:m] != old[k : k + m]:
            return None
        if gone and not {c.request_id for c in old[:k]}.issuperset(gone):
            return None
        return k, m

    def _want_each(self, contexts: list[TextContext], start: int, started: Callable[[TextContext], bool]) -> int:
        """Want each of ``contexts[start:]`` that has no want yet and is not `started`, ticketed between the known
        ones around it; returns how many."""
        entries, added = self.entries, 0
        before: float | None = None
        for i in range(start - 1, -1, -1):  # (the last known ticket ahead: usually the one just ahead)
            entry = entries.get(contexts[i].request_id)
            if entry is not None:
                before = entry[1]
                break
        n = len(contexts) - start
        after: list[float | None] = [None] * n  # the ticket of the next known context behind each
        known: float | None = None
        for i in range(n - 1, -1, -1):
            after[i] = known
            entry = entries.get(contexts[start + i].request_id)
            known = entry[1] if entry is not None else known
        for i in range(n):
            ctx = contexts[start + i]
            entry = entries.get(ctx.request_id)
            if entry is not None:
                before = entry[1]
                continue
            if started(ctx):  # (remembered: should it stop being started in place, the next call walks every context)
                self._started[ctx.request_id] = ctx
                continue
            self._started.pop(ctx.request_id, None)
            nxt = after[i]
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
            self._gone.append(request_id)  # (the next call looks at every context again unless it left the queue)
        if entry is not None and entry[0]:
            self.pool.want(entry[0], entry[1], -1)
