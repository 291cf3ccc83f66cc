"""Memory planning: the figures of MAX's test_memory_estimation, on our functions."""

from __future__ import annotations

import dataclasses

import pytest

from helpers import make_params
from pagedkv.core.errors import InsufficientBlocksError
from pagedkv.core.memory import (
    compute_max_seq_len_fitting_in_cache,
    compute_num_device_blocks,
    compute_num_host_blocks,
    estimated_memory_size,
    infer_optimal_batch_size,
)
from pagedkv.dtype import DeviceRef, DType
from pagedkv.params import KVCacheQuantizationConfig
from pagedkv.params.multi import MultiKVCacheParams

GiB = 1024**3
MiB_PAGE = make_params(n_kv_heads=8, head_dim=128, num_layers=1, page_size=128)  # 1 MiB per page


def test_one_mib_pages() -> None:
    assert MiB_PAGE.bytes_per_block == 1024 * 1024
    assert compute_num_device_blocks(MiB_PAGE, GiB) == 1024
    assert compute_num_device_blocks(MiB_PAGE, GiB + 7) == 1024
    assert compute_num_device_blocks(MiB_PAGE, 17 * GiB) == 17 * 1024
    assert estimated_memory_size(MiB_PAGE, GiB + 7) == GiB
    assert compute_num_device_blocks(MiB_PAGE, GiB, max_batch_size=4, max_seq_len=1000) == 4 * 8
    assert estimated_memory_size(MiB_PAGE, GiB, 4, 1000) == 32 * 1024 * 1024


def test_parallelism() -> None:
    tp2 = dataclasses.replace(MiB_PAGE, devices=[DeviceRef.GPU(0), DeviceRef.GPU(1)])
    assert compute_num_device_blocks(tp2, GiB) == 1024
    dp2 = dataclasses.replace(tp2, data_parallel_degree=2)
    assert compute_num_device_blocks(dp2, GiB) == 512 and estimated_memory_size(dp2, GiB) == GiB


def test_odd_page_size() -> None:
    p = dataclasses.replace(MiB_PAGE, page_size=777)
    assert p.bytes_per_block == 6_365_184
    assert compute_num_device_blocks(p, GiB) == 168
    assert estimated_memory_size(p, GiB) == 1_069_350_912


def test_not_even_one_page() -> None:
    with pytest.raises(InsufficientBlocksError, match="Insufficient cache memory to allocate even a single page"):
        compute_num_device_blocks(MiB_PAGE, 1)
    with pytest.raises(ValueError, match="available_cache_memory=-5 must be at least 0"):
        compute_num_device_blocks(MiB_PAGE, -5)
    with pytest.raises(ValueError, match="max_batch_size=0 must be at least 1"):
        compute_num_device_blocks(MiB_PAGE, GiB, max_batch_size=0, max_seq_len=10)


def test_fp8_gives_more_pages() -> None:
    fp8 = dataclasses.replace(MiB_PAGE, dtype=DType.float8_e4m3fn, kvcache_quant_config=KVCacheQuantizationConfig())
    # 1 byte per element plus one float32 scale per 128 elements
    assert fp8.bytes_per_block == 2 * 128 * 8 * 128 + 2 * 128 * 8 * 1 * 4
    assert compute_num_device_blocks(fp8, GiB) == GiB // fp8.bytes_per_block == 3971  # vs 1024 at fp32


def test_multi_cache_halves_pages() -> None:
    multi = MultiKVCacheParams({"a": MiB_PAGE, "b": MiB_PAGE})
    assert compute_num_device_blocks(multi, GiB) == 512
    assert compute_max_seq_len_fitting_in_cache(multi, GiB) < compute_max_seq_len_fitting_in_cache(MiB_PAGE, GiB)
    assert compute_max_seq_len_fitting_in_cache(MiB_PAGE, GiB) == 1024 * 128


def test_infer_optimal_batch_size() -> None:
    assert infer_optimal_batch_size(MiB_PAGE, 1000, GiB) == 1024 // 8
    assert infer_optimal_batch_size(MiB_PAGE, 10**6, GiB) == 1


def test_host_pages() -> None:
    assert compute_num_host_blocks(MiB_PAGE) == 0
    local = dataclasses.replace(
        MiB_PAGE, enable_prefix_caching=True, kv_connector="local", host_kvcache_swap_space_gb=2
    )
    assert compute_num_host_blocks(local) == 2048
    mla = make_params(is_mla=True, num_q_heads=8, head_dim=512, page_size=128, dtype=DType.bfloat16,
                      devices=[DeviceRef.GPU(i) for i in range(4)], enable_prefix_caching=True,
                      kv_connector="local", host_kvcache_swap_space_gb=1)  # fmt: skip
    one = dataclasses.replace(mla, devices=[DeviceRef.GPU(0)])
    assert mla.bytes_per_block == 4 * one.bytes_per_block  # every shard holds the latent
    assert compute_num_host_blocks(mla) == compute_num_host_blocks(one) == GiB // one.bytes_per_block  # host: one copy
    tiny = dataclasses.replace(local, host_kvcache_swap_space_gb=1e-9)
    with pytest.raises(InsufficientBlocksError, match="holds no page"):
        compute_num_host_blocks(tiny)


def _state_tree(caching: bool = True, cap: int | None = None, attention: bool = True) -> MultiKVCacheParams:
    from pagedkv.params.state import StateCacheParams
    from pagedkv.specs import MambaSpec

    devices = [DeviceRef.CPU()]
    shared = dict(page_size=4, enable_prefix_caching=caching, max_state_checkpoints=cap)
    state = MambaSpec(block_size=4, shapes=((6, 3), (2, 4, 8)), dtypes=(DType.float32, DType.float32))
    children = {"state": StateCacheParams.from_spec(state, 2, devices, **shared)}
    if attention:
        children["attention"] = make_params(n_kv_heads=2, head_dim=8, num_layers=1, devices=devices, **shared)
    return MultiKVCacheParams(children)


def test_a_budget_pays_the_live_rows_then_buys_pages_that_checkpoints_share() -> None:
    """With attention pages, a checkpoint is a run of pages (one budget): the budget pays the live rows only,
    `max_state_checkpoints` stays a count (None: no cap)."""
    from pagedkv.core import memory

    params = _state_tree()
    row = memory.state_row_bytes(params)  # 2 layers x (6 x 3 + 2 x 4 x 8) x 4 bytes
    assert row == 2 * (18 + 64) * 4
    page = memory.pool_page_bytes(params)  # 4 tokens x K and V x 2 heads x 8 x 4 bytes
    assert page == 4 * 2 * 2 * 8 * 4 and memory.checkpoint_pages(params) == -(-row // page) == 2
    budget = 4 * row + 100 * page + 7
    assert memory.num_state_rows(params, 4, budget) == 4 == memory.num_state_rows(params, 4)
    assert memory.compute_num_device_blocks(params, budget, max_batch_size=4) == 100
    assert memory.with_budget_checkpoints(params, budget, 4) is params  # (no share of the budget to set)
    assert memory.run_checkpoint_cap(params, 4) == 8 and memory.run_checkpoint_cap(_state_tree(cap=3), 4) == 3
    assert memory.checkpoint_pages(_state_tree(caching=False)) == 0  # no checkpoint without caching
    with pytest.raises(InsufficientBlocksError, match="cannot hold the 5 state rows"):
        memory.compute_num_device_blocks(params, 5 * row - 1, max_batch_size=5)


def test_state_layers_only_pay_the_live_rows_then_a_third_of_the_rest_goes_to_checkpoint_rows() -> None:
    from pagedkv.core import memory

    params = _state_tree(attention=False)
    row = memory.state_row_bytes(params)
    assert memory.checkpoint_pages(params) == 0 and memory.pool_page_bytes(params) == 0
    budget = 4 * row + 3 * 10 * row + 7  # 4 live rows, then 30 rows' worth: 10 checkpoint rows
    assert memory.default_state_checkpoints(4, budget, row) == 10
    assert memory.default_state_checkpoints(4) == 8  # no budget: two per batch slot
    assert memory.num_state_rows(params, 4, budget) == 14 and memory.num_state_rows(params, 4) == 12
    capped = memory.with_budget_checkpoints(params, budget, 4)
    assert {leaf.max_state_checkpoints for leaf in capped.leaves()} == {10}
    assert memory.with_budget_checkpoints(_state_tree(cap=3, attention=False), budget, 4).max_state_checkpoints == 3
    assert memory.num_state_rows(_state_tree(caching=False, attention=False), 4, budget) == 4
    with pytest.raises(InsufficientBlocksError, match="cannot hold the 14 state rows"):
        memory.compute_num_device_blocks(_state_tree(cap=10, attention=False), 14 * row - 1, max_batch_size=4)
