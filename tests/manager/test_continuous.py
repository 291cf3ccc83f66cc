"""ContinuousBatchingKVCacheManager: slots, ragged and padded inputs, multistep advance, planning."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from helpers import ctx, make_params
from pagedkv.core.context import TextContext
from pagedkv.core.errors import InsufficientBlocksError
from pagedkv.dtype import DeviceRef, DType
from pagedkv.manager.continuous import ContinuousBatchingKVCacheManager
from pagedkv.params import KVCacheParams, KVCacheQuantizationConfig
from pagedkv.params.symbols import PaddedKVCacheInputSymbols, RaggedKVCacheInputSymbols
from pagedkv.runtime.inputs import PaddedKVCacheInputs, RaggedKVCacheInputs

CPU2 = [DeviceRef.CPU(), DeviceRef.CPU()]
# fp32, 2 layers, 2 heads of dim 2: 2 (K, V) * 2 * 2 * 2 * 4 bytes = 64 bytes per token.
BYTES_PER_TOKEN = 64


def params(**overrides: Any) -> KVCacheParams:
    base: dict[str, Any] = dict(n_kv_heads=2, head_dim=2, num_layers=2)
    base.update(overrides)
    return make_params(**base)


def manager(batch: int = 4, seq: int = 8, ragged: bool = True, **overrides: Any) -> ContinuousBatchingKVCacheManager:
    p = params(**overrides)
    return ContinuousBatchingKVCacheManager(p, batch, seq, p.num_layers, p.devices, None, is_ragged=ragged)


def bind(m: ContinuousBatchingKVCacheManager, *contexts: TextContext) -> list[TextContext]:
    for c, seq_id in zip(contexts, m.claim(len(contexts)), strict=True):
        c.assign_to_cache(seq_id)
    return list(contexts)


# ----------------------------------------------------------------- slots
def test_claim_release_lowest_first() -> None:
    m = manager()
    assert m.claim(3) == [0, 1, 2]
    assert m.slots_remaining == {3}
    m.release(1)
    assert m.contains(0) and not m.contains(1)
    assert m.claim(1) == [1]
    with pytest.raises(InsufficientBlocksError, match=r"claim\(n=2\) but only 1 of 4 sequence slots remain") as e:
        m.claim(2)
    assert (e.value.needed, e.value.available) == (2, 1)
    assert m.slots_remaining == {3}
    m.slots_remaining.add(0)  # a copy
    assert m.contains(0)
    with pytest.raises(ValueError, match="Attempted to release seq_id 3 but it is not claimed"):
        m.release(3)


def test_external_claim_validation_is_all_or_nothing() -> None:
    m = manager()
    m.external_claim([2])
    for bad, msg in [
        ([0, 4], r"seq_id=4 must be an int in \[0, 4\)"),
        ([1, -1], r"seq_id=-1 must be an int in \[0, 4\)"),
        ([0, "1"], r"seq_id='1' must be an int"),
        ([1, 2], "seq_id=2 is already claimed"),
        ([0, 3, 0], r"seq_ids=\[0, 3, 0\] contains duplicates"),
    ]:
        with pytest.raises(ValueError, match=msg):
            m.external_claim(bad)
        assert m.slots_remaining == {0, 1, 3}  # nothing claimed by the failing call
    m.external_claim([3, 0])
    assert m.slots_remaining == {1} and m.claim(1) == [1]


def test_constructor_errors() -> None:
    with pytest.raises(ValueError, match="data_parallel_degree=2: build one manager per replica"):
        manager(devices=CPU2, data_parallel_degree=2)
    with pytest.raises(ValueError, match="enable_prefix_caching=True: prefix caching needs PagedKVCacheManager"):
        manager(enable_prefix_caching=True)
    with pytest.raises(ValueError, match="is_mla=True has no separate K and V caches; use is_ragged=True"):
        manager(ragged=False, is_mla=True, num_q_heads=2, n_kv_heads=1)
    with pytest.raises(ValueError, match="max_batch_size=0 must be at least 1"):
        manager(batch=0)
    with pytest.raises(TypeError, match="max_seq_len=8.0 must be an int"):
        manager(seq=8.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="params must be KVCacheParams, got dict"):
        ContinuousBatchingKVCacheManager({}, 1, 1, 2, [DeviceRef.CPU()], None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_layers=3 differs from params' 2 layers"):
        ContinuousBatchingKVCacheManager(params(), 1, 1, 3, [DeviceRef.CPU()], None)
    with pytest.raises(ValueError, match="differ from params.devices"):
        ContinuousBatchingKVCacheManager(params(), 1, 1, 2, CPU2, None)
    assert (
        ContinuousBatchingKVCacheManager(params(), 1, 1, 2, [DeviceRef.CPU()], session := object()).session is session
    )
    m = manager(batch=3, seq=5)
    # max_batch_size + 1 slots of max_seq_len tokens; the last is the null slot.
    assert tuple(m.buffer.values[0].shape) == (4, 2, 2, 5, 2, 2) and m.null_slot == 3


# ----------------------------------------------------------------- fetch (ragged)
def test_fetch_ragged_tables() -> None:
    m = manager(batch=4, seq=8)
    m.claim(1)  # slot 0 unused: the batch holds slots 1 and 2
    a, b = bind(m, ctx("a", range(5)), ctx("b", range(3)))
    a.update(7)  # a: 5 cached, 1 active (6 tokens)
    (inp,) = m.fetch([a, b], num_steps=3)
    assert isinstance(inp, RaggedKVCacheInputs) and inp.kv_scales is None
    assert inp.blocks is m.buffer.values[0] and tuple(inp.blocks.shape) == (5, 2, 2, 8, 2, 2)
    assert inp.lookup_table.dtype == torch.int32 and tuple(inp.lookup_table.shape) == (2, 24)
    assert inp.lookup_table.tolist() == [[1] + [4] * 23, [2] + [4] * 23]
    assert inp.cache_lengths.dtype == torch.int32 and inp.cache_lengths.tolist() == [5, 0]
    # max prompt = max(1, 3); max cache = max(5 + 1, 0 + 3) = 6, +1 per later step.
    assert inp.max_lengths.dtype == torch.int32 and inp.max_lengths.tolist() == [[3, 6], [1, 7], [1, 8]]
    # a needs 6 + 3 - 1 = 8 slots: fits; one more step does not.
    with pytest.raises(InsufficientBlocksError, match="request 'a' needs 9 token slots; max_seq_len=8") as e:
        m.fetch([a, b], num_steps=4)
    assert (e.value.needed, e.value.available) == (9, 8)


def test_fetch_rejects_bad_seq_ids() -> None:
    m = manager()
    (a,) = bind(m, ctx("a", [1, 2]))
    with pytest.raises(ValueError, match="request 'u' has cache_seq_id=None, which is not claimed"):
        m.fetch([a, ctx("u", [1])])
    stale = ctx("s", [1])
    stale.assign_to_cache(3)
    with pytest.raises(ValueError, match="request 's' has cache_seq_id=3, which is not claimed"):
        m.fetch([stale])
    twin = ctx("t", [1])
    twin.assign_to_cache(a.cache_seq_id)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"batch repeats sequence ids: \[0, 0\]"):
        m.fetch([a, twin])
    with pytest.raises(ValueError, match="request 'u' has cache_seq_id=None, which is not claimed"):
        m.step([ctx("u", [1])])
    m.step([a])  # claimed: no error


def test_fetch_ragged_two_shards_has_independent_tables() -> None:
    m = manager(devices=CPU2)
    a, b = bind(m, ctx("a", range(4)), ctx("b", range(2)))
    first, second = m.fetch([a, b])
    assert first.blocks is m.buffer.values[0] and second.blocks is m.buffer.values[1]
    assert tuple(first.blocks.shape) == (5, 2, 2, 8, 1, 2)  # 1 head per shard
    for name in ("lookup_table", "cache_lengths"):
        t0, t1 = getattr(first, name), getattr(second, name)
        assert torch.equal(t0, t1) and t0 is not t1 and t0.data_ptr() != t1.data_ptr()
    first.lookup_table[0, 0] = 99
    first.cache_lengths[1] = 42
    assert second.lookup_table[0].tolist() == [0] + [4] * 23 and second.cache_lengths.tolist() == [0, 0]


# ----------------------------------------------------------------- fetch (padded)
def test_fetch_padded_views_share_storage() -> None:
    m = manager(batch=3, seq=6, ragged=False)
    a, b = bind(m, ctx("a", [1, 2, 3]), ctx("b", [4, 5, 6]))
    a.update(9)
    b.update(9)
    (inp,) = m.fetch([a, b])
    assert isinstance(inp, PaddedKVCacheInputs)
    assert tuple(inp.k_cache.shape) == (2, 2, 6, 2, 2) and tuple(inp.v_cache.shape) == (2, 2, 6, 2, 2)
    assert inp.start_pos.dtype == torch.int64 and inp.start_pos.dim() == 0 and int(inp.start_pos) == 3
    assert inp.null_op.numel() == 0
    values = m.buffer.values[0]
    inp.k_cache[1, 0, 2, 1, 0] = 5.0
    inp.v_cache[0, 1, 5, 0, 1] = -3.0
    assert values[1, 0, 0, 2, 1, 0].item() == 5.0 and values[0, 1, 1, 5, 0, 1].item() == -3.0
    assert values.count_nonzero().item() == 2
    values[1, 1].fill_(7.0)
    assert (inp.v_cache[1] == 7.0).all() and not inp.k_cache[1].eq(7.0).any()


def test_fetch_padded_batch_rules() -> None:
    m = manager(batch=3, seq=6, ragged=False)
    a, b, c = bind(m, ctx("a", [1, 2]), ctx("b", [3, 4]), ctx("c", [5]))
    with pytest.raises(ValueError, match=r"padded batches must hold slots 0..1 in order, got \[1, 0\]"):
        m.fetch([b, a])
    with pytest.raises(ValueError, match=r"padded batches must hold slots 0..1 in order, got \[0, 2\]"):
        m.fetch([a, c])
    a.update(0)  # a: 2 cached, b: 0 cached
    with pytest.raises(ValueError, match=r"padded batches need equal cache lengths, got \[2, 0\]"):
        m.fetch([a, b])
    (inp,) = m.fetch([a])
    assert int(inp.start_pos) == 2 and tuple(inp.k_cache.shape) == (1, 2, 6, 2, 2)


# ----------------------------------------------------------------- increment_cache_lengths
def test_increment_ragged_advances_lengths_without_mutation() -> None:
    m = manager(devices=CPU2)
    a, b = bind(m, ctx("a", range(3)), ctx("b", range(2)))
    b.update(1)  # b: 2 cached, 1 active
    inputs = m.fetch([a, b], num_steps=3)
    step = SimpleNamespace(input_row_offsets=torch.tensor([0, 3, 4]))
    nxt = m.increment_cache_lengths(inputs, step)
    assert len(nxt) == 2
    for old, new in zip(inputs, nxt, strict=True):
        assert new is not old and new.cache_lengths.tolist() == [3, 3] and new.cache_lengths.dtype == torch.int32
        assert new.max_lengths.tolist() == [[1, 4], [1, 5]]
        assert new.lookup_table is old.lookup_table and new.blocks is old.blocks and new.kv_scales is None
        # the given inputs are unchanged
        assert old.cache_lengths.tolist() == [0, 2] and old.max_lengths.tolist() == [[3, 3], [1, 4], [1, 5]]
    with pytest.raises(ValueError, match="input_row_offsets has 2 entries; batch of 2 needs 3"):
        m.increment_cache_lengths(inputs, SimpleNamespace(input_row_offsets=torch.tensor([0, 3])))
    with pytest.raises(TypeError, match=r"prev_model_inputs.input_row_offsets must be a 1-D tensor \[batch \+ 1\]"):
        m.increment_cache_lengths(inputs, SimpleNamespace(tokens=torch.zeros(2, 1)))
    padded = PaddedKVCacheInputs(torch.zeros(1), torch.zeros(1), torch.tensor(0), torch.empty(0))
    with pytest.raises(TypeError, match="must all be RaggedKVCacheInputs or all PaddedKVCacheInputs"):
        m.increment_cache_lengths([inputs[0], padded], step)


def test_increment_ragged_on_meta_needs_no_host_sync() -> None:
    meta = torch.device("meta")
    inp = RaggedKVCacheInputs(
        blocks=torch.empty(5, 2, 2, 8, 2, 2, device=meta),
        cache_lengths=torch.empty(3, dtype=torch.int32, device=meta),
        lookup_table=torch.empty(3, 24, dtype=torch.int32, device=meta),
        max_lengths=torch.empty(4, 2, dtype=torch.int32, device=meta),
    )
    offsets = torch.empty(4, dtype=torch.int64, device=meta)  # .item()/.tolist() would raise here
    (new,) = manager().increment_cache_lengths([inp], SimpleNamespace(input_row_offsets=offsets))
    assert new.cache_lengths.is_meta and tuple(new.cache_lengths.shape) == (3,)
    assert new.cache_lengths.dtype == torch.int32
    assert new.max_lengths.is_meta and tuple(new.max_lengths.shape) == (3, 2)
    assert new.lookup_table is inp.lookup_table and new.blocks is inp.blocks


def test_increment_padded_advances_start_pos() -> None:
    m = manager(batch=2, seq=12, ragged=False)
    a, b = bind(m, ctx("a", [1, 2]), ctx("b", [3, 4]))
    inputs = m.fetch([a, b], num_steps=4)
    (new,) = m.increment_cache_lengths(inputs, SimpleNamespace(tokens=torch.zeros(2, 5, dtype=torch.int64)))
    assert isinstance(new, PaddedKVCacheInputs)
    assert int(new.start_pos) == 5 and int(inputs[0].start_pos) == 0
    assert new.k_cache is inputs[0].k_cache and new.v_cache is inputs[0].v_cache
    with pytest.raises(TypeError, match=r"prev_model_inputs.tokens must be a 2-D tensor \[batch, seq\]"):
        m.increment_cache_lengths(inputs, SimpleNamespace(input_row_offsets=torch.tensor([0, 1, 2])))


# ----------------------------------------------------------------- symbols
def fp8() -> dict[str, Any]:
    """FP8 overrides: head_dim 2, one float32 scale per head."""
    return dict(dtype=DType.float8_e4m3fn, kvcache_quant_config=KVCacheQuantizationConfig(quantization_granularity=2))


@pytest.mark.parametrize(
    "overrides", [{}, {"devices": CPU2}, fp8(), {"is_mla": True, "num_q_heads": 2, "n_kv_heads": 1, "devices": CPU2}]
)
def test_ragged_symbols_match_fetch(overrides: dict[str, Any]) -> None:
    m = manager(batch=3, seq=8, **overrides)
    quantized = "kvcache_quant_config" in overrides
    assert m.num_kv_inputs() == (5 if quantized else 4)
    batch = bind(m, ctx("a", range(4)), ctx("b", range(6)))
    inputs = m.fetch(batch, num_steps=2)
    symbols = m.input_symbols()
    assert len(symbols) == len(inputs) == len(m.devices)
    for sym, inp in zip(symbols, inputs, strict=True):
        assert isinstance(sym, RaggedKVCacheInputSymbols)
        specs, tensors = sym.flatten(), inp.flatten()
        assert len(specs) == len(tensors) == m.num_kv_inputs()
        for spec, tensor in zip(specs, tensors, strict=True):
            assert DType.from_torch(tensor.dtype) == spec.dtype, spec.name
            assert len(spec.static_dims) == tensor.dim(), spec.name
            for dim, size in zip(spec.static_dims, tensor.shape, strict=True):
                assert dim is None or dim == size, spec.name


def test_padded_symbols_match_fetch() -> None:
    m = manager(batch=2, seq=4, ragged=False, devices=CPU2)
    assert m.num_kv_inputs() == 4
    inputs = m.fetch(bind(m, ctx("a", [1]), ctx("b", [2])))
    symbols = m.input_symbols()
    assert len(symbols) == 2
    for sym, inp in zip(symbols, inputs, strict=True):
        assert isinstance(sym, PaddedKVCacheInputSymbols)
        assert [s.static_dims for s in sym.flatten()] == [(None, 2, 4, 1, 2), (None, 2, 4, 1, 2), (), (0,)]
        for spec, tensor in zip(sym.flatten(), inp.flatten(), strict=True):
            assert DType.from_torch(tensor.dtype) == spec.dtype
            assert all(d is None or d == s for d, s in zip(spec.static_dims, tensor.shape, strict=True))


def test_num_kv_inputs_fp8_padded_is_four() -> None:
    assert manager(ragged=False, **fp8()).num_kv_inputs() == 4


# ----------------------------------------------------------------- planning
def test_estimated_memory_size() -> None:
    cls = ContinuousBatchingKVCacheManager
    p = params()
    cpu = [DeviceRef.CPU()]
    # 4 slots + the null slot, 100 tokens each (MAX's signature: every argument given).
    assert cls.estimated_memory_size(p, 4, 100, 2, 10**6, cpu) == 5 * 100 * BYTES_PER_TOKEN == 32000
    kw = dict(max_batch_size=4, max_seq_len=100, num_layers=2, available_cache_memory=0)
    assert cls.estimated_memory_size(p, devices=cpu, **kw) == 32000  # type: ignore[arg-type]
    # Two TP shards of one head each hold the same total.
    assert cls.estimated_memory_size(params(devices=CPU2), 4, 100, 2, 0, CPU2) == 32000
    with pytest.raises(ValueError, match="num_layers=3 differs from params' 2 layers"):
        cls.estimated_memory_size(p, 4, 100, 3, 0, cpu)
    with pytest.raises(ValueError, match="differ from params.devices"):
        cls.estimated_memory_size(p, 4, 100, 2, 0, CPU2)


def test_infer_optimal_batch_size() -> None:
    cls = ContinuousBatchingKVCacheManager
    p = params()
    cpu = [DeviceRef.CPU()]
    slot = 100 * BYTES_PER_TOKEN
    for k in (1, 3, 10):
        assert cls.infer_optimal_batch_size(p, 100, 2, (k + 1) * slot, cpu) == k
        assert cls.infer_optimal_batch_size(p, 100, 2, available_cache_memory=(k + 2) * slot - 1, devices=cpu) == k
    with pytest.raises(InsufficientBlocksError, match="available_cache_memory=12799 holds no slot of 6400 bytes") as e:
        cls.infer_optimal_batch_size(p, 100, 2, 2 * slot - 1, cpu)
    assert (e.value.needed, e.value.available) == (12800, 12799)
    with pytest.raises(TypeError, match="available_cache_memory=None must be an int"):
        cls.infer_optimal_batch_size(p, 100, 2, None, cpu)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_layers=1 differs"):
        cls.infer_optimal_batch_size(p, 100, 1, 10**6, cpu)


def test_bools_are_not_ids_or_counts() -> None:
    from pagedkv.manager.continuous import ContinuousBatchingKVCacheManager
    from pagedkv.runtime.buffers import allocate_kv_buffers

    p = make_params()
    mgr = ContinuousBatchingKVCacheManager(p, max_batch_size=4, max_seq_len=8, num_layers=p.num_layers,
                                           devices=p.devices, session=None)  # fmt: skip
    with pytest.raises(ValueError, match=r"seq_id=True must be an int in \[0, 4\)"):
        mgr.external_claim([True])
    assert mgr.slots_remaining == {0, 1, 2, 3}
    with pytest.raises(TypeError, match="total_num_pages=True must be an int"):
        allocate_kv_buffers(make_params(), True)
