"""Retention through the manager: a request's retention priority and SGLang-style pinned prefixes."""

from __future__ import annotations

import numpy as np
import pytest

from helpers import make_params
from pagedkv.core.context import Retention, TextContext
from pagedkv.dtype import DeviceRef
from pagedkv.manager.paged import PagedKVCacheManager
from pagedkv.params.multi import KVCacheParamInterface, MultiKVCacheParams


def manager(num_pages: int, window: int | None = None, **kwargs: object) -> PagedKVCacheManager:
    params: KVCacheParamInterface = make_params(page_size=4, enable_prefix_caching=True, devices=[DeviceRef.CPU()],
                                                **kwargs)  # fmt: skip
    if window is not None:  # a hybrid: a full-attention group and a sliding-window group over one pool
        windowed = make_params(page_size=4, enable_prefix_caching=True, devices=[DeviceRef.CPU()],
                               sliding_window=window, **kwargs)  # fmt: skip
        params = MultiKVCacheParams({"full": params, "window": windowed})
    return PagedKVCacheManager(params, None, num_pages, max_batch_size=4, enable_runtime_checks=True)


def serve(mgr: PagedKVCacheManager, rid: int, tokens: list[int], retention: Retention | None = None) -> int:
    """Prefill `tokens` (one step, then release); returns the cached prefix length it found."""
    ctx = TextContext(rid, np.array(tokens))
    ctx.retention = retention
    mgr.claim(rid)
    mgr.alloc(ctx)
    ctx.update(0)
    mgr.step([[ctx]])
    mgr.release(rid)
    mgr.check_integrity()
    return ctx.cached_prefix_length


def test_request_retention_keeps_its_prefix_under_pressure() -> None:
    keep, other = list(range(100, 113)), list(range(200, 213))  # 3 full pages each
    for retention, expected in ((None, 4), (Retention(90), 12)):
        mgr = manager(8)
        serve(mgr, 0, keep, retention)
        serve(mgr, 1, other)  # fills the pool: evicts the oldest three cached pages unless retained
        serve(mgr, 2, list(range(300, 313)))
        assert serve(mgr, 3, keep) == expected


def test_pin_prefix_protects_and_unpins() -> None:
    system = list(range(100, 113))
    mgr = manager(8)
    serve(mgr, 0, system)
    assert mgr.pin_prefix(system + [1, 2, 3]) == 3  # the 3 cached pages of the page-aligned prefix
    assert mgr.pin_prefix(list(range(500, 520))) == 0  # nothing cached: nothing pinned
    serve(mgr, 1, list(range(200, 213)))
    serve(mgr, 2, list(range(300, 313)))
    assert serve(mgr, 3, system) == 12
    assert mgr.pin_prefix(system, 35) == 3  # priority 35 = the default: unpinned
    serve(mgr, 4, list(range(200, 213)))
    serve(mgr, 5, list(range(300, 313)))
    assert serve(mgr, 6, system) == 4  # as with no pin: two pages of it were evicted
    with pytest.raises(ValueError, match=r"priority=101"):
        mgr.pin_prefix(system, 101)


@pytest.mark.parametrize("window", [None, 4, 8])
def test_pin_prefix_keeps_a_prefix_in_every_group(window: int | None) -> None:
    """Pinned pages are evicted after every other page: a pool just large enough for the pinned prefix and one
    other request keeps the whole prefix, in one group or in both groups of a hybrid model."""
    system, others = list(range(100, 125)), [list(range(200 + 100 * k, 225 + 100 * k)) for k in range(3)]
    groups = 1 if window is None else 2

    def run(pin: bool) -> tuple[int, int]:
        mgr = manager(13 * groups, window)  # 6 cached pages of the prefix + 7 for a 25-token request, per group
        serve(mgr, 0, system)
        found = mgr.pin_prefix(system + [1, 2], 100) if pin else 0
        for k, tokens in enumerate(others):  # each takes 7 pages per group: unpinned cached pages go first
            serve(mgr, k + 1, tokens)
        return found, serve(mgr, 9, system)

    assert run(True) == (6, 24)  # 6 full pages of the page-aligned prefix; all 24 tokens hit afterwards
    assert run(False) == (0, 0)  # the default order evicted the oldest prefix
