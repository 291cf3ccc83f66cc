"""PagedKVCacheManager: the facade over replicas, shards, buffers and multi-cache trees."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers import ctx, make_params
from pagedkv.core.errors import InsufficientBlocksError, IntegrityError
from pagedkv.dtype import DeviceRef, DType
from pagedkv.manager.paged import PagedKVCacheManager
from pagedkv.params import KVCacheQuantizationConfig
from pagedkv.params.multi import MultiKVCacheParams
from pagedkv.runtime.inputs import KVCacheInputs, MultiKVCacheInputs, RaggedKVCacheInputs
from pagedkv.testing import PrefixStampModel

CPU = DeviceRef.CPU()


def paged(num_pages: int = 16, batch: int = 8, **overrides) -> PagedKVCacheManager:
    overrides.setdefault("enable_prefix_caching", True)
    return PagedKVCacheManager(
        make_params(**overrides), None, num_pages, enable_runtime_checks=True, max_batch_size=batch
    )


def test_lifecycle_and_inputs() -> None:
    mgr = paged(page_size=4, n_kv_heads=2, head_dim=4, num_layers=3)
    c = ctx("a", range(10))
    mgr.claim("a")
    assert mgr.contains("a") and not mgr.contains("b")
    mgr.alloc(c)
    inputs = mgr.runtime_inputs([[c]])
    assert isinstance(inputs, KVCacheInputs) and len(inputs.inputs) == 1 and len(inputs.flatten()) == 4
    rec = inputs.inputs[0]
    assert isinstance(rec, RaggedKVCacheInputs)
    assert rec.blocks.shape == (17, 2, 3, 4, 2, 4) and rec.blocks is mgr.get_device_buffer().values[0]
    assert rec.lookup_table.dtype == torch.int32 and rec.lookup_table.tolist() == [[0, 1, 2] + [16] * 21]
    assert rec.cache_lengths.tolist() == [0] and rec.max_lengths.tolist() == [[10, 10]]
    c.update(5)
    mgr.step([[c]])
    mgr.alloc(c)
    rec = mgr.runtime_inputs([[c]]).inputs[0]
    assert rec.cache_lengths.tolist() == [10] and rec.max_lengths.tolist() == [[1, 11]]
    assert mgr.get_req_blocks("a") == [0, 1, 2] and mgr.get_num_used_pages() == 3
    mgr.release("a")
    assert (
        mgr.get_num_used_pages() == 0 and mgr.num_free_blocks() == mgr.total_num_blocks() == mgr.get_num_pages() == 16
    )


def test_constructor_and_argument_errors() -> None:
    p = make_params()
    with pytest.raises(TypeError, match="params must be KVCacheParams or MultiKVCacheParams, got dict"):
        PagedKVCacheManager({}, None, 4, max_batch_size=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="total_num_pages=0 must be at least 1"):
        PagedKVCacheManager(p, None, 0, max_batch_size=1)
    with pytest.raises(ValueError, match="max_batch_size=0 must be at least 1"):
        PagedKVCacheManager(p, None, 4, max_batch_size=0)
    with pytest.raises(ValueError, match="total_num_host_pages=3 needs a local, tiered or redis kv_connector"):
        PagedKVCacheManager(p, None, 4, 3, max_batch_size=1)
    mgr = paged()
    for bad in (1, -1, True, "0"):
        with pytest.raises(ValueError, match=r"replica_idx=.* must be an int in \[0, 1\)"):
            mgr.claim("x", bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="got 2 batches; need one per replica \\(1\\)"):
        mgr.runtime_inputs([[], []])
    with pytest.raises(ValueError, match="Attempted to release request ID 'nope' but it is not claimed"):
        mgr.release("nope")
    cs = [ctx(i, [1]) for i in range(9)]
    for c in cs:
        mgr.claim(c.request_id)
        mgr.alloc(c)
    with pytest.raises(ValueError, match="replica 0 batch of 9 exceeds max_batch_size=8"):
        mgr.runtime_inputs([cs])


def test_tensor_parallel_shards_share_tables_not_objects() -> None:
    mgr = paged(n_kv_heads=4, devices=[CPU, CPU], page_size=2)
    c = ctx("a", range(5))
    mgr.claim("a")
    mgr.alloc(c)
    recs = mgr.runtime_inputs([[c]]).inputs
    assert len(recs) == 2 and recs[0].blocks.shape[4] == 2
    assert torch.equal(recs[0].lookup_table, recs[1].lookup_table) and recs[0].lookup_table is not recs[1].lookup_table
    assert torch.equal(recs[0].cache_lengths, recs[1].cache_lengths)
    assert recs[0].blocks.data_ptr() != recs[1].blocks.data_ptr()


def test_mixed_dp_tp_mla() -> None:
    params = make_params(is_mla=True, num_q_heads=8, head_dim=8, devices=[CPU] * 8, data_parallel_degree=2,
                         page_size=16, enable_prefix_caching=True)  # fmt: skip
    mgr = PagedKVCacheManager(params, None, 32, max_batch_size=4)
    a, b = ctx("a", [1]), ctx("b", range(129))
    mgr.claim("a", 0)
    mgr.claim("b", 1)
    mgr.alloc(a, 0)
    mgr.alloc(b, 1)
    recs = mgr.runtime_inputs([[a], [b]]).inputs
    assert len(recs) == 8
    assert [r.lookup_table.shape[1] for r in recs] == [24] * 4 + [32] * 4  # 1 page vs 9 pages
    assert all(torch.equal(r.lookup_table, recs[4].lookup_table) for r in recs[4:])
    assert all(r.blocks.shape == (33, 1, 1, 16, 1, 8) for r in recs)
    assert mgr.get_device_buffer(1).replicates_kv_across_tp
    assert mgr.get_req_blocks("b", 1) == list(range(9)) and mgr.get_req_blocks("a", 0) == [0]  # one pool per replica
    empty = mgr.runtime_inputs([[a], []]).inputs
    assert empty[4].lookup_table.shape == (0, 16) and empty[4].max_lengths.tolist() == [[0, 0]]


def test_multi_cache_tree_shares_tables() -> None:
    tree = MultiKVCacheParams({"target": make_params(n_kv_heads=2, enable_prefix_caching=True),
                               "draft": make_params(head_dim=3, enable_prefix_caching=True)})  # fmt: skip
    mgr = PagedKVCacheManager(tree, None, 12, enable_runtime_checks=True, max_batch_size=2)
    first = ctx("a", range(9))
    mgr.claim("a")
    mgr.alloc(first)
    inputs = mgr.runtime_inputs([[first]])
    assert isinstance(inputs, MultiKVCacheInputs) and list(inputs.children) == ["target", "draft"]
    t, d = inputs.children["target"].inputs[0], inputs.children["draft"].inputs[0]
    assert t.lookup_table is d.lookup_table and t.cache_lengths is d.cache_lengths and t.blocks is not d.blocks
    assert (t.blocks.shape[-1], d.blocks.shape[-1]) == (1, 3) and len(inputs.flatten()) == 8
    model = PrefixStampModel(mgr)
    model.forward([[first]])
    first.update(1)
    mgr.step([[first]])
    mgr.release("a")
    second = ctx("b", range(9))
    mgr.claim("b")
    mgr.alloc(second)
    assert second.tokens.processed_length == 8  # one lifecycle covers both caches
    model.forward([[second]])
    with pytest.raises(TypeError, match="runtime_inputs_for_leaf needs KVCacheParams"):
        mgr.runtime_inputs_for_leaf([[second]])


@pytest.mark.parametrize("dp,tp", [(1, 1), (2, 1), (2, 2), (1, 4)])
def test_runtime_flatten_matches_symbolic(dp: int, tp: int) -> None:
    fp8 = make_params(
        dtype=DType.float8_e4m3fn,
        head_dim=4,
        n_kv_heads=4,
        devices=[CPU] * (dp * tp),
        data_parallel_degree=dp,
        kvcache_quant_config=KVCacheQuantizationConfig(quantization_granularity=2),
    )
    plain = make_params(n_kv_heads=4, devices=[CPU] * (dp * tp), data_parallel_degree=dp)
    tree = MultiKVCacheParams({"fp8": fp8, "plain": plain})
    for params in (fp8, tree):
        mgr = PagedKVCacheManager(params, None, 8, max_batch_size=2)
        batches = [[ctx(f"r{r}", range(3))] for r in range(dp)]
        for r, (c,) in enumerate(batches):
            mgr.claim(c.request_id, r)
            mgr.alloc(c, r)
        runtime, symbolic = mgr.runtime_inputs(batches).flatten(), params.get_symbolic_inputs().flatten()
        assert len(runtime) == len(symbolic)
        for tensor, spec in zip(runtime, symbolic, strict=True):
            assert DType.from_torch(tensor.dtype) == spec.dtype, spec.name
            assert len(tensor.shape) == len(spec.shape), spec.name
            assert all(s is None or s == d for s, d in zip(spec.static_dims, tensor.shape, strict=True)), spec.name


def test_alloc_dummy_uses_null_page() -> None:
    mgr = paged(num_pages=8)
    mgr.alloc_dummy("pad")
    assert mgr.get_req_blocks("pad") == [8] and mgr.num_free_blocks() == 8 and mgr.contains("pad")
    real = ctx("real", range(9))
    mgr.claim("real")
    mgr.alloc(real)
    lut = mgr.runtime_inputs([[real, ctx("pad", [0])]]).inputs[0].lookup_table
    assert lut[0, :3].tolist() == [0, 1, 2] and (lut[0, 3:] == 8).all() and (lut[1] == 8).all()
    assert not (lut == 0xCCCCCCCC - 2**32).any()
    real.update(1)
    mgr.step([[real, ctx("pad", [0])]])  # padding rows ride along in step: nothing to commit
    assert mgr.get_req_blocks("pad") == [8] and mgr.get_metrics_aggregated().cached_pages == 2


def test_reserve_releases_even_on_error() -> None:
    mgr = paged(num_pages=4)
    a, b = ctx("a", range(5)), ctx("b", range(50, 59))
    with mgr.reserve([[a]]):
        assert mgr.contains("a") and mgr.get_num_used_pages() == 2
    assert not mgr.contains("a") and mgr.get_num_used_pages() == 0
    with pytest.raises(InsufficientBlocksError):
        with mgr.reserve([[a, b]]):  # b needs 3 more pages; only 2 are left
            pass
    assert not mgr.contains("a") and not mgr.contains("b") and mgr.get_num_used_pages() == 0
    with pytest.raises(RuntimeError, match="boom"):
        with mgr.reserve([[ctx("c", [1])]]):
            raise RuntimeError("boom")
    assert not mgr.contains("c")


def test_pct_used_after_allocation_and_metrics() -> None:
    mgr = paged(num_pages=10, page_size=2)
    a = ctx("a", range(9))
    mgr.claim("a")
    mgr.alloc(a)  # 5 pages
    a.update(1)
    mgr.step([[a]])
    mgr.release("a")  # 4 cached-free, 6 fresh
    b = ctx("b", range(12))
    mgr.claim("b")
    assert mgr.get_pct_used_blocks_after_allocation(b) == pytest.approx((0 + 2 + 4) / 10)
    mgr.alloc(b)
    assert mgr.get_num_used_pages() == 6
    m = mgr.get_metrics_aggregated()
    # 4 hits, plus page 4 (tokens 8-9), which the scheduled chunk fills: cached at alloc (schedule-time caching)
    assert (m.input_tokens, m.cache_tokens, m.used_pages, m.cached_pages) == (
        9 + 4,
        8,
        6,
        4,
    )  # (alloc without num_scheduled_tokens commits at step)
    mgr.reset_metrics()
    assert mgr.get_metrics_aggregated().cache_tokens == 0


def test_metrics_aggregate_over_replicas() -> None:
    mgr = paged(devices=[CPU, CPU], data_parallel_degree=2, page_size=1)
    for r in (0, 1):
        for i in range(2):
            c = ctx(f"{r}{i}", range(5))
            mgr.claim(c.request_id, r)
            mgr.alloc(c, r)
            c.update(0)
            mgr.step([[c], []] if r == 0 else [[], [c]])
    m = mgr.get_metrics_aggregated()
    assert (m.cache_tokens, m.input_tokens, m.total_pages) == (2 * 4, 2 * (5 + 1), 32)
    mgr.reset_prefix_cache()
    assert mgr.get_num_host_pages() == mgr.get_num_used_disk_pages(1) == 0


def test_runtime_checks_catch_corruption() -> None:
    mgr = paged()
    mgr.claim("a")
    mgr._managers[0].pool._ref[5] = 3  # corrupt a ref count behind the manager's back
    with pytest.raises(IntegrityError, match="page 5: ref 3 but 0 table references"):
        mgr.alloc(ctx("a", range(3)))


def test_from_memory_budget() -> None:
    params = make_params(n_kv_heads=2, head_dim=4, num_layers=2, page_size=4)  # 2*2*4*2*4*4 = 512 bytes per page
    mgr = PagedKVCacheManager.from_memory_budget(params, 512 * 100 + 17, max_batch_size=4)
    assert mgr.total_num_blocks() == 100 and mgr.get_device_buffer().total_num_pages == 101
    capped = PagedKVCacheManager.from_memory_budget(params, 512 * 100, max_batch_size=2, max_seq_len=10)
    assert capped.total_num_blocks() == 6
    cpu = params.devices
    assert PagedKVCacheManager.estimated_memory_size(params, 2, 10, 2, 512 * 100, cpu) == 6 * 512
    assert PagedKVCacheManager.infer_optimal_batch_size(params, 40, 2, 512 * 100, cpu) == 10
    with pytest.raises(ValueError, match="num_layers=3 differs from params' 2 layers"):
        PagedKVCacheManager.infer_optimal_batch_size(params, 40, 3, 512 * 100, cpu)


def test_released_pages_are_zero_cost_for_the_null_page() -> None:
    mgr = paged(num_pages=4, page_size=2)
    buf = mgr.get_device_buffer().values[0]
    c = ctx("a", range(7))
    mgr.claim("a")
    mgr.alloc(c)
    PrefixStampModel(mgr).forward([[c]])
    assert torch.count_nonzero(buf[4]) == 0  # nothing is ever written to the null page
    assert np.count_nonzero(buf[:4].numpy()) > 0
