"""Prefix hits from the tiers below the device for a `KVCacheCoordinator` (pure Python + numpy).

At a request's first allocation, after the device prefix cache (and, for a
model with recurrent state, the device's state checkpoints) gave their hit,
`tier_hit` asks the tiers (`TierLink`: host rows, disk, Redis) how much
further they reach:

- attention pages: the leading pages after the device hit that the tiers
  hold for every cacheable group (each group's page stored under its own key);
- for a model with recurrent state, a *state checkpoint* exactly at the
  resume point: the attention part of a hit is worth nothing without the
  state there. Candidates are every position of the last `RECENT_PAGES`
  pages the tiers reach (a conversation's turn ends anywhere in a page) and
  every page boundary before them (divergence points), probed in one batch.

Then it stages the loads into the pages and the live state row that `alloc`
already gave the request (no capacity is needed beyond what the miss would
take), attention pages first: a checkpoint is staged only after every page
before it was, the deepest held one that loads (a refused image falls back
to the next), so a failed load leaves the live state alone and the request
computes from the device hit. The coordinator commits the loaded pages as
hits. Data moves on the tensor side before the forward (`Tiering`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol

import numpy as np

from pagedkv.core.context import TextContext
from pagedkv.core.hashing import BlockHash, PrefixHasher
from pagedkv.core.hybrid_state import HybridRequest
from pagedkv.core.state.checkpoints import checkpoint_key
from pagedkv.core.tables import more_keys

__all__ = ["RECENT_PAGES", "TierGroups", "TierLink", "tier_hit"]

RECENT_PAGES = 8  # pages before the tiers' reach whose every position is a checkpoint candidate


class TierLink(Protocol):
    """The tiers of one replica as the coordinator sees them (implemented on the tensor side)."""

    def held_pages(self, keys: Sequence[BlockHash]) -> int:
        """How many leading `keys` the tiers hold a page for in every cacheable group. Moves no data."""

    def load_pages(self, tables: Sequence[Sequence[int]], keys: Sequence[BlockHash]) -> int:
        """Stage page ``keys[i]`` of each cacheable group into ``tables[j][i]`` (device pages, one list per
        group); returns how many leading indices every group got (those pages will hold their KV)."""

    def held_checkpoints(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether the tiers hold each state checkpoint (by checkpoint key). Moves no data."""

    def load_checkpoint(self, key: bytes, row: int, tail_pages: Sequence[int], parent: BlockHash | None) -> bool:
        """Stage checkpoint `key` into state row `row` and its tail slots into `tail_pages` (one per token
        group; empty for a page-aligned checkpoint); False when it could not be read (nothing staged)."""


class TierGroups(NamedTuple):
    """The coordinator's group indices a tier hit touches."""

    cacheable: list[int]  # groups whose pages are cached by hash (loaded page by page)
    decoder: list[int]  # token groups (a checkpoint's tail pages)
    state: int  # the first state group (its table's first entry is the live row); -1: no state


class TierHit(NamedTuple):
    """Where the request resumes after a tier hit: `pages` leading pages loaded, `tokens` processed."""

    pages: int
    tokens: int
    reach: int  # leading pages the tiers (or the device) hold: a divergence point for the next checkpoint


def tier_hit(
    link: TierLink, hasher: PrefixHasher, st: HybridRequest, ctx: TextContext, groups: TierGroups, stateful: bool,
) -> TierHit:  # fmt: skip
    """Stage the longest hit the tiers add after the device's (``st.committed`` pages, the context's processed
    tokens) and return it; the device's own when they add nothing or a load failed (then only harmless copies
    are staged: into pages and rows the request computes anyway). Extends ``st.hashes``; commits nothing."""
    ps, tokens = hasher.page_size, ctx.tokens
    start, first = tokens.processed_length, st.committed
    last = min(len(tokens), tokens.current_position) - 1  # the last token is always computed (its logits)
    stop = last // ps
    if stop > len(st.hashes):
        keys, st.digest = more_keys(hasher, st, ctx, stop)
        st.hashes.extend(keys)
    keys = st.hashes
    reach = first + (link.held_pages(keys[first:stop]) if stop > first else 0)
    none = TierHit(first, start, reach)
    if not stateful:  # attention pages alone: every page loaded is a hit
        got = link.load_pages(_tables(st, groups, first, reach), keys[first:reach]) if reach > first else 0
        return TierHit(first + got, (first + got) * ps, reach) if got else none
    held = _held_checkpoints(link, hasher.root(ctx.cache_salt), keys, tokens.all, ps, first, reach, start, last)
    if not held:
        return none
    deepest = max(h for h, _, _ in held)
    got = link.load_pages(_tables(st, groups, first, deepest), keys[first:deepest]) if deepest > first else 0
    row = int(st.tables[groups.state].pages[0])
    for hit, position, key in held:  # the deepest that loads (a refused image falls back to the next one)
        if hit > first + got:
            continue
        tails = [int(st.tables[g].pages[hit]) for g in groups.decoder] if position > hit * ps else []
        if link.load_checkpoint(key, row, tails, keys[hit - 1] if hit else None):
            return TierHit(hit, position, reach)
    return none


def _tables(st: HybridRequest, groups: TierGroups, first: int, stop: int) -> list[list[int]]:
    return [st.tables[g].pages[first:stop].tolist() for g in groups.cacheable]


def _held_checkpoints(
    link: TierLink, root: bytes, keys: Sequence[BlockHash], tokens: np.ndarray, ps: int, first: int, reach: int,
    start: int, last: int,
) -> list[tuple[int, int, bytes]]:  # fmt: skip
    """(page boundary h, position, key) of every checkpoint the tiers hold past `start` with attention pages up
    to h available (device before `first`, tiers up to `reach`), resuming at most at `last`; deepest first."""
    candidates: list[tuple[int, int, bytes]] = []
    for h in range(reach, first - 1, -1):
        parent = keys[h - 1] if h else (root,)
        tails = range(min(ps - 1, last - h * ps), -1, -1) if h > reach - RECENT_PAGES else (0,)
        for m in tails:
            position = h * ps + m
            if start < position <= last:
                candidates.append((h, position, checkpoint_key(parent, tokens[h * ps : position])))
    if not candidates:
        return []
    held = link.held_checkpoints([key for _, _, key in candidates])
    return [c for c, there in zip(candidates, held, strict=True) if there]
