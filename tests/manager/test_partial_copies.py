"""`enable_partial_page_reuse` on `PagedKVCacheManager`: `runtime_inputs` copies the reused slots on every
tensor (values and FP8 scales, every TP shard, every cache of a tree), and the flag's validation."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from helpers import ctx, make_params
from pagedkv.core.context import TextContext
from pagedkv.dtype import DeviceRef, DType
from pagedkv.manager.paged import PagedKVCacheManager
from pagedkv.params import KVCacheQuantizationConfig
from pagedkv.params.multi import MultiKVCacheParams
from pagedkv.params.state import StateCacheParams
from pagedkv.specs import MambaSpec

CPU = DeviceRef.CPU()
FP8 = dict(dtype=DType.float8_e4m3fn, kvcache_quant_config=KVCacheQuantizationConfig(DType.float32, 2))
LAYOUTS: dict[str, dict[str, Any]] = {
    "fp8-tp2": dict(n_kv_heads=2, head_dim=4, devices=[CPU, CPU], **FP8),
    "bf16": dict(n_kv_heads=2, head_dim=4, dtype=DType.bfloat16),
    "mla-tp2": dict(n_kv_heads=1, head_dim=6, devices=[CPU, CPU], is_mla=True, num_q_heads=2),
}


def partial_params(**kwargs: Any) -> Any:
    base = dict(num_layers=3, page_size=4, enable_prefix_caching=True, enable_partial_page_reuse=True)
    return make_params(**{**base, **kwargs})


def scramble(mgr: PagedKVCacheManager) -> list[torch.Tensor]:
    """Fill every page tensor with random bytes; returns their copies."""
    g = torch.Generator().manual_seed(0)
    for t in mgr.get_device_buffer().all_buffers:
        raw = t.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, generator=g, dtype=torch.uint8))
    return [t.view(torch.uint8).clone() for t in mgr.get_device_buffer().all_buffers]


def reuse(mgr: PagedKVCacheManager) -> tuple[tuple[int, int, int], TextContext]:
    """a (10 tokens) runs and commits pages 0, 1; b shares 6 tokens: page 0 hits, 2 tokens of page 1 are copied."""
    a = ctx("a", range(10))
    mgr.claim("a")
    mgr.alloc(a)
    a.update(7)
    mgr.step([[a]])
    b = ctx("b", [0, 1, 2, 3, 4, 5, 50, 51, 52])
    mgr.claim("b")
    assert mgr.get_pct_used_blocks_after_allocation(b) == 5 / 16  # a's 3 pages + b's 2 new (hit and source: a's)
    mgr.alloc(b)
    assert b.cached_prefix_length == 6
    copy = mgr._managers[0]._partial.pending["b"]  # type: ignore[union-attr]
    assert copy.src == mgr.get_req_blocks("a")[1] and copy.dst == mgr.get_req_blocks("b")[1]
    return copy, b


@pytest.mark.parametrize("layout", LAYOUTS)
def test_runtime_inputs_copies_the_reused_slots_of_every_tensor(layout: str) -> None:
    mgr = PagedKVCacheManager(partial_params(**LAYOUTS[layout]), None, 16, enable_runtime_checks=True, max_batch_size=4)
    before = scramble(mgr)
    (src, dst, n), b = reuse(mgr)
    assert n == 2 and mgr._managers[0].pool.ref_count(src) == 2
    inputs = mgr.runtime_inputs([[b]])
    tensors = mgr.get_device_buffer().all_buffers
    assert len(tensors) == {"fp8-tp2": 4, "bf16": 1, "mla-tp2": 2}[layout]
    assert [r.blocks.data_ptr() for r in inputs.inputs] == [t.data_ptr() for t in mgr.get_device_buffer().values]
    for t, old in zip(tensors, before, strict=True):
        raw = t.view(torch.uint8)
        assert torch.equal(raw[dst, :, :, :n], old[src, :, :, :n])  # K and V, every layer and head
        assert torch.equal(raw[dst, :, :, n:], old[dst, :, :, n:])
        others = [p for p in range(raw.shape[0]) if p != dst]
        assert torch.equal(raw[others], old[others])
    assert mgr._managers[0].pool.ref_count(src) == 1 and mgr._managers[0].take_page_copies() == []
    mgr.release("b")
    mgr.release("a")
    assert mgr.get_num_used_pages() == 0


def test_a_multi_cache_tree_copies_in_every_cache() -> None:
    tree = MultiKVCacheParams({"target": partial_params(n_kv_heads=2, head_dim=4), "draft": partial_params(head_dim=2)})
    mgr = PagedKVCacheManager(tree, None, 16, enable_runtime_checks=True, max_batch_size=4)
    before = scramble(mgr)
    (src, dst, n), b = reuse(mgr)
    mgr.runtime_inputs([[b]])
    for t, old in zip(mgr.get_device_buffer().all_buffers, before, strict=True):
        assert torch.equal(t.view(torch.uint8)[dst, :, :, :n], old[src, :, :, :n])


def test_flag_validation() -> None:
    with pytest.raises(TypeError, match="enable_partial_page_reuse=1 must be a bool"):
        partial_params(enable_partial_page_reuse=1)
    with pytest.raises(ValueError, match="enable_partial_page_reuse=True requires enable_prefix_caching=True"):
        make_params(enable_partial_page_reuse=True)
    with pytest.raises(ValueError, match="enable_partial_page_reuse=True does not support kv_connector=local"):
        partial_params(kv_connector="local", host_kvcache_swap_space_gb=0.001)
    for hybrid in (  # several groups (or one window group): a coordinator with partial-page reuse
        partial_params(sliding_window=8),
        MultiKVCacheParams({"full": partial_params(), "window": partial_params(sliding_window=8)}),
    ):
        assert PagedKVCacheManager(hybrid, None, 16, max_batch_size=4)._managers[0]._partial is not None
    spec = MambaSpec(block_size=4, shapes=((4, 2),), dtypes=(torch.float32,))
    shared = dict(page_size=4, enable_prefix_caching=True, enable_partial_page_reuse=True)
    stateful = MultiKVCacheParams(
        {"full": partial_params(), "state": StateCacheParams.from_spec(spec, 2, [CPU], **shared)}
    )
    with pytest.raises(ValueError, match="enable_partial_page_reuse=True does not support models with recurrent state"):
        PagedKVCacheManager(stateful, None, 16, max_batch_size=4)
    with pytest.raises(ValueError, match="All caches must have the same enable_partial_page_reuse"):
        MultiKVCacheParams({"a": partial_params(), "b": make_params(enable_prefix_caching=True, num_layers=3)})
    plain = PagedKVCacheManager(make_params(enable_prefix_caching=True), None, 16, max_batch_size=4)
    assert plain._managers[0]._partial is None and plain._managers[0].take_page_copies() == []


def test_a_hybrid_tree_copies_page_k_in_every_group() -> None:
    """Full + sliding window over one arena: one copy per group (page ids of the shared pool), each landing in
    its group's views before the forward."""
    tree = MultiKVCacheParams({"full": partial_params(n_kv_heads=2, head_dim=4),
                               "window": partial_params(n_kv_heads=1, head_dim=4, sliding_window=8)})  # fmt: skip
    mgr = PagedKVCacheManager(tree, None, 16, enable_runtime_checks=True, max_batch_size=4)
    children = list(mgr.get_device_buffer().children.values())
    scramble(mgr)
    before = [[t.view(torch.uint8).clone() for t in child.all_buffers] for child in children]
    a = ctx("a", range(10))
    mgr.claim("a")
    mgr.alloc(a)
    a.update(7)
    mgr.step([[a]])
    b = ctx("b", [0, 1, 2, 3, 4, 5, 50, 51, 52])
    mgr.claim("b")
    mgr.alloc(b)
    assert b.cached_prefix_length == 6
    copies = mgr._managers[0]._partial.pending["b"]  # type: ignore[union-attr]
    assert copies == [(mgr.get_req_blocks("a", group=g)[1], mgr.get_req_blocks("b", group=g)[1], 2) for g in (0, 1)]
    mgr.runtime_inputs([[b]])
    for (src, dst, n), child, old in zip(copies, children, before, strict=True):
        for t, o in zip(child.all_buffers, old, strict=True):
            assert torch.equal(t.view(torch.uint8)[dst, :, :, :n], o[src, :, :, :n])  # K and V, every layer
    assert mgr._managers[0].take_page_copies() == []
    mgr.release("b")
    mgr.release("a")
    assert mgr.get_num_used_pages() == 0
