"""Where a request with recurrent state resumes, and how its state becomes a checkpoint (pure Python + numpy).

`KVCacheCoordinator` calls these for models with state groups: `find_state_hit` at admission (the
longest prefix with attention pages cached and a state checkpoint exactly at its end) and
`save_state` when a checkpoint is due (a prompt's end, a divergence cut, a release after a completed
step). The checkpoints themselves live in `checkpoints.StateCheckpoints`.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np

from pagedkv.core.block_pool import BlockPool
from pagedkv.core.checkpoints import Checkpoint, StateCheckpoints
from pagedkv.core.context import TextContext
from pagedkv.core.hashing import BlockHash, PrefixHasher
from pagedkv.core.hybrid_state import HybridRequest, Plan, find_hit
from pagedkv.core.managers import GroupManager
from pagedkv.core.tables import more_keys

__all__ = ["find_state_hit", "keeps", "plan_fits", "release_rows", "save_state"]


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


def keeps(plan: Plan) -> tuple[Checkpoint | None, set[int]]:
    """What a reclaim for `plan` must not count on: its checkpoint, its hit pages and the pages it pins."""
    return plan.checkpoint, {p for pages in plan.hit_pages for p in pages} | set(plan.pins)


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
    free = states.rows.ref_count(plan.checkpoint.row) == 0
    return "adopt" if free and plan.rows <= states.num_available() else None
