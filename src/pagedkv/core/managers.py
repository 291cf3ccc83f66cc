"""Per-attention-type page policies: which positions a group keeps, and what a prefix hit needs.

One base class (full attention: keep everything) and one small subclass per
type, differing only in three hooks. Positions are absolute token positions;
`first_needed(q)` is the earliest key position a query at position q (or any
later one) can still attend to, so every page entirely before it can return
to the pool (the table keeps the null page in its place)::

    sliding W   |..dropped..|....... last W tokens .......| q
    chunked C   |..dropped (earlier chunks)..| chunk of q  | q
    sink S + W  | S sinks |..dropped..|.... last W ........| q

`step_pages` is what one step holds in a group, and `min_request_pages` the
smallest pool in which a request alone can run to its end.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from pagedkv.specs import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
)

__all__ = [
    "GroupManager", "FullAttentionManager", "SlidingWindowManager", "ChunkedLocalAttentionManager",
    "SinkAttentionManager", "CrossAttentionManager", "MLAAttentionManager", "MambaManager", "SPEC_MANAGERS",
    "manager_for",
    "min_request_pages",
]  # fmt: skip


class GroupManager:
    """Full attention: every page stays while the request runs; hits are any cached prefix."""

    lazy = False  # window types allocate only up to the active window, not the whole prompt
    cacheable = True  # takes part in prefix caching
    reads_encoder = False  # pages hold the encoder's tokens, written once (cross-attention)
    state_slots = 0  # > 0: pages hold recurrent states, this many per request whatever its length (`MambaManager`)
    kind = "full_attention"  # vLLM's `KVCacheSpecKind` of the group (KV events carry it)

    def __init__(self, group: int, page_size: int) -> None:
        self.group = group
        self.page_size = page_size

    @classmethod
    def from_spec(cls, group: int, spec: KVCacheSpec) -> GroupManager:
        """The manager of group `group`, whose layers all have `spec` (`spec.block_size` is the page size)."""
        return cls(group, spec.block_size)

    def first_needed(self, query_position: int) -> int:
        """Earliest key position a query at `query_position` or later attends to."""
        return 0

    def kept_pages(self) -> int:
        """Leading pages never dropped (attention sinks)."""
        return 0

    def droppable_pages(self, query_position: int) -> int:
        """Leading pages no query from `query_position` on reads (kept pages excluded from the drop)."""
        return self.first_needed(query_position) // self.page_size

    def drop_threshold(self, dropped: int) -> int:
        """Smallest query position at which page `dropped` (the next one) becomes droppable."""
        return 1 << 62

    def hit_range(self, hit_pages: int) -> tuple[int, int]:
        """Pages [start, hit_pages) that must be cached for a prefix hit of `hit_pages` pages
        (the kept sink pages as well, see `kept_pages`)."""
        return 0, hit_pages

    def step_pages(self, start: int, end: int, length: int, spec: int = 0, encoder_length: int = 0) -> int:
        """Pages this group holds during a step that processes positions [start, end) of a context of
        `length` tokens with `spec` speculative slots, once the step's drops are done (drops happen at
        `start`; the pages of [first_needed(start), end + spec) stay). A full group holds every
        token's page (`length`, not `end`: the whole context is allocated at once); a window group
        only the window of this step; cross-attention the encoder's `encoder_length` tokens."""
        top = end if self.lazy else length
        return -(-(top + spec) // self.page_size) - (self.droppable_pages(start) - self.kept_pages())

    def periodicity(self) -> tuple[int, int]:
        """(warmup, period): ``step_pages(q, q + 1, ...)`` for q >= warmup repeats every `period` positions."""
        return 0, 1

    def __repr__(self) -> str:
        return f"{type(self).__name__}(group={self.group})"


FullAttentionManager = GroupManager


class MLAAttentionManager(GroupManager):
    """MLA: full attention over one latent per token (only the page format differs)."""

    kind = "mla_attention"


class SlidingWindowManager(GroupManager):
    """A query at q sees keys (q - W, q]: pages wholly before q - W + 1 go back to the pool."""

    lazy = True
    kind = "sliding_window"

    def __init__(self, group: int, page_size: int, window: int) -> None:
        super().__init__(group, page_size)
        self.window = window

    @classmethod
    def from_spec(cls, group: int, spec: KVCacheSpec) -> GroupManager:
        assert isinstance(spec, SlidingWindowSpec)
        return cls(group, spec.block_size, spec.sliding_window)

    def first_needed(self, query_position: int) -> int:
        return max(0, query_position - self.window + 1)

    def drop_threshold(self, dropped: int) -> int:
        return (dropped + 1) * self.page_size + self.window - 1

    def hit_range(self, hit_pages: int) -> tuple[int, int]:
        return self.first_needed(hit_pages * self.page_size) // self.page_size, hit_pages

    def periodicity(self) -> tuple[int, int]:
        return self.window - 1, self.page_size


class ChunkedLocalAttentionManager(GroupManager):
    """Llama 4 local attention: a query sees its own chunk; earlier chunks' pages go back to the pool."""

    lazy = True
    kind = "chunked_local_attention"

    def __init__(self, group: int, page_size: int, chunk: int) -> None:
        super().__init__(group, page_size)
        self.chunk = chunk

    @classmethod
    def from_spec(cls, group: int, spec: KVCacheSpec) -> GroupManager:
        assert isinstance(spec, ChunkedLocalAttentionSpec)
        return cls(group, spec.block_size, spec.attention_chunk_size)

    def first_needed(self, query_position: int) -> int:
        return query_position // self.chunk * self.chunk

    def drop_threshold(self, dropped: int) -> int:
        end = (dropped + 1) * self.page_size  # the page is droppable once a chunk starts at or after its end
        return -(-end // self.chunk) * self.chunk

    def hit_range(self, hit_pages: int) -> tuple[int, int]:
        return self.first_needed(hit_pages * self.page_size) // self.page_size, hit_pages

    def periodicity(self) -> tuple[int, int]:
        return 0, math.lcm(self.chunk, self.page_size)


class SinkAttentionManager(SlidingWindowManager):
    """Sliding window that always keeps the first `sinks` tokens' pages (StreamingLLM)."""

    kind = "sink_full_attention"

    def __init__(self, group: int, page_size: int, window: int, sinks: int) -> None:
        super().__init__(group, page_size, window)
        self.sinks = sinks

    @classmethod
    def from_spec(cls, group: int, spec: KVCacheSpec) -> GroupManager:
        assert isinstance(spec, SinkFullAttentionSpec)
        if spec.sliding_window is None:  # sinks without a window: every token is kept anyway
            return FullAttentionManager(group, spec.block_size)
        return cls(group, spec.block_size, spec.sliding_window, spec.sink_len)

    def kept_pages(self) -> int:
        return -(-self.sinks // self.page_size)

    def droppable_pages(self, query_position: int) -> int:
        return max(self.kept_pages(), super().droppable_pages(query_position))

    def drop_threshold(self, dropped: int) -> int:
        return super().drop_threshold(max(dropped, self.kept_pages()))

    def hit_range(self, hit_pages: int) -> tuple[int, int]:
        start, stop = super().hit_range(hit_pages)
        return max(start, min(self.kept_pages(), stop)), stop

    def periodicity(self) -> tuple[int, int]:
        return self.window - 1 + self.kept_pages() * self.page_size, self.page_size


class CrossAttentionManager(GroupManager):
    """Cross-attention: the encoder's pages, allocated once per request, never prefix-cached."""

    cacheable = False
    reads_encoder = True
    kind = "cross_attention"

    def step_pages(self, start: int, end: int, length: int, spec: int = 0, encoder_length: int = 0) -> int:
        return -(-encoder_length // self.page_size)


class MambaManager(GroupManager):
    """Recurrent state (Mamba, gated delta net, short conv): a request holds `state_slots` rows of the
    state pool (its live state and its draft slots, `checkpoints.StateCheckpoints`) from its first
    `alloc` to its release, whatever its length. A row is one state, updated in place each step, so the
    group takes no attention page, its table never grows or drops, and prefix hits come from state
    checkpoints, not from its pages."""

    cacheable = False
    kind = "mamba"

    def __init__(self, group: int, page_size: int, slots: int = 1) -> None:
        super().__init__(group, page_size)
        self.state_slots = slots

    @classmethod
    def from_spec(cls, group: int, spec: KVCacheSpec) -> GroupManager:
        assert isinstance(spec, MambaSpec)
        return cls(group, spec.block_size, spec.slots_per_request)

    def step_pages(self, start: int, end: int, length: int, spec: int = 0, encoder_length: int = 0) -> int:
        return 0  # (its rows come from the state pool)


SPEC_MANAGERS: dict[type[KVCacheSpec], type[GroupManager]] = {
    FullAttentionSpec: FullAttentionManager,
    MLAAttentionSpec: MLAAttentionManager,
    SlidingWindowSpec: SlidingWindowManager,
    ChunkedLocalAttentionSpec: ChunkedLocalAttentionManager,
    SinkFullAttentionSpec: SinkAttentionManager,
    CrossAttentionSpec: CrossAttentionManager,
    MambaSpec: MambaManager,
}
"""The page-policy manager of each spec type (a spec subclass takes its nearest listed base's, as
`SlidingWindowMLASpec` takes `SlidingWindowSpec`'s), as vLLM's `spec_manager_map`."""


def manager_for(group: int, spec: KVCacheSpec) -> GroupManager:
    """The manager of group `group`, whose layers have `spec`; TypeError for a spec no manager serves."""
    for cls in type(spec).__mro__:
        manager = SPEC_MANAGERS.get(cls)
        if manager is not None:
            return manager.from_spec(group, spec)
    raise TypeError(f"no KV cache manager serves {type(spec).__name__}")


def min_request_pages(
    groups: Sequence[GroupManager], prompt_length: int, max_new_tokens: int, *, spec: int = 0, encoder_length: int = 0
) -> int:
    """The fewest pool pages in which a request of `prompt_length` tokens generating `max_new_tokens`
    runs alone to its end: no smaller pool can serve it, and this one does (one token a step at
    worst, the scheduler's smallest chunk).

    Its context grows to length = prompt_length + max_new_tokens - 1 (the last sampled token is never
    fed back). At each position q in [0, length) it runs a one-token step, during which each group
    holds `step_pages(q, q + 1, n)`, n = max(prompt_length, q + 1) the context's length then: full
    groups ceil((n + spec) / page_size) (the prompt is allocated at once); window groups the pages
    from the first one the query at q still reads (the sinks' pages too) through q's page and its
    `spec` draft slots (drops happen before the step's new pages are taken); cross-attention
    ceil(encoder_length / page_size). The answer is the peak over q of the groups' sum, and at
    least ceil((length + spec) / page_size): the coordinator refuses a context whose slots exceed
    the whole pool, windows or not.

    A request preempted by recompute comes back with its whole context as prompt and may need more
    (`min_request_pages(groups, length, 1, ...)`). Past every group's warmup the window counts
    repeat with the lcm of the periods while full counts only grow, so at most warmup + lcm
    positions are visited, whatever the length.
    """
    if prompt_length < 1 or max_new_tokens < 1:
        raise ValueError(f"prompt_length={prompt_length} and max_new_tokens={max_new_tokens} must be >= 1")
    length = prompt_length + max_new_tokens - 1
    warmup = max((g.periodicity()[0] for g in groups), default=0)
    period = math.lcm(*(g.periodicity()[1] for g in groups)) if groups else 1
    # window counts at q >= warmup depend on q mod period, full counts grow with q: [0, warmup) and
    # the last period (or all of [warmup, length)) hold the peak
    positions = (*range(min(length, warmup)), *range(max(warmup, length - period), length))
    tokens = [g for g in groups if not g.state_slots and not g.reads_encoder]
    best = -(-(length + spec) // groups[0].page_size) if tokens else 0  # the coordinator's cap: every slot fits
    for q in positions:
        n = max(prompt_length, q + 1)
        best = max(best, sum(g.step_pages(q, q + 1, n, spec, encoder_length) for g in groups))
    return best
