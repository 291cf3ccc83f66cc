"""Per-attention-type page policies: which positions a group keeps, and what a prefix hit needs.

One base class (full attention: keep everything) and one small subclass per
type, differing only in three hooks. Positions are absolute token positions;
`first_needed(q)` is the earliest key position a query at position q (or any
later one) can still attend to, so every page entirely before it can return
to the pool (the table keeps the null page in its place)::

    sliding W   |..dropped..|....... last W tokens .......| q
    chunked C   |..dropped (earlier chunks)..| chunk of q  | q
    sink S + W  | S sinks |..dropped..|.... last W ........| q
"""

from __future__ import annotations

from pagedkv.specs import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    MLAAttentionSpec,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
)

__all__ = [
    "GroupManager", "FullAttentionManager", "SlidingWindowManager", "ChunkedLocalAttentionManager",
    "SinkAttentionManager", "CrossAttentionManager", "MLAAttentionManager", "SPEC_MANAGERS", "manager_for",
]  # fmt: skip


class GroupManager:
    """Full attention: every page stays while the request runs; hits are any cached prefix."""

    lazy = False  # window types allocate only up to the active window, not the whole prompt
    cacheable = True  # takes part in prefix caching
    reads_encoder = False  # pages hold the encoder's tokens, written once (cross-attention)

    def __init__(self, group: int, page_size: int) -> None:
        self.group = group
        self.page_size = page_size

    @classmethod
    def from_spec(cls, group: int, spec: AttentionSpec) -> GroupManager:
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

    def __repr__(self) -> str:
        return f"{type(self).__name__}(group={self.group})"


FullAttentionManager = GroupManager


class MLAAttentionManager(GroupManager):
    """MLA: full attention over one latent per token (only the page format differs)."""


class SlidingWindowManager(GroupManager):
    """A query at q sees keys (q - W, q]: pages wholly before q - W + 1 go back to the pool."""

    lazy = True

    def __init__(self, group: int, page_size: int, window: int) -> None:
        super().__init__(group, page_size)
        self.window = window

    @classmethod
    def from_spec(cls, group: int, spec: AttentionSpec) -> GroupManager:
        assert isinstance(spec, SlidingWindowSpec)
        return cls(group, spec.block_size, spec.sliding_window)

    def first_needed(self, query_position: int) -> int:
        return max(0, query_position - self.window + 1)

    def drop_threshold(self, dropped: int) -> int:
        return (dropped + 1) * self.page_size + self.window - 1

    def hit_range(self, hit_pages: int) -> tuple[int, int]:
        return self.first_needed(hit_pages * self.page_size) // self.page_size, hit_pages


class ChunkedLocalAttentionManager(GroupManager):
    """Llama 4 local attention: a query sees its own chunk; earlier chunks' pages go back to the pool."""

    lazy = True

    def __init__(self, group: int, page_size: int, chunk: int) -> None:
        super().__init__(group, page_size)
        self.chunk = chunk

    @classmethod
    def from_spec(cls, group: int, spec: AttentionSpec) -> GroupManager:
        assert isinstance(spec, ChunkedLocalAttentionSpec)
        return cls(group, spec.block_size, spec.attention_chunk_size)

    def first_needed(self, query_position: int) -> int:
        return query_position // self.chunk * self.chunk

    def drop_threshold(self, dropped: int) -> int:
        end = (dropped + 1) * self.page_size  # the page is droppable once a chunk starts at or after its end
        return -(-end // self.chunk) * self.chunk

    def hit_range(self, hit_pages: int) -> tuple[int, int]:
        return self.first_needed(hit_pages * self.page_size) // self.page_size, hit_pages


class SinkAttentionManager(SlidingWindowManager):
    """Sliding window that always keeps the first `sinks` tokens' pages (StreamingLLM)."""

    def __init__(self, group: int, page_size: int, window: int, sinks: int) -> None:
        super().__init__(group, page_size, window)
        self.sinks = sinks

    @classmethod
    def from_spec(cls, group: int, spec: AttentionSpec) -> GroupManager:
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


class CrossAttentionManager(GroupManager):
    """Cross-attention: the encoder's pages, allocated once per request, never prefix-cached."""

    cacheable = False
    reads_encoder = True


SPEC_MANAGERS: dict[type[AttentionSpec], type[GroupManager]] = {
    FullAttentionSpec: FullAttentionManager,
    MLAAttentionSpec: MLAAttentionManager,
    SlidingWindowSpec: SlidingWindowManager,
    ChunkedLocalAttentionSpec: ChunkedLocalAttentionManager,
    SinkFullAttentionSpec: SinkAttentionManager,
    CrossAttentionSpec: CrossAttentionManager,
}
"""The page-policy manager of each spec type (a spec subclass takes its nearest listed base's, as
`SlidingWindowMLASpec` takes `SlidingWindowSpec`'s), as vLLM's `spec_manager_map`."""


def manager_for(group: int, spec: AttentionSpec) -> GroupManager:
    """The manager of group `group`, whose layers have `spec`; TypeError for a spec no manager serves."""
    for cls in type(spec).__mro__:
        manager = SPEC_MANAGERS.get(cls)
        if manager is not None:
            return manager.from_spec(group, spec)
    raise TypeError(f"no KV cache manager serves {type(spec).__name__}")
