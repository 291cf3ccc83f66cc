"""TierIndex: exact slots, LRU eviction, pins, and entries removed while pinned."""

from __future__ import annotations

import pytest

from pagedkv.core.errors import IntegrityError
from pagedkv.offload.tier_index import TierIndex


def test_slots_in_order_then_lru_eviction() -> None:
    index = TierIndex(3)
    assert [index.insert(k) for k in (b"a", b"b", b"c")] == [(0, None), (1, None), (2, None)]
    index.touch(b"a")  # LRU order now b, c, a
    assert index.insert(b"d") == (1, b"b") and index.evictions == 1
    assert index.get(b"b") is None and index.get(b"d") == 1 and len(index) == 3
    index.check_integrity()


def test_pinned_slots_are_never_evicted() -> None:
    index = TierIndex(2)
    index.insert(b"a")
    index.insert(b"b")
    index.pin([0, 1])
    assert index.insert(b"c") is None and len(index) == 2  # nothing changed
    index.unpin([0])
    assert index.insert(b"c") == (0, b"a")
    index.check_integrity()


def test_removed_while_pinned_frees_at_last_unpin() -> None:
    index = TierIndex(2)
    index.insert(b"a")
    index.pin([0])
    index.pin([0])  # two readers of slot 0
    assert index.clear() == [b"a"] and len(index) == 0
    index.check_integrity()
    assert index.insert(b"x") == (1, None)  # slot 0 is orphaned but still read: not reused
    assert index.insert(b"y") == (1, b"x")  # so the only candidate is x's slot
    index.unpin([0])
    assert index.insert(b"z") == (1, b"y")  # one reader left on slot 0
    index.unpin([0])
    assert index.insert(b"w") == (0, None)  # the last unpin freed it
    index.check_integrity()


def test_misuse_is_caught() -> None:
    index = TierIndex(2)
    index.insert(b"a")
    with pytest.raises(IntegrityError, match="key 61 is already in the tier"):
        index.insert(b"a")
    with pytest.raises(IntegrityError, match="slot 1 is not pinned"):
        index.unpin([1])
    with pytest.raises(ValueError, match="capacity=0 must be at least 1"):
        TierIndex(0)
