"""Where a request with recurrent state resumes, and how its state becomes a checkpoint (pure Python + numpy).

`KVCacheCoordinator` calls these for models with state groups: `find_state_hit` at admission (the
longest prefix with attention pages cached and a state checkpoint exactly at its end) and
`save_state` when a checkpoint is due (before a prompt's last token, a divergence cut, a release after a
completed step). The checkpoints themselves live in `checkpoints.StateCheckpoints`. `release_request` gives a
released request's pages and rows back; `restart_holders` does so for those a failed tier load left
holding pages or a state row that are not what they claim, and keeps them claimed.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np

from pagedkv.core.checkpoints import Checkpoint, StateCheckpoints, run_key
from pagedkv.core.context import TextContext
from pagedkv.core.groups import GroupManager
from pagedkv.core.hashing import BlockHash, PrefixHasher
from pagedkv.core.hybrid_state import HybridRequest, Plan, find_hit, release_order
from pagedkv.core.pool import BlockPool
from pagedkv.core.tables import RequestPages, more_keys

__all__ = [
    "find_state_hit", "held_for_release", "keeps", "plan_fits", "release_request", "release_rows", "save_due",
    "save_state", "wanted_run",
]  # fmt: skip


def find_state_hit(
    states: StateCheckpoints, groups: Sequence[GroupManager], pool: BlockPool, st: HybridRequest, ctx: TextContext,
    keys: list[BlockHash], stop: int, root: bytes,
) -> tuple[Checkpoint | None, int, list[list[int]], list[int]]:  # fmt: skip
    """The longest hit with a state checkpoint exactly at its end: full pages up to page h (as `find_hit`,
    every group) and a checkpoint under page h's parent (`root` for h = 0) whose tail matches the next
    tokens, resuming at most at the request's last token (its logits are needed). Returns (checkpoint or
    None, h, each group's entries, pages to pin). The resume point stays inside the request's window. No
    side effects."""
    ps, tokens = states.page_size, ctx.tokens.all
    last = min(len(tokens), ctx.tokens.current_position) - 1  # (a chunked window ends before the last token)
    found: list[Checkpoint | None] = [None]

    def accept(h: int) -> bool:
        hit = states.find(keys[h - 1] if h else (root,), tokens, h * ps, min(h * ps + ps - 1, last))
        if hit is None or h * ps + len(hit.tail) == 0:
            return False
        found[0] = hit
        return True

    hit, entries, pins = find_hit(groups, pool, st, keys, stop, accept)
    return found[0], hit, entries, pins


def save_state(
    states: StateCheckpoints, hasher: PrefixHasher, st: HybridRequest, ctx: TextContext, at: int,
    token_groups: Sequence[int], state_group: int, *, in_place: bool, shared: bool = False,
) -> Checkpoint | None:  # fmt: skip
    """Keep the request's live row (in its table of `state_group`; its state at token position `at`) as a
    checkpoint keyed by the prefix chain up to page ``at // page_size`` (extending ``st.hashes`` when
    needed) and the tail after it; the tail's page in each of `token_groups` is referenced. `in_place`:
    the request is being released and its live row becomes the checkpoint (no copy); `shared`: `at` is
    where a cached prefix diverged from the request. Clears ``st.cut`` when it was `at`. Returns the
    checkpoint (None when every row is held, or when the chain's root changed since the request took its
    state rows: weights were updated, so its state is not what the new chain's keys promise)."""
    if hasher.root(ctx.cache_salt) != st.root:
        return None
    ps, live = states.page_size, int(st.tables[state_group].pages[0])
    k = at // ps
    if k > len(st.hashes):
        keys, st.digest = more_keys(hasher, st, ctx, k)
        st.hashes.extend(keys)
    parent = st.hashes[k - 1] if k else (st.root,)
    tail = np.asarray(ctx.tokens.all[k * ps : at], dtype=np.int32)
    pages = [int(st.tables[g].pages[k]) for g in token_groups] if len(tail) else []
    if st.cut == at:
        st.cut = -1
    if in_place:
        return states.save_in_place(live, parent, tail, pages)
    return states.save(live, parent, tail, pages, shared=shared)


def save_due(
    states: StateCheckpoints, hasher: PrefixHasher, st: HybridRequest, ctx: TextContext, token_groups: Sequence[int],
    state_group: int,
) -> None:  # fmt: skip
    """After a step that left the request's live state at ``st.state_at``: save it when a checkpoint is due there
    (`save_state`): the divergence cut ``st.cut`` (shared), the prompt-end position ``st.end`` (before the
    prompt's last token), or, when a driver ended no chunk at ``st.end``, the prompt's end. A prompt-end
    checkpoint joins ``st.superseded``. A cut the step went past without stopping is dropped."""
    at, end = st.state_at, st.end
    if at == st.cut or at == end or (end > 0 and at == ctx.tokens.prompt_length):
        shared = at == st.cut
        st.end = end if at < end else -1
        saved = save_state(states, hasher, st, ctx, at, token_groups, state_group, in_place=False, shared=shared)
        if saved is not None and not shared:
            st.superseded.append(saved)
    elif 0 < st.cut < at:
        st.cut = -1


def release_rows(
    states: StateCheckpoints, hasher: PrefixHasher, st: HybridRequest, request_id: Hashable,
    token_groups: Sequence[int], state_group: int, caching: bool,
) -> None:  # fmt: skip
    """Give a released request's state rows back: its pending restore is dropped and, with `caching`,
    when its last alloc was followed by a step (its live state is at ``st.state_at``), its live row
    becomes a checkpoint first, superseding its prompt-end checkpoint and the one it resumed from
    (`StateCheckpoints.demote`)."""
    states.drop(request_id)
    table = st.tables[state_group]
    rows = table.pages[: table.num_pages].tolist()
    if rows and caching and st.state_at > 0 and st.ctx is not None and not st.dummy:
        saved = save_state(states, hasher, st, st.ctx, st.state_at, token_groups, state_group, in_place=True)
        for entry in st.superseded:
            if saved is None or entry.key != saved.key:
                states.demote(entry)
    states.free(rows)


def release_request(
    states: StateCheckpoints | None, hasher: PrefixHasher, pool: BlockPool, groups: Sequence[GroupManager],
    st: HybridRequest, request_id: Hashable, caching: bool, tokens: Sequence[int], state: int,
) -> None:  # fmt: skip
    """Free a released request's pages in every group (tail first, `release_order`) and its state rows
    (`release_rows`: its last state may become a checkpoint; `tokens`: the token groups, `state`: the first
    state group). A checkpoint in a run is saved once the request's private pages are free, the pages it
    resumes over held meanwhile (`held_for_release`), so taking a run never evicts them; a checkpoint in
    rows is kept before any page is freed."""
    late = states is not None and states.run_pages > 0
    keep = held_for_release(st, tokens, hasher.page_size, pool.null_block) if late and caching else []
    pool.hold(keep)
    if states is not None and not late:
        release_rows(states, hasher, st, request_id, tokens, state, caching)
    pool.unpin(st.pinned)
    pages, held = release_order(groups, pool, st)
    pool.release(pages, held)
    if states is not None and late:
        release_rows(states, hasher, st, request_id, tokens, state, caching)
        kept = set(keep)
        pool.free([p for p in pages if p in kept])  # (in release order: deepest evicted first)


def restart_holders(reqs: dict[Any, HybridRequest], pages: set[int], rows: set[int], coordinator: Any) -> list[Any]:
    """After tier loads whose device copy failed (into `pages`, already out of the prefix cache, or checkpoint
    images into live state `rows`): every request of `reqs` (a `KVCacheCoordinator`'s) that holds one of them in
    a token group, or resumes in one of those rows, gives back all it holds (`release_request`; its live state
    is not what it claims, so no checkpoint is kept of it) and stays claimed, holding nothing, its context (the
    one its last alloc served) back at the first token: table and context are consistent at once, and its
    next `alloc` looks its prefix up again (device, tiers) as at admission. Returns the requests restarted."""
    c = coordinator
    state_groups = [g.group for g in c.groups if g.state_slots]
    restarted = []
    for rid, st in list(reqs.items()):
        held = [t.pages[: t.num_pages].tolist() for t in st.tables]
        if not any(rows.intersection(held[g][:1]) if g in state_groups else pages.intersection(held[g])
                   for g in range(len(held))):  # fmt: skip
            continue
        st.state_at = -1
        release_request(c.states, c.hasher, c.pool, c.groups, st, rid, c.enable_prefix_caching, c.tier_groups.decoder,
                        c.tier_groups.state)  # fmt: skip
        reqs[rid] = HybridRequest([RequestPages() for _ in c.groups], [g.kept_pages() for g in c.groups],
                                  dummy=st.dummy, context=st.context)  # fmt: skip
        if st.context is not None:
            st.context.tokens.rewind_processing(st.context.tokens.processed_length)
            st.context.cached_prefix_length = 0
        restarted.append(rid)
    return restarted


def held_for_release(st: HybridRequest, token_groups: Sequence[int], page_size: int, null: int) -> list[int]:
    """The pages of `token_groups` a checkpoint saved at the request's release resumes over (up to the page
    holding its state position ``st.state_at``), held while its run is taken: taking a run then finds the
    request's private pages freed, never these. Empty when no checkpoint is due (see `release_rows`)."""
    if st.state_at <= 0 or st.ctx is None or st.dummy:
        return []
    k = st.state_at // page_size + 1
    tables = [st.tables[g] for g in token_groups]
    return [int(p) for t in tables for p in t.pages[: min(k, t.num_pages)].tolist() if p != null]


def keeps(plan: Plan) -> tuple[Checkpoint | None, set[int]]:
    """What a reclaim for `plan` must not count on: its checkpoint, its hit pages (its checkpoint's run too)
    and the pages it pins."""
    run = plan.checkpoint.run if plan.checkpoint is not None else ()
    return plan.checkpoint, {p for pages in plan.hit_pages for p in pages} | set(plan.pins) | set(run)


def plan_fits(states: StateCheckpoints | None, plan: Plan, short: int) -> str | None:
    """How `plan`'s checkpoint hit can be had: "hold" (its row held, the state copied into new rows),
    "adopt" (rows are short but its row is free: that row becomes the request's live row), or None (its
    `short` missing attention pages cannot be reclaimed from checkpoint tails, or no row is left). No side
    effects."""
    assert states is not None and plan.checkpoint is not None
    if short > 0 and states.reclaimable(*keeps(plan)) < short:
        return None
    if plan.rows <= states.num_available(plan.checkpoint):
        return "hold"
    return "adopt" if states.can_adopt(plan.checkpoint) and plan.rows <= states.num_available() else None


def wanted_run(
    states: StateCheckpoints, hasher: PrefixHasher, ctx: TextContext, keys: list[BlockHash]
) -> list[BlockHash]:
    """The run keys of the deepest checkpoint a waiting context would resume from over its prefix `keys` (its
    pages' keys; queue-aware retention keeps them with the pages), or none. No side effects."""
    ps, tokens = states.page_size, ctx.tokens.all
    last = len(tokens) - 1
    root = hasher.root(ctx.cache_salt)
    for h in range(len(keys), -1, -1):
        hit = states.find(keys[h - 1] if h else (root,), tokens, h * ps, min(h * ps + ps - 1, last))
        if hit is not None and hit.run:
            return [run_key(hit.key, i) for i in range(len(hit.run))]
    return []
