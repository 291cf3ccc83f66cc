"""PagedKVCacheManager over a vLLM `KVCacheConfig`: groups, one arena, the input tree per group."""

from __future__ import annotations

import pytest

from helpers import ctx
from pagedkv.dtype import DeviceRef, DType
from pagedkv.interface import FullAttentionSpec, SlidingWindowSpec, get_kv_cache_config
from pagedkv.manager.paged import PagedKVCacheManager
from pagedkv.runtime.inputs import MultiKVCacheInputs

CPU = DeviceRef.CPU()
COMMON = dict(block_size=4, num_kv_heads=2, head_size=4, dtype=DType.float32)


def manager() -> PagedKVCacheManager:
    specs = {f"l{i}": SlidingWindowSpec(**COMMON, sliding_window=8) if i % 2 else FullAttentionSpec(**COMMON)
             for i in range(4)}  # fmt: skip
    config = get_kv_cache_config(specs, 40 * 2 * 2 * 4 * 2 * 4 * 4)  # 40 page ids of 2 layers x K/V x 4 x 2 x 4 fp32
    assert config.num_blocks == 40 and len(config.kv_cache_groups) == 2
    return PagedKVCacheManager.from_kv_cache_config(
        config, [CPU], max_batch_size=4, enable_runtime_checks=True, enable_prefix_caching=True
    )


def test_groups_tables_and_shared_storage() -> None:
    mgr = manager()
    assert mgr.total_num_blocks() == 40 and mgr.hybrid
    a = ctx("a", range(20))
    mgr.claim("a")
    mgr.alloc(a)
    a.update(1)
    mgr.step([[a]])
    mgr.alloc(a)  # decode at 20: the window (13..20] reads pages 3-5; pages 0-2 go back
    inputs = mgr.runtime_inputs([[a]])
    assert isinstance(inputs, MultiKVCacheInputs) and list(inputs.children) == ["group0", "group1"]
    full, window = (inputs.children[g].inputs[0] for g in ("group0", "group1"))
    null = mgr.total_num_blocks()
    assert mgr.get_req_blocks("a", group=0) == [0, 1, 2, 3, 4, 10]
    assert mgr.get_req_blocks("a", group=1) == [null, null, null, 8, 9, 11]
    assert full.lookup_table[0, :7].tolist() == [0, 1, 2, 3, 4, 10, null]
    assert window.lookup_table[0, :7].tolist() == [null, null, null, 8, 9, 11, null]
    assert full.cache_lengths is window.cache_lengths and full.cache_lengths.tolist() == [20]
    assert full.blocks.untyped_storage().data_ptr() == window.blocks.untyped_storage().data_ptr()  # one arena
    assert full.blocks.shape == window.blocks.shape == (41, 2, 2, 4, 2, 4)
    mgr.release("a")
    assert mgr.get_num_used_pages() == 0


def test_from_kv_cache_config_rejects_other_types() -> None:
    with pytest.raises(TypeError, match="config must be a KVCacheConfig, got dict"):
        PagedKVCacheManager.from_kv_cache_config({}, [CPU], max_batch_size=1)  # type: ignore[arg-type]
