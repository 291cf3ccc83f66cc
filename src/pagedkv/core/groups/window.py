"""Groups whose queries read a window of the past: sliding window, chunked local, sinks.

They take pages up to the active window only, and the pages no later query reads return to the pool as
processing moves on (the table keeps the null page in their place)::

    sliding W   |..dropped..|....... last W tokens .......| q
    chunked C   |..dropped (earlier chunks)..| chunk of q  | q
    sink S + W  | S sinks |..dropped..|.... last W ........| q
"""

from __future__ import annotations

import math

from pagedkv.core.groups.base import GroupManager, StepSpan
from pagedkv.core.groups.full import FullAttentionManager
from pagedkv.specs import ChunkedLocalAttentionSpec, KVCacheSpec, SinkFullAttentionSpec, SlidingWindowSpec

__all__ = ["WindowManager", "SlidingWindowManager", "ChunkedLocalAttentionManager", "SinkAttentionManager"]


class WindowManager(GroupManager):
    """What every window type shares: pages for the positions a step computes, drops behind the window."""

    lazy = True

    def pages_to_add(self, have: int, span: StepSpan) -> int:
        return max(0, -(-(span.end + span.spec) // self.page_size) - have)

    def drop_range(self, dropped: int, floor: int, processed: int, have: int) -> tuple[int, int]:
        keep = max(dropped, floor)  # shared pages (a hit, a merged commit) stay
        return keep, max(keep, min(self.droppable_pages(processed), have))

    def hit_range(self, hit_pages: int) -> tuple[int, int]:
        return self.first_needed(hit_pages * self.page_size) // self.page_size, hit_pages


class SlidingWindowManager(WindowManager):
    """A query at q sees keys (q - W, q]: pages wholly before q - W + 1 go back to the pool."""

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

    def periodicity(self) -> tuple[int, int]:
        return self.window - 1, self.page_size


class ChunkedLocalAttentionManager(WindowManager):
    """Llama 4 local attention: a query sees its own chunk; earlier chunks' pages go back to the pool."""

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
