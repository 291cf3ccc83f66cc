"""ec9d19a: commit_on_alloc on by default. A driver that allocs, then chunks (MAX's order: the hit length is
known only after alloc), without passing num_scheduled_tokens, makes pages hittable that this step does not
write
a request admitted after it in the same step reads them."""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv import DeviceRef, DType, KVCacheParams, PagedKVCacheManager, TextContext
from pagedkv.testing import PrefixStampModel

PROMPT = np.arange(100, 118)  # 18 tokens: 4 full pages of 4 before the last token


@pytest.mark.parametrize("commit_on_alloc", [None, False])
def test_alloc_then_chunk_default_reads_unwritten_kv(commit_on_alloc):
    params = KVCacheParams(
        dtype=DType.float32,
        n_kv_heads=1,
        head_dim=1,
        num_layers=1,
        devices=[DeviceRef.CPU()],
        page_size=4,
        enable_prefix_caching=True,
        commit_on_alloc=commit_on_alloc,
    )
    mgr = PagedKVCacheManager(params, None, 16, max_batch_size=4)
    model = PrefixStampModel(mgr)
    a, b = TextContext("a", PROMPT), TextContext("b", PROMPT)
    mgr.claim("a")
    mgr.alloc(a)
    a.tokens.chunk(4)  # the budget lets a run 4 tokens this step (chunk after alloc, as MAX's scheduler)
    mgr.claim("b")
    mgr.alloc(b)
    b.tokens.chunk(4) if b.tokens.active_length > 4 else None
    model.forward([[a, b]])  # AssertionError: b reads pages a has not written
    for c in (a, b):
        c.update(0)
    mgr.step([[a, b]])
    mgr.check_integrity()
