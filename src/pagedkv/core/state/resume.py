"""Where a request with recurrent state resumes, and how its state becomes a checkpoint (pure Python + numpy).

`StateResume` is the part of `KVCacheCoordinator` that only models with state groups have: it finds a
request's resume point at admission (the longest prefix with attention pages cached and a state checkpoint
exactly at its end), takes its state rows and queues the restore, saves checkpoints when they are due
(before a prompt's last token, a divergence cut, a release after a completed step) and gives a released
request's pages and rows back. The checkpoints themselves live in `checkpoints.StateCheckpoints`; the
request's tables and progress in `hybrid_state.HybridRequest`, which these methods update as each says.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Iterable, Sequence

import numpy as np

from pagedkv.core.context import TextContext
from pagedkv.core.groups import GroupManager
from pagedkv.core.hashing import BlockHash, PrefixHasher
from pagedkv.core.hybrid_state import HybridRequest, Plan, find_hit, release_pages
from pagedkv.core.pool import BlockPool
from pagedkv.core.state.checkpoints import Checkpoint, StateCheckpoints, run_key
from pagedkv.core.tables import more_keys

__all__ = ["StateResume"]


class StateResume:
    """The resume points and checkpoint saves of one coordinator's requests, over its `states`.

    Everything is fixed at construction and shared with the coordinator, never copied: `states` (the state rows
    and checkpoints), `hasher` (the prefix chain's keys), `pool` (the attention pages), `groups` (one manager per
    group), `token_groups` (the indices of the token groups: a checkpoint's tail pages), `state_groups` (the state
    groups'; the first one's table holds the live row first) and `caching` (prefix caching: without it nothing
    is saved at release). Sets ``states.groups`` to `state_groups` (the groups its events name).
    """

    def __init__(
        self, states: StateCheckpoints, hasher: PrefixHasher, pool: BlockPool, groups: Sequence[GroupManager], *,
        token_groups: Sequence[int], state_groups: Sequence[int], caching: bool,
    ) -> None:  # fmt: skip
        self.states = states
        self.hasher = hasher
        self.pool = pool
        self.groups = list(groups)
        self.token_groups = list(token_groups)
        self.state_groups = list(state_groups)
        self.state_group = self.state_groups[0]  # its table's first entry is the live row
        self.caching = caching
        states.groups = tuple(self.state_groups)

    # ----------------------------------------------------------------- admission
    def find(
        self, st: HybridRequest, ctx: TextContext, keys: list[BlockHash], stop: int
    ) -> tuple[Checkpoint | None, int, list[list[int]], list[int]]:
        """The longest hit with a state checkpoint exactly at its end: full pages up to page h (as `find_hit`,
        every group, over the prefix `keys` up to page `stop`) and a checkpoint under page h's parent (the
        chain's root for h = 0) whose tail matches the next tokens, resuming at most at the request's last
        token (its logits are needed). Returns (checkpoint or None, h, each group's entries, pages to pin).
        The resume point stays inside the request's window. No side effects."""
        states, root = self.states, self.hasher.root(ctx.cache_salt)
        ps, tokens = states.page_size, ctx.tokens.all
        last = min(len(tokens), ctx.tokens.current_position) - 1  # (a chunked window ends before the last token)
        found: list[Checkpoint | None] = [None]

        def accept(h: int) -> bool:
            hit = states.find(keys[h - 1] if h else (root,), tokens, h * ps, min(h * ps + ps - 1, last))
            if hit is None or h * ps + len(hit.tail) == 0:
                return False
            found[0] = hit
            return True

        hit, entries, pins = find_hit(self.groups, self.pool, st, keys, stop, accept)
        return found[0], hit, entries, pins

    @staticmethod
    def keeps(plan: Plan) -> tuple[Checkpoint | None, set[int]]:
        """What a reclaim for `plan` must not count on: its checkpoint, its hit pages (its checkpoint's run too)
        and the pages it pins."""
        run = plan.checkpoint.run if plan.checkpoint is not None else ()
        return plan.checkpoint, {p for pages in plan.hit_pages for p in pages} | set(plan.pins) | set(run)

    def plan_fits(self, plan: Plan, short: int) -> str | None:
        """How `plan`'s checkpoint hit (not None) can be had: "hold" (its row held, the state copied into new
        rows), "adopt" (rows are short but its row is free: that row becomes the request's live row), or None
        (its `short` missing attention pages cannot be reclaimed from checkpoint tails, or no row is left). No
        side effects."""
        states = self.states
        assert plan.checkpoint is not None
        if short > 0 and states.reclaimable(*self.keeps(plan)) < short:
            return None
        if plan.rows <= states.num_available(plan.checkpoint):
            return "hold"
        return "adopt" if states.can_adopt(plan.checkpoint) and plan.rows <= states.num_available() else None

    def reclaim(self, plan: Plan, short: int) -> bool:
        """Evict checkpoints until their tails and runs gave `short` attention pages back to the pool, none of
        what `plan` counts on (`keeps`); True when they did (`StateCheckpoints.reclaim`: False changes nothing)."""
        return self.states.reclaim(short, *self.keeps(plan))

    def take_rows(self, st: HybridRequest, ctx: TextContext, plan: Plan) -> None:
        """Give `st` the ``plan.rows`` live and draft state rows, appended to each state group's table (a hit's
        checkpoint held first, so no eviction takes it; adopted when ``plan.adopt``). Sets ``st.root`` to the
        chain's root now (the weights version its state is computed under)."""
        st.root = self.hasher.root(ctx.cache_salt)
        rows = self.states.take_rows(plan.rows, plan.checkpoint, plan.adopt)
        for g in self.state_groups:
            st.tables[g].append(rows)

    def restore(self, st: HybridRequest, request_id: Hashable, plan: Plan) -> None:
        """Queue the copies of ``plan.checkpoint`` (not None; after `take_rows` and the plan's new pages): its row
        into `st`'s live row, its tail's slots into `st`'s page ``plan.hit`` of each token group. The checkpoint
        joins ``st.superseded``."""
        hit = plan.checkpoint
        assert hit is not None
        tails = [int(st.tables[g].pages[plan.hit]) for g in self.token_groups] if len(hit.tail) else []
        self.states.restore(request_id, hit, int(st.tables[self.state_group].pages[0]), tails, plan.adopt)
        st.superseded.append(hit)

    def wanted_run(self, ctx: TextContext, keys: list[BlockHash]) -> list[BlockHash]:
        """The run keys of the deepest checkpoint a waiting context would resume from over its prefix `keys` (its
        pages' keys; queue-aware retention keeps them with the pages), or none. No side effects."""
        states = self.states
        ps, tokens = states.page_size, ctx.tokens.all
        last = len(tokens) - 1
        root = self.hasher.root(ctx.cache_salt)
        for h in range(len(keys), -1, -1):
            hit = states.find(keys[h - 1] if h else (root,), tokens, h * ps, min(h * ps + ps - 1, last))
            if hit is not None and hit.run:
                return [run_key(hit.key, i) for i in range(len(hit.run))]
        return []

    # ----------------------------------------------------------------- saves
    def save(
        self, st: HybridRequest, ctx: TextContext, at: int, *, in_place: bool, shared: bool = False
    ) -> Checkpoint | None:
        """Keep the request's live row (its state at token position `at`) as a checkpoint keyed by the prefix
        chain up to page ``at // page_size`` (extending ``st.hashes`` and ``st.digest`` when needed) and the tail
        after it; the tail's page in each token group is referenced. `in_place`: the request is being released
        and its live row becomes the checkpoint (no copy); `shared`: `at` is where a cached prefix diverged from
        the request. Clears ``st.cut`` when it was `at`. Returns the checkpoint (None, and nothing changed, when
        the chain's root changed since the request took its state rows: weights were updated, so its state is
        not what the new chain's keys promise; None too when every row is held)."""
        if self.hasher.root(ctx.cache_salt) != st.root:
            return None
        states = self.states
        ps, live = states.page_size, int(st.tables[self.state_group].pages[0])
        k = at // ps
        if k > len(st.hashes):
            keys, st.digest = more_keys(self.hasher, st, ctx, k)
            st.hashes.extend(keys)
        parent = st.hashes[k - 1] if k else (st.root,)
        tail = np.asarray(ctx.tokens.all[k * ps : at], dtype=np.int32)
        pages = [int(st.tables[g].pages[k]) for g in self.token_groups] if len(tail) else []
        if st.cut == at:
            st.cut = -1
        if in_place:
            return states.save_in_place(live, parent, tail, pages)
        return states.save(live, parent, tail, pages, shared=shared)

    def stepped(self, st: HybridRequest, ctx: TextContext) -> None:
        """After a step of `ctx` (its pages committed): when `st` holds its live rows, its forward pass left its
        live state at the processed position (``st.ctx``, ``st.state_at`` set to it), and a checkpoint due there
        is saved (`save_due`; a decode step has none)."""
        if st.tables[self.state_group].num_pages:
            st.ctx, st.state_at = ctx, ctx.tokens.processed_length  # the step's forward pass left the live state there
            if st.cut > 0 or st.end > 0:  # a checkpoint is due (a decode step has none)
                self.save_due(st, ctx)

    def save_due(self, st: HybridRequest, ctx: TextContext) -> None:
        """After a step that left the request's live state at ``st.state_at``: save it when a checkpoint is due
        there (`save`): the divergence cut ``st.cut`` (shared), the prompt-end position ``st.end`` (before the
        prompt's last token), or, when a driver ended no chunk at ``st.end``, the prompt's end. Updates
        ``st.end`` (-1 once passed); a prompt-end checkpoint joins ``st.superseded``. A cut the step went past
        without stopping is dropped (``st.cut`` = -1)."""
        at, end = st.state_at, st.end
        if at == st.cut or at == end or (end > 0 and at == ctx.tokens.prompt_length):
            shared = at == st.cut
            st.end = end if at < end else -1
            saved = self.save(st, ctx, at, in_place=False, shared=shared)
            if saved is not None and not shared:
                st.superseded.append(saved)
        elif 0 < st.cut < at:
            st.cut = -1

    # ----------------------------------------------------------------- release
    def release(self, st: HybridRequest, request_id: Hashable) -> None:
        """Free a released request's pages in every group (tail first, `hybrid_state.release_pages`) and its state
        rows (its last state may become a checkpoint, `_release_rows`). A checkpoint in a run is saved once the
        request's private pages are free, the pages it resumes over held meanwhile (`_held_for_release`), so
        taking a run never evicts them; a checkpoint in rows is kept before any page is freed. `st` is left
        holding its tables as they were (the caller forgets or replaces it)."""
        states, pool = self.states, self.pool
        late = states.run_pages > 0
        keep = self._held_for_release(st) if late and self.caching else []
        pool.hold(keep)
        if not late:
            self._release_rows(st, request_id)
        pages = release_pages(self.groups, pool, st)
        if late:
            self._release_rows(st, request_id)
            kept = set(keep)
            pool.free([p for p in pages if p in kept])  # (in release order: deepest evicted first)

    def _release_rows(self, st: HybridRequest, request_id: Hashable) -> None:
        """Give a released request's state rows back: its pending restore is dropped and, with prefix caching,
        when its last alloc was followed by a step (its live state is at ``st.state_at``), its live row
        becomes a checkpoint first, superseding its prompt-end checkpoint and the one it resumed from
        (`StateCheckpoints.demote`)."""
        states = self.states
        states.drop(request_id)
        table = st.tables[self.state_group]
        rows = table.pages[: table.num_pages].tolist()
        if rows and self.caching and st.state_at > 0 and st.ctx is not None and not st.dummy:
            saved = self.save(st, st.ctx, st.state_at, in_place=True)
            for entry in st.superseded:
                if saved is None or entry.key != saved.key:
                    states.demote(entry)
        states.free(rows)

    def _held_for_release(self, st: HybridRequest) -> list[int]:
        """The token groups' pages a checkpoint saved at the request's release resumes over (up to the page
        holding its state position ``st.state_at``), held while its run is taken: taking a run then finds the
        request's private pages freed, never these. Empty when no checkpoint is due (see `_release_rows`)."""
        if st.state_at <= 0 or st.ctx is None or st.dummy:
            return []
        k, null = st.state_at // self.hasher.page_size + 1, self.pool.null_block
        tables = [st.tables[g] for g in self.token_groups]
        return [int(p) for t in tables for p in t.pages[: min(k, t.num_pages)].tolist() if p != null]

    # ----------------------------------------------------------------- checks
    def check(self, reqs: Iterable[HybridRequest]) -> None:
        """Raise `IntegrityError` unless the state rows match the live rows `reqs` hold (every claimed request)
        plus the pending restores (`StateCheckpoints.check`). No side effects."""
        live = Counter(p for st in reqs for g in self.state_groups[:1]
                       for p in st.tables[g].pages[: st.tables[g].num_pages].tolist())  # fmt: skip
        self.states.check(live)
