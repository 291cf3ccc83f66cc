from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedkv.engine import LLMEngine
from pagedkv.testing import build_demo_model

HOST = dict(kv_connector="local", host_kvcache_swap_space_gb=0.01, total_num_host_pages=64)


def prompts(n=24):
    rng = np.random.default_rng(1)
    sys = rng.integers(3, 500, size=24).tolist()
    return [sys + rng.integers(3, 500, size=int(rng.integers(5, 40))).tolist() for _ in range(n)]


@pytest.mark.parametrize("policy", ["lru", "slru", "lfu", "arc"])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_no_wants_left_after_long_run(policy, mode):
    torch.set_num_threads(1)
    kw = dict(HOST) if mode == "swap" else {}
    engine = LLMEngine.from_hf(
        build_demo_model(),
        page_size=8,
        num_pages=24,
        max_num_batched_tokens=64,
        max_batch_size=6,
        eviction_policy=policy,
        preemption_mode=mode,
        **kw,
    )
    for p in prompts():
        engine.add_request(p, 60)
    for i in range(10**6):
        if not engine.has_unfinished():
            break
        engine.step()
        if i == 15:
            engine.update_weights(None, "v2")
    bm = engine.manager._managers[0]
    engine.manager.check_integrity()
    assert engine.summary["preemptions"] > 0
    assert bm.wants.entries == {}
    assert bm.pool.num_wanted == 0
