"""`MambaSpec`: vLLM's fields and arithmetic, page-size unification with attention, and the params round trip."""

from __future__ import annotations

import math

import pytest
import torch

from pagedkv.dtype import DeviceRef, DType
from pagedkv.interface import (
    FullAttentionSpec,
    MambaSpec,
    SchedulerLimits,
    get_kv_cache_config,
    kv_cache_config_from_params,
    params_from_kv_cache_config,
    unify_state_block_size,
)
from pagedkv.manager.paged import PagedKVCacheManager
from pagedkv.params.state import StateCacheParams

# a Qwen3.5-shaped gated delta net layer at TP 1: conv (2*16*128 + 32*128, K-1 = 3) bf16, state (32, 128, 128) fp32
GDN = dict(shapes=((8192, 3), (32, 128, 128)), dtypes=(torch.bfloat16, torch.float32), mamba_type="gdn_attn")
GDN_BYTES = 8192 * 3 * 2 + 32 * 128 * 128 * 4


def gdn(**kw) -> MambaSpec:
    return MambaSpec(block_size=16, **{**GDN, **kw})


def attention(block: int = 16) -> FullAttentionSpec:  # 4 KV heads x 256, bf16: 4096 bytes per token
    return FullAttentionSpec(block_size=block, num_kv_heads=4, head_size=256, dtype=DType.bfloat16)


def test_fields_and_arithmetic_match_vllm() -> None:
    spec = gdn(num_speculative_blocks=2)
    assert spec.dtypes == (DType.bfloat16, DType.float32)  # torch dtypes are converted
    assert spec.state_content_size_bytes == spec.real_page_size_bytes == spec.page_size_bytes == GDN_BYTES
    assert (spec.num_heads, spec.tokens_per_state, spec.mamba_cache_mode, spec.tp_replicated) == (1, -1, "none", False)
    limits = SchedulerLimits(max_model_len=4096)
    assert spec.max_memory_usage_bytes(limits) == GDN_BYTES * 3  # live slot + 2 draft slots ("none" mode)
    assert gdn(mamba_cache_mode="align").max_memory_usage_bytes(limits) == GDN_BYTES * 2
    assert gdn(page_size_padded=GDN_BYTES + 100).page_size_bytes == GDN_BYTES + 100
    assert gdn().copy_with_new_block_size(528).block_size == 528
    assert gdn().page_size_bytes == gdn().copy_with_new_block_size(528).page_size_bytes  # independent of block_size


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(shapes=((4, 3),), dtypes=(torch.float32, torch.float32)), "one dtype per state"),
        (dict(shapes=((4, 0),), dtypes=(torch.float32,)), "positive ints"),
        (dict(shapes=(), dtypes=()), "non-empty"),
        (dict(mamba_type="mamba3"), "mamba_type='mamba3'"),
        (dict(mamba_cache_mode="all"), "mamba_cache_mode='all'"),
        (dict(num_speculative_blocks=-1), "num_speculative_blocks=-1"),
        (dict(tokens_per_state=1), "tokens_per_state=1"),
        (dict(page_size_padded=10), "page_size_padded=10"),
    ],
)
def test_bad_specs_are_refused_by_name(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        gdn(**kwargs)


def test_attention_block_grows_until_a_page_holds_a_state() -> None:
    specs = {"l0": gdn(), "l1": gdn(), "l2": gdn(), "l3": attention()}
    unified = unify_state_block_size(specs)
    # vLLM's rule: block = 16 * ceil(state bytes / (16 * 4096)) -> 528 for Qwen3.5-9B's layers
    block = 16 * math.ceil(GDN_BYTES / (16 * 4096))
    assert block == 528 and {s.block_size for s in unified.values()} == {528}
    assert unify_state_block_size({"a": attention(), "b": attention()}) == {"a": attention(), "b": attention()}
    small = MambaSpec(block_size=16, shapes=((64, 3),), dtypes=(torch.bfloat16,), mamba_type="short_conv")
    assert unify_state_block_size({"a": attention(), "s": small})["a"].block_size == 16  # the state already fits
    with pytest.raises(ValueError, match="one block_size"):
        unify_state_block_size({"a": attention(16), "b": attention(32), "s": gdn()})


def test_kv_cache_config_groups_state_and_attention_layers_over_one_pool() -> None:
    specs = {f"layer{i}": attention() if i % 4 == 3 else gdn() for i in range(8)}
    config = get_kv_cache_config(specs, 1 << 30)
    groups = [(g.layer_names, type(g.kv_cache_spec).__name__) for g in config.kv_cache_groups]
    assert groups == [
        (["layer0", "layer4"], "MambaSpec"),
        (["layer1", "layer5"], "MambaSpec"),
        (["layer2", "layer6"], "MambaSpec"),
        (["layer3", "layer7"], "FullAttentionSpec"),
    ]
    page = 528 * 4096
    assert {g.kv_cache_spec.page_size_bytes for g in config.kv_cache_groups} == {page}  # state padded to the page
    assert config.kv_cache_groups[0].kv_cache_spec.page_size_padded == page
    assert config.num_blocks == (1 << 30) // (page * 2)


def test_multi_params_round_trips_a_state_group() -> None:
    specs = {f"layer{i}": attention() if i % 2 else gdn() for i in range(4)}
    config = get_kv_cache_config(specs, 1 << 28)
    params = params_from_kv_cache_config(config, [DeviceRef.CPU()], enable_prefix_caching=True)
    leaves = params.leaves()
    assert [type(leaf).__name__ for leaf in leaves] == ["StateCacheParams", "KVCacheParams"]
    assert isinstance(leaves[0], StateCacheParams) and leaves[0].num_layers == 2
    back = kv_cache_config_from_params(params, config.num_blocks)
    assert [g.kv_cache_spec for g in back.kv_cache_groups] == [g.kv_cache_spec for g in config.kv_cache_groups]
    assert back.num_blocks == config.num_blocks


def test_state_pages_are_sharded_over_tp_unless_replicated() -> None:
    spec = MambaSpec(block_size=16, shapes=((24, 3), (4, 8, 16)), dtypes=(torch.bfloat16, torch.float32))
    devices = [DeviceRef.CPU(), DeviceRef.CPU()]
    sharded = StateCacheParams.from_spec(spec, 2, devices)
    assert sharded.state_layout() == [(0, (12, 3), DType.bfloat16), (72, (2, 8, 16), DType.float32)]
    assert sharded.layer_bytes_per_device == 72 + 2 * 8 * 16 * 4
    odd = MambaSpec(block_size=16, shapes=((3, 3), (2,)), dtypes=(torch.bfloat16, torch.float32))
    assert odd.shard_layout() == [(0, (3, 3), DType.bfloat16), (20, (2,), DType.float32)]  # 18 bytes, then 4-aligned
    assert odd.shard_bytes() == 28 and odd.state_content_size_bytes == 26
    assert sharded.bytes_per_block == 2 * 2 * sharded.layer_bytes_per_device
    replicated = StateCacheParams.from_spec(MambaSpec(**{**spec.__dict__, "tp_replicated": True}), 2, devices)
    assert replicated.state_layout()[1][1] == (4, 8, 16) and replicated.replicates_kv_across_tp
    with pytest.raises(ValueError, match=r"tensor_parallel_degree=3"):
        StateCacheParams.from_spec(spec, 1, [DeviceRef.CPU()] * 3)
    with pytest.raises(TypeError, match="state_spec"):
        StateCacheParams(dtype=DType.uint8, n_kv_heads=1, head_dim=1, num_layers=1, devices=[DeviceRef.CPU()])


def test_runtime_inputs_give_each_state_group_its_slots() -> None:
    small = MambaSpec(block_size=4, shapes=((6, 3), (2, 4, 8)), dtypes=(torch.float32, torch.float32))
    specs = {"s0": small, "a1": FullAttentionSpec(block_size=4, num_kv_heads=2, head_size=16, dtype=DType.float32)}
    config = get_kv_cache_config(specs, 1 << 20)
    params = params_from_kv_cache_config(config, [DeviceRef.CPU()])
    manager = PagedKVCacheManager(params, None, 16, max_batch_size=4, enable_runtime_checks=True)
    from helpers import ctx

    a, b = ctx("a", range(9)), ctx("b", range(3))
    for c in (a, b):
        manager.claim(c.request_id)
        manager.alloc(c)
    tree = manager.runtime_inputs([[a, b]])
    state = tree.children["group0"].inputs[0]
    assert type(state).__name__ == "StateCacheInputs"
    slots = state.state_slots[:, 0].tolist()
    assert manager.num_state_rows == 4  # a live row per batch slot (no checkpoints without prefix caching)
    assert len(set(slots)) == 2 and 4 not in slots  # two distinct rows, neither the null row
    assert state.has_initial_state.tolist() == [False, False]
    conv, ssm = state.layer_states[0]
    assert conv.shape == (5, 6, 3) and ssm.shape == (5, 2, 4, 8)  # 4 state rows + the null row
    conv[slots[0]].fill_(1.0)
    ssm[slots[1]].fill_(2.0)  # a slot's bytes are its page's bytes: nothing else changes
    assert state.blocks[slots[0], 0].view(torch.float32)[: 6 * 3].eq(1.0).all()
    assert conv[slots[1]].eq(0).all() and ssm[slots[0]].eq(0).all()
    a.update(1)
    b.update(2)
    manager.step([[a, b]])
    assert manager.runtime_inputs([[a, b]]).children["group0"].inputs[0].has_initial_state.tolist() == [True, True]


@pytest.mark.parametrize("replicated", [False, True])
def test_each_tp_shard_holds_its_share_of_every_state(replicated: bool) -> None:
    """TP 2: a state group's inputs per shard view that shard's pages; a slot's rows are per shard."""
    spec = MambaSpec(block_size=4, shapes=((6, 3), (2, 4, 8)), dtypes=(torch.float32, torch.float32),
                     tp_replicated=replicated)  # fmt: skip
    attention = FullAttentionSpec(block_size=4, num_kv_heads=2, head_size=16, dtype=DType.float32)
    config = get_kv_cache_config({"s": spec, "a": attention}, 1 << 20)
    devices = [DeviceRef.CPU(), DeviceRef.CPU()]
    manager = PagedKVCacheManager(params_from_kv_cache_config(config, devices), None, 8, max_batch_size=2)
    from helpers import ctx

    a = ctx("a", range(5))
    manager.claim("a")
    manager.alloc(a)
    shards = manager.runtime_inputs([[a]]).children["group0"].inputs  # one record per TP shard
    assert len(shards) == 2
    rows = 6 if replicated else 3
    heads = 2 if replicated else 1
    for record in shards:
        conv, ssm = record.layer_states[0]
        assert conv.shape == (3, rows, 3) and ssm.shape == (3, heads, 4, 8)  # 2 live rows + the null row
    slot = int(shards[0].state_slots[0, 0])
    shards[0].layer_states[0][1][slot].fill_(5.0)
    assert shards[1].layer_states[0][1][slot].eq(0).all()  # shards do not alias each other


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(shapes=(3, 4), dtypes=(torch.float32,)), TypeError, r"shapes=\(3, 4\) must be a tuple of shapes"),
        (dict(dtypes=torch.float32), TypeError, "dtypes=torch.float32 must be a tuple"),
        (dict(page_size_padded=GDN_BYTES + 0.5), ValueError, "page_size_padded=.* must be an int"),
        (dict(num_heads=True), ValueError, "num_heads=True must be an int"),
        (dict(prefill_checkpoint_alignment=-3), ValueError, "prefill_checkpoint_alignment=-3"),
        (dict(tp_replicated=1), TypeError, "tp_replicated=1 must be a bool"),
    ],
)
def test_wrong_types_are_refused_by_name(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        gdn(**kwargs)


def test_symbolic_inputs_describe_the_state_inputs_runtime_inputs_gives() -> None:
    spec = MambaSpec(block_size=4, shapes=((6, 3), (2, 4, 8)), dtypes=(torch.float32, torch.float32),
                     num_speculative_blocks=1)  # fmt: skip
    attention = FullAttentionSpec(block_size=4, num_kv_heads=2, head_size=16, dtype=DType.float32)
    config = get_kv_cache_config({"s": spec, "a": attention}, 1 << 20)
    params = params_from_kv_cache_config(config, [DeviceRef.CPU()], num_eagle_speculative_tokens=1)
    manager = PagedKVCacheManager(params, None, 8, max_batch_size=2)
    from helpers import ctx

    a = ctx("a", range(5))
    manager.claim("a")
    manager.alloc(a)
    tensors = manager.runtime_inputs([[a]]).flatten()
    symbols = params.get_symbolic_inputs().flatten()
    assert len(tensors) == len(symbols)
    for tensor, symbol in zip(tensors, symbols, strict=True):
        assert tensor.dtype == symbol.dtype.to_torch(), symbol.name
        assert all(d is None or d == n for d, n in zip(symbol.static_dims, tensor.shape, strict=True)), symbol.name
    assert [s.name for s in symbols[:4]] == [
        "group0.r0_s0_state_blocks", "group0.r0_s0_cache_lengths", "group0.r0_s0_state_slots",
        "group0.r0_s0_has_initial_state",
    ]  # fmt: skip


def test_a_state_group_serves_one_live_state_per_request_not_vllms_align_mode() -> None:
    with pytest.raises(ValueError, match="mamba_cache_mode='align': pagedkv keeps one live state per request"):
        StateCacheParams.from_spec(gdn(mamba_cache_mode="align"), 1, [DeviceRef.CPU()])


def test_the_stamp_model_checks_state_slots_and_catches_a_mixed_up_one() -> None:
    """`PrefixStampModel` stamps each request's slot with its processed prefix and checks it next step."""
    from helpers import ctx
    from pagedkv.testing import PrefixStampModel

    spec = MambaSpec(block_size=4, shapes=((3, 2), (2,)), dtypes=(torch.float32, torch.float32))
    attention = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=2, dtype=DType.float32)
    config = get_kv_cache_config({"s": spec, "a": attention}, 1 << 20)
    manager = PagedKVCacheManager(params_from_kv_cache_config(config, [DeviceRef.CPU()]), None, 16, max_batch_size=2)
    model = PrefixStampModel(manager)
    a, b = ctx("a", range(6)), ctx("b", range(10, 13))
    for c in (a, b):
        manager.claim(c.request_id)
        manager.alloc(c)
    model.forward([[a, b]])  # first step: no slot is read, both are stamped
    checked = model.positions_checked
    a.update(1)
    b.update(2)
    manager.step([[a, b]])
    for c in (a, b):
        manager.alloc(c)
    model.forward([[a, b]])
    assert model.positions_checked - checked >= 2 * 2  # (K/V positions too) both slots, both state tensors
    a.update(3)
    b.update(4)
    manager.step([[a, b]])
    for c in (a, b):
        manager.alloc(c)
    state = manager.runtime_inputs([[a, b]]).children["group0"].inputs[0]
    slot_a, slot_b = state.state_slots[:, 0].tolist()
    conv = state.layer_states[0][0]
    conv[slot_a] = conv[slot_b].clone()  # a's conv state replaced by b's
    with pytest.raises(AssertionError, match="'a': its state slot holds another state"):
        model.forward([[a, b]])
