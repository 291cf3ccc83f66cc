"""Host tier: pages go down and come back bit-exact for every layout, LRU, and the manager's use of it."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from helpers import ctx, make_params, serve
from pagedkv.dtype import DeviceRef, DType
from pagedkv.manager.paged import PagedKVCacheManager
from pagedkv.params import KVCacheQuantizationConfig
from pagedkv.params.connector import KVConnectorConfig
from pagedkv.params.multi import MultiKVCacheParams
from pagedkv.runtime.buffers import ReplicatedKVCacheMemory
from pagedkv.testing import PrefixStampModel

CPU = DeviceRef.CPU()
LOCAL = dict(enable_prefix_caching=True, kv_connector="local", host_kvcache_swap_space_gb=1)
LAYOUTS = {
    "fp32": lambda: make_params(**LOCAL, n_kv_heads=2, head_dim=4, num_layers=2),
    "bf16": lambda: make_params(**LOCAL, dtype=DType.bfloat16, n_kv_heads=2, head_dim=4, num_layers=2),
    "fp8-scales": lambda: make_params(**LOCAL, dtype=DType.float8_e4m3fn, n_kv_heads=2, head_dim=8, num_layers=2,
                                      kvcache_quant_config=KVCacheQuantizationConfig(quantization_granularity=4)),
    "mha-tp2": lambda: make_params(**LOCAL, n_kv_heads=2, head_dim=4, num_layers=2, devices=[CPU, CPU]),
    "mla-tp2": lambda: make_params(**LOCAL, n_kv_heads=1, head_dim=6, num_layers=2, devices=[CPU, CPU], is_mla=True,
                                   num_q_heads=4),
    "tree": lambda: MultiKVCacheParams({
        "target": make_params(**LOCAL, n_kv_heads=2, head_dim=4, num_layers=2),
        "draft": make_params(**LOCAL, dtype=DType.bfloat16, n_kv_heads=1, head_dim=8, num_layers=1),
    }),
}  # fmt: skip


def keys(*names: str) -> list[bytes]:
    return [hashlib.sha256(n.encode()).digest() for n in names]


def scramble(mgr: PagedKVCacheManager, seed: int) -> None:
    """Random bytes in every page of every unit (replicated units: the same bytes on every peer)."""
    g = torch.Generator().manual_seed(seed)
    for unit in mgr.tiers.connectors[0].mover.units:
        unit.buffer.copy_(torch.randint(0, 256, unit.buffer.shape, dtype=torch.uint8, generator=g))
        for peer in unit.peers if isinstance(unit, ReplicatedKVCacheMemory) else []:
            peer.copy_(unit.buffer)


def pages(mgr: PagedKVCacheManager, ids: list[int]) -> list[bytes]:
    """The bytes of pages `ids` in every unit (and every replicated peer), for comparison."""
    out = []
    for unit in mgr.tiers.connectors[0].mover.units:
        for t in [unit.buffer, *(unit.peers if isinstance(unit, ReplicatedKVCacheMemory) else [])]:
            out.extend(t[i].numpy().tobytes() for i in ids)
    return out


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_round_trip_is_bit_exact(layout: str) -> None:
    mgr = PagedKVCacheManager(LAYOUTS[layout](), None, 10, total_num_host_pages=6, max_batch_size=4)
    conn = mgr.tiers.connectors[0]
    assert conn.mover.row_bytes == sum(u.bytes_per_page for u in conn.mover.units) and mgr.get_num_host_pages() == 6
    scramble(mgr, 1)
    before = pages(mgr, [2, 3, 4])
    conn.offload([2, 3, 4], keys("a", "b", "c"))
    conn.wait_for_offloads()
    scramble(mgr, 2)
    assert conn.load([7, 8, 9], keys("a", "b", "c")) == 3
    assert conn.complete_loads() == 3  # `load` only staged the copies
    assert pages(mgr, [7, 8, 9]) == before
    assert conn.load([5, 6], keys("a", "x")) == 1 and conn.load([5], keys("x")) == 0
    stats = mgr.tier_stats()["host"]
    assert (stats["pages_stored"], stats["pages_loaded"], stats["lookups"]) == (3, 4, 6)
    assert mgr.get_num_used_host_pages() == 3
    conn.host.index.check_integrity()
    mgr.close()


def test_host_lru_and_dedup() -> None:
    mgr = PagedKVCacheManager(LAYOUTS["fp32"](), None, 10, total_num_host_pages=3, max_batch_size=4)
    conn = mgr.tiers.connectors[0]
    conn.offload([1, 2, 3], keys("a", "b", "c"))
    conn.offload([1], keys("a"))  # already there: not copied again
    conn.wait_for_offloads()
    assert conn.load([5], keys("a")) == 1  # a is now the most recently used
    conn.offload([4], keys("d"))  # evicts b, the least recently used
    conn.wait_for_offloads()
    assert [conn.load([5], keys(k)) for k in "abcd"] == [1, 0, 1, 1]
    assert mgr.tier_stats()["host"]["evictions"] == 1 and mgr.tier_stats()["host"]["pages_stored"] == 4
    mgr.close()


def test_manager_reloads_evicted_prefix_from_host() -> None:
    """A prefix evicted from the 6-page device pool comes back from host: same KV, no recompute."""
    mgr = PagedKVCacheManager(make_params(**LOCAL, n_kv_heads=2, head_dim=2, num_layers=2), None, 6,
                              total_num_host_pages=16, max_batch_size=2, enable_runtime_checks=True)  # fmt: skip
    model = PrefixStampModel(mgr)
    prompt = list(range(1, 14))  # 13 tokens: pages 0-2 are full and shareable
    serve(mgr, model, ctx("a", prompt), 4)
    serve(mgr, model, ctx("evictor", range(50, 70)), 2)  # 20 tokens: needs every device page
    assert mgr.get_metrics_aggregated().evictions >= 3
    b = ctx("b", prompt + [99])
    mgr.claim("b")
    mgr.alloc(b)
    assert b.cached_prefix_length == 12 and b.tokens.processed_length == 12  # 3 pages from host
    model.forward([[b]])  # checks every cached position holds this prefix's KV
    assert model.positions_checked >= 12
    stats = mgr.tier_stats()["host"]
    assert stats["pages_loaded"] == 3 and stats["pages_stored"] >= 3
    assert mgr.get_metrics_aggregated().cache_tokens == 12
    mgr.release("b")
    mgr.check_integrity()
    mgr.reset_prefix_cache()
    assert mgr.get_num_used_host_pages() == 0
    mgr.close()


def test_connector_needs_caching_and_gives_hybrid_models_swap_rows_only() -> None:
    with pytest.raises(ValueError, match="kv_connector=local requires prefix caching to be enabled"):
        make_params(kv_connector="local", host_kvcache_swap_space_gb=1)
    config = KVConnectorConfig(redis_url="redis://127.0.0.1:1/0")
    redis = dict(enable_prefix_caching=True, kv_connector="redis", kv_connector_config=config)
    hybrid = MultiKVCacheParams({"full": make_params(**redis), "window": make_params(**redis, sliding_window=8)})
    with pytest.raises(ValueError, match="all full attention .* takes kv_connector=local, host rows for swap"):
        PagedKVCacheManager(hybrid, None, 8, max_batch_size=1)
    local = MultiKVCacheParams({"full": make_params(**LOCAL), "window": make_params(**LOCAL, sliding_window=8)})
    mgr = PagedKVCacheManager(local, None, 16, 8, max_batch_size=1)
    assert mgr.can_swap and mgr.total_num_host_pages == 8
    a = ctx("a", range(20))
    mgr.claim("a")
    mgr.alloc(a)
    mgr.runtime_inputs([[a]])
    a.update(1)
    mgr.step([[a]])  # committed pages stay on the device: a hybrid model's pages do not go down by hash
    mgr.sync_tiers()
    assert mgr.get_num_used_host_pages() == 0
    mgr.release("a")
    mgr.close()


def test_host_pages_from_swap_space() -> None:
    params = make_params(**{**LOCAL, "host_kvcache_swap_space_gb": 2 / 1024**2}, n_kv_heads=2, head_dim=4)
    mgr = PagedKVCacheManager(params, None, 4, max_batch_size=1)
    assert mgr.get_num_host_pages() == 2 * 1024 // params.bytes_per_block == 8
    assert np.asarray(mgr.tiers.connectors[0].host.buffer.shape).tolist() == [8, params.bytes_per_block]
    mgr.close()
