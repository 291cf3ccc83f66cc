"""KVCacheBuffer / KVCacheMemory: validation, allocation shapes and byte views that share storage."""

from __future__ import annotations

import pytest
import torch

from helpers import make_params
from pagedkv.dtype import DeviceRef, DType
from pagedkv.params import KVCacheParams, KVCacheQuantizationConfig
from pagedkv.params.multi import MultiKVCacheParams
from pagedkv.runtime.buffers import (
    KVCacheBuffer,
    KVCacheMemory,
    MultiKVCacheBuffer,
    ReplicatedKVCacheMemory,
    allocate_kv_buffers,
)

CPU2 = [DeviceRef.CPU(), DeviceRef.CPU()]


def pages(n: int = 3, shape: tuple[int, ...] = (2, 4), dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.zeros((n, *shape), dtype=dtype)


def fp8_params(**overrides: object) -> KVCacheParams:
    """FP8 params with head_dim 4 and 2 float32 scales per head."""
    base: dict[str, object] = dict(
        dtype=DType.float8_e4m3fn,
        head_dim=4,
        kvcache_quant_config=KVCacheQuantizationConfig(quantization_granularity=2),
    )
    base.update(overrides)
    return make_params(**base)


# ----------------------------------------------------------------- validation
def test_kv_cache_buffer_validation_errors() -> None:
    with pytest.raises(ValueError, match="KVCacheBuffer requires at least one values buffer"):
        KVCacheBuffer(False, [])
    with pytest.raises(ValueError, match="replicates_kv_across_tp=True requires at least 2 TP shards, got 1"):
        KVCacheBuffer(True, [pages()])
    with pytest.raises(
        ValueError, match=r"All values buffers must have the same dtype and shape: .*values\[1\] is torch.float16"
    ):
        KVCacheBuffer(False, [pages(), pages(dtype=torch.float16)])
    with pytest.raises(
        ValueError, match=r"values\[0\] is torch.float32 \(3, 2, 4\), values\[1\] is torch.float32 \(3, 2, 5\)"
    ):
        KVCacheBuffer(False, [pages(), pages(shape=(2, 5))])
    with pytest.raises(TypeError, match=r"values\[1\] must be a torch.Tensor, got list"):
        KVCacheBuffer(False, [pages(), [[0.0]]])  # type: ignore[list-item]
    with pytest.raises(ValueError, match=r"values\[0\] must be contiguous"):
        KVCacheBuffer(False, [torch.zeros(4, 3).t()])
    with pytest.raises(ValueError, match=r"values\[0\] must have at least one page, got shape \(0, 2, 4\)"):
        KVCacheBuffer(False, [pages(0)])


def test_kv_cache_buffer_scales_validation_errors() -> None:
    values = [pages(), pages()]
    with pytest.raises(ValueError, match="scales has 1 buffers but values has 2"):
        KVCacheBuffer(False, values, [pages()])
    with pytest.raises(
        ValueError, match=r"All scales buffers must have the same dtype and shape: .*scales\[1\] is torch.float16"
    ):
        KVCacheBuffer(False, values, [pages(), pages(dtype=torch.float16)])
    with pytest.raises(ValueError, match=r"All scales buffers .*scales\[1\] is torch.float32 \(3, 2, 1\)"):
        KVCacheBuffer(False, values, [pages(), pages(shape=(2, 1))])
    with pytest.raises(ValueError, match="Values and scales must have the same number of pages: 3 != 2"):
        KVCacheBuffer(False, values, [pages(2), pages(2)])
    with pytest.raises(ValueError, match=r"values\[1\] is on cpu but scales\[1\] is on meta"):
        KVCacheBuffer(False, values, [pages(shape=(1,)), pages(shape=(1,)).to("meta")])
    ok = KVCacheBuffer(False, values, [pages(shape=(1,)), pages(shape=(1,))])
    assert ok.all_buffers[0] is values[0] and ok.all_buffers[1] is values[1] and ok.total_num_pages == 3


def test_kv_cache_memory_validation_errors() -> None:
    with pytest.raises(TypeError, match="buffer must be a torch.Tensor, got ndarray"):
        KVCacheMemory(pages().numpy())  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match=r"buffer must be 2-D uint8 \[num_pages, bytes_per_page\], got torch.uint8 \(3, 2, 4\)"
    ):
        KVCacheMemory(pages(dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"got torch.float32 \(3, 8\)"):
        KVCacheMemory(torch.zeros(3, 8))
    unit = KVCacheMemory(torch.zeros(3, 8, dtype=torch.uint8))
    assert (unit.num_pages, unit.bytes_per_page) == (3, 8)
    rank0 = torch.zeros(3, 8, dtype=torch.uint8)
    with pytest.raises(ValueError, match="ReplicatedKVCacheMemory requires at least 1 peer"):
        ReplicatedKVCacheMemory(rank0)
    with pytest.raises(ValueError, match=r"peers\[1\] is torch.uint8 \(3, 4\); rank 0 is torch.uint8 \(3, 8\)"):
        ReplicatedKVCacheMemory(
            rank0, peers=[torch.zeros(3, 8, dtype=torch.uint8), torch.zeros(3, 4, dtype=torch.uint8)]
        )


# ----------------------------------------------------------------- allocation
def test_allocate_mha_bf16_two_shards() -> None:
    params = make_params(dtype=DType.bfloat16, n_kv_heads=4, head_dim=2, num_layers=2, devices=CPU2, page_size=4)
    bufs = params.allocate_buffers(5)
    assert len(bufs) == 1
    buf = bufs[0]
    assert buf.replicates_kv_across_tp is False and buf.scales is None and buf.total_num_pages == 5
    # 4 KV heads split over 2 shards: 2 per shard.
    assert [tuple(v.shape) for v in buf.values] == [(5, 2, 2, 4, 2, 2)] * 2
    assert all(v.dtype == torch.bfloat16 and not v.any() for v in buf.values)
    assert buf.values[0].data_ptr() != buf.values[1].data_ptr()
    buf.values[0].fill_(1.0)
    assert not buf.values[1].any()
    assert buf.all_buffers == buf.values  # no scales


def test_allocate_dp2_four_devices_gives_one_buffer_per_replica() -> None:
    params = make_params(n_kv_heads=2, head_dim=2, devices=[DeviceRef.CPU()] * 4, data_parallel_degree=2)
    bufs = allocate_kv_buffers(params, 3)
    assert len(bufs) == 2 and all(isinstance(b, KVCacheBuffer) for b in bufs)
    # TP=2 per replica: 1 head per shard.
    assert [[tuple(v.shape) for v in b.values] for b in bufs] == [[(3, 2, 1, 4, 1, 2)] * 2] * 2
    ptrs = {v.data_ptr() for b in bufs for v in b.values}
    assert len(ptrs) == 4


@pytest.mark.parametrize(
    "bad,error,message",
    [(0, ValueError, "must be at least 1"), (-1, ValueError, "must be at least 1"),
     (2.0, TypeError, "must be an int"), ("3", TypeError, "must be an int")],
)  # fmt: skip
def test_allocate_rejects_bad_page_count(bad: object, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=f"total_num_pages={bad!r} {message}"):
        allocate_kv_buffers(make_params(), bad)  # type: ignore[arg-type]


def test_allocate_mla_two_shards_replicates() -> None:
    params = make_params(is_mla=True, num_q_heads=4, n_kv_heads=1, head_dim=3, num_layers=2, devices=CPU2)
    buf = params.allocate_buffers(2)[0]
    assert buf.replicates_kv_across_tp is True
    assert [tuple(v.shape) for v in buf.values] == [(2, 1, 2, 4, 1, 3)] * 2
    units = buf.to_memory()
    assert len(units) == 1 and isinstance(units[0], ReplicatedKVCacheMemory)
    assert len(units[0].peers) == 1
    assert units[0].buffer.data_ptr() == buf.values[0].data_ptr()
    assert units[0].peers[0].data_ptr() == buf.values[1].data_ptr()
    assert (units[0].num_pages, units[0].bytes_per_page) == (2, 2 * 4 * 3 * 4)


def test_mla_fp8_one_replicated_unit_per_kind() -> None:
    params = fp8_params(is_mla=True, num_q_heads=2, devices=CPU2)
    buf = params.allocate_buffers(2)[0]
    units = buf.to_memory()
    assert [type(u) for u in units] == [ReplicatedKVCacheMemory] * 2
    values_unit, scales_unit = units
    assert isinstance(values_unit, ReplicatedKVCacheMemory) and isinstance(scales_unit, ReplicatedKVCacheMemory)
    assert len(values_unit.peers) == 1 and len(scales_unit.peers) == 1
    assert buf.scales is not None
    assert [values_unit.buffer.data_ptr(), values_unit.peers[0].data_ptr()] == [v.data_ptr() for v in buf.values]
    assert [scales_unit.buffer.data_ptr(), scales_unit.peers[0].data_ptr()] == [t.data_ptr() for t in buf.scales]
    # values: 1 * 1 * 4 * 1 * 4 fp8 bytes; scales: 1 * 1 * 4 * 1 * 2 float32.
    assert (values_unit.bytes_per_page, scales_unit.bytes_per_page) == (16, 32)
    # A write through the peer view lands in shard 1 only.
    scales_unit.peers[0][1] = torch.full((8,), 0.5).view(torch.uint8)
    assert buf.scales[1][1].flatten().tolist() == [0.5] * 8 and not buf.scales[0].any()


def test_allocate_fp8_scales() -> None:
    params = fp8_params(n_kv_heads=2, num_layers=1, page_size=4)
    buf = params.allocate_buffers(3)[0]
    assert buf.values[0].dtype == torch.float8_e4m3fn and tuple(buf.values[0].shape) == (3, 2, 1, 4, 2, 4)
    assert buf.scales is not None and len(buf.scales) == 1
    # head_dim 4 / granularity 2: 2 scales per head.
    assert buf.scales[0].dtype == torch.float32 and list(buf.scales[0].shape) == [3, 2, 1, 4, 2, 2]
    assert list(buf.scales[0].shape) == [3, *params.shape_per_scale_block]
    assert not buf.scales[0].any()
    assert buf.all_buffers == [buf.values[0], buf.scales[0]]


def test_meta_device_allocation_has_no_storage() -> None:
    params = fp8_params(n_kv_heads=2, devices=[DeviceRef.META()])
    buf = params.allocate_buffers(1000)[0]
    assert buf.values[0].is_meta and buf.scales is not None and buf.scales[0].is_meta
    assert tuple(buf.values[0].shape) == (1000, 2, 1, 4, 2, 4)
    units = buf.to_memory()
    assert [(u.num_pages, u.bytes_per_page) for u in units] == [(1000, 64), (1000, 2 * 4 * 2 * 2 * 4)]
    assert all(u.buffer.is_meta for u in units)


# ----------------------------------------------------------------- byte views
def test_to_memory_mha_two_shards_with_scales_shares_storage() -> None:
    params = fp8_params(n_kv_heads=2, devices=CPU2)  # 1 head per shard
    buf = params.allocate_buffers(3)[0]
    units = buf.to_memory()
    # values[0], values[1], scales[0], scales[1]
    assert len(units) == 4 and all(type(u) is KVCacheMemory for u in units)
    for unit, tensor in zip(units, buf.all_buffers, strict=True):
        assert unit.buffer.dim() == 2 and unit.buffer.dtype == torch.uint8
        assert unit.num_pages == 3
        assert unit.num_pages * unit.bytes_per_page == tensor.numel() * tensor.element_size()
        assert unit.buffer.data_ptr() == tensor.data_ptr()
    assert [u.bytes_per_page for u in units] == [2 * 4 * 1 * 4, 2 * 4 * 1 * 4, 2 * 4 * 1 * 2 * 4, 2 * 4 * 1 * 2 * 4]

    # Write float32 1.0 into every scale of page 1 of shard 1, through its bytes.
    scales1 = buf.scales[1]  # type: ignore[index]
    ones = torch.ones(units[3].bytes_per_page // 4, dtype=torch.float32)
    units[3].buffer[1] = ones.view(torch.uint8)
    assert scales1[1].flatten().tolist() == [1.0] * 16
    assert not scales1[0].any() and not scales1[2].any() and not buf.scales[0].any()  # type: ignore[index]

    # And the other way: writing the tensor changes the view.
    scales1[2].fill_(2.0)
    assert units[3].buffer[2].view(torch.float32).tolist() == [2.0] * 16
    assert units[3].buffer[2, :4].tolist() == list(torch.tensor([2.0]).view(torch.uint8).tolist())


def test_to_memory_bf16_view_roundtrip() -> None:
    params = make_params(dtype=DType.bfloat16, n_kv_heads=1, head_dim=2, page_size=2)
    buf = params.allocate_buffers(2)[0]
    (unit,) = buf.to_memory()
    assert (unit.num_pages, unit.bytes_per_page) == (2, 2 * 1 * 2 * 1 * 2 * 2)
    # bf16 1.0 is 0x3F80: little-endian bytes (0x80, 0x3F).
    unit.buffer[0, :2] = torch.tensor([0x80, 0x3F], dtype=torch.uint8)
    assert buf.values[0][0].flatten().tolist() == [1.0] + [0.0] * 7
    buf.values[0][1, 1, 0, 1, 0, 1] = -2.0  # last element of page 1
    assert unit.buffer[1, -2:].view(torch.bfloat16).tolist() == [-2.0]


# ----------------------------------------------------------------- multi
def test_multi_buffer_tree_order() -> None:
    a = make_params(n_kv_heads=2, head_dim=2, devices=CPU2)
    b = fp8_params(n_kv_heads=2, devices=CPU2)
    c = make_params(is_mla=True, num_q_heads=2, head_dim=2, devices=CPU2)
    params = MultiKVCacheParams({"a": a, "sub": MultiKVCacheParams({"b": b, "c": c})})
    bufs = params.allocate_buffers(4)
    assert len(bufs) == 1 and isinstance(bufs[0], MultiKVCacheBuffer)
    tree = bufs[0]
    sub = tree.children["sub"]
    assert isinstance(sub, MultiKVCacheBuffer)
    la, lb, lc = tree.children["a"], sub.children["b"], sub.children["c"]
    assert tree.leaves() == [la, lb, lc]
    assert tree.total_num_pages == 4 and all(leaf.total_num_pages == 4 for leaf in tree.leaves())
    assert tree.all_buffers == [*la.values, *lb.values, *lb.scales, *lc.values]  # type: ignore[misc]
    units = tree.to_memory()
    # a: 2 shards; b: 2 values + 2 scales; c (MLA): 1 replicated unit.
    assert [type(u) for u in units] == [KVCacheMemory] * 6 + [ReplicatedKVCacheMemory]
    expected = [*la.values, *lb.values, *lb.scales, lc.values[0]]  # type: ignore[misc]
    assert [u.buffer.data_ptr() for u in units] == [t.data_ptr() for t in expected]


def test_multi_buffer_dp2() -> None:
    devices = [DeviceRef.CPU()] * 2
    a = make_params(head_dim=2, devices=devices, data_parallel_degree=2)
    b = make_params(head_dim=3, devices=devices, data_parallel_degree=2)
    bufs = MultiKVCacheParams({"a": a, "b": b}).allocate_buffers(2)
    assert len(bufs) == 2
    assert [[tuple(leaf.values[0].shape) for leaf in m.leaves()] for m in bufs] == [
        [(2, 2, 1, 4, 1, 2), (2, 2, 1, 4, 1, 3)]
    ] * 2
    assert bufs[0].leaves()[0].values[0].data_ptr() != bufs[1].leaves()[0].values[0].data_ptr()


def test_arena_groups_of_different_page_shapes_alias_one_pool() -> None:
    """Groups whose K/V shapes differ (Gemma 4: head 16 sliding, head 32 full) view one arena with their own
    shape; a page id's row is the larger page, and writing one group's page touches no other page id."""
    from pagedkv.dtype import DeviceRef, DType
    from pagedkv.params import KVCacheParams
    from pagedkv.runtime.arena import allocate_arena_buffers

    small, large = (
        KVCacheParams(
            dtype=DType.float32, n_kv_heads=2, head_dim=d, num_layers=1, page_size=4, devices=[DeviceRef.CPU()]
        )
        for d in (16, 32)
    )
    (buffer,) = allocate_arena_buffers(["group0", "group1"], [small, large], 5)
    (arena,) = buffer.arenas
    assert tuple(arena.shape) == (5, large.bytes_per_block_per_device)
    v0, v1 = buffer.children["group0"].values[0], buffer.children["group1"].values[0]
    assert tuple(v0.shape) == (5, *small.shape_per_block) and tuple(v1.shape) == (5, *large.shape_per_block)
    assert v0.data_ptr() == v1.data_ptr() == arena.data_ptr()
    v0[2] = 1.0
    assert arena[2, : small.bytes_per_block_per_device].any() and not arena[2, small.bytes_per_block_per_device :].any()
    assert not arena[[0, 1, 3, 4]].any()
    v1[3] = 2.0
    assert bool((v1[3] == 2.0).all()) and bool((v0[2] == 1.0).all())
