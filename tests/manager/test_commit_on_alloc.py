"""`commit_on_alloc`: pages a step will fill are hittable from `alloc`; unwritten ones are announced only
at `step`, and forgotten if the request is released before its step."""

from __future__ import annotations

import numpy as np
import pytest

from helpers import make_params
from pagedkv.core.context import TextContext
from pagedkv.dtype import DeviceRef
from pagedkv.manager.paged import PagedKVCacheManager

PROMPT = np.arange(100, 114)  # 14 tokens: 3 full pages of 4 before the last token


def manager(commit_on_alloc: bool = True, **kwargs: object) -> PagedKVCacheManager:
    params = make_params(page_size=4, enable_prefix_caching=True, devices=[DeviceRef.CPU()],
                         commit_on_alloc=commit_on_alloc, **kwargs)  # fmt: skip
    return PagedKVCacheManager(params, None, 16, max_batch_size=4, enable_runtime_checks=True)


def admit(mgr: PagedKVCacheManager, rid: int, tokens: np.ndarray = PROMPT, chunk: int | None = None) -> TextContext:
    ctx = TextContext(rid, tokens)
    mgr.claim(rid)
    mgr.alloc(ctx, num_scheduled_tokens=chunk)
    if chunk is not None and chunk < ctx.tokens.active_length:
        ctx.tokens.chunk(chunk)
    return ctx


@pytest.mark.parametrize(("commit_on_alloc", "hit"), [(True, 12), (False, 0)])
def test_a_request_admitted_in_the_same_step_hits_pages_being_prefilled(commit_on_alloc: bool, hit: int) -> None:
    mgr = manager(commit_on_alloc)
    a, b = admit(mgr, 0), admit(mgr, 1)
    assert (a.cached_prefix_length, b.cached_prefix_length) == (0, hit)
    assert mgr.get_req_blocks(1)[:3] == (mgr.get_req_blocks(0)[:3] if hit else mgr.get_req_blocks(1)[:3])
    for c in (a, b):
        c.update(7)
    mgr.step([[a, b]])
    mgr.check_integrity()


def test_only_pages_of_the_scheduled_chunk_become_hittable() -> None:
    mgr = manager()
    admit(mgr, 0, chunk=5)  # this step writes tokens 0..4: one full page
    assert admit(mgr, 1).cached_prefix_length == 4
    mgr.check_integrity()


def test_release_before_step_forgets_unwritten_pages_and_never_announces_them() -> None:
    mgr = manager()
    events: list[object] = []
    mgr.add_kv_event_listener(lambda batch: events.extend(batch.events))
    admit(mgr, 0)
    mgr.release(0)  # preempted before its forward pass: its 3 registered pages hold nothing
    mgr.check_integrity()
    assert mgr._managers[0].pool.num_cached == 0
    assert admit(mgr, 1).cached_prefix_length == 0
    mgr.release(1)
    ctx = admit(mgr, 2)
    ctx.update(7)
    mgr.step([[ctx]])  # written now: announced once
    stored = [e for e in events if type(e).__name__ == "BlockStored"]
    assert sum(len(e.block_hashes) for e in stored) == 3
    assert not [e for e in events if type(e).__name__ == "BlockRemoved"]


def test_flag_is_validated() -> None:
    with pytest.raises(ValueError, match="commit_on_alloc=True requires enable_prefix_caching=True"):
        make_params(page_size=4, enable_prefix_caching=False, devices=[DeviceRef.CPU()], commit_on_alloc=True)
    with pytest.raises(TypeError, match="commit_on_alloc=1 must be a bool"):
        make_params(page_size=4, enable_prefix_caching=True, devices=[DeviceRef.CPU()], commit_on_alloc=1)
