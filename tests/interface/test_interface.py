"""vLLM's KV cache interface: specs, grouping into one shared pool, and the bridge to MultiKVCacheParams."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pagedkv.dtype import DeviceRef, DType
from pagedkv.interface import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheLayout,
    KVQuantMode,
    MLAAttentionSpec,
    SchedulerLimits,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
    TQFullAttentionSpec,
    UniformTypeKVCacheSpecs,
    compute_layer_kv_cache_shape_bytes,
    get_kv_cache_config,
    get_kv_quant_mode,
    group_layer_specs,
    kv_cache_config_from_params,
    kv_cache_uses_per_token_head_scales,
    num_states_for,
    params_from_kv_cache_config,
    reshape_kv_cache,
    spec_from_params,
)
from pagedkv.params import KVCacheParams
from pagedkv.params.multi import MultiKVCacheParams

BF16 = DType.bfloat16
FULL = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=BF16)
SWA = SlidingWindowSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=BF16, sliding_window=1024)
LIMITS = SchedulerLimits(max_model_len=8192, max_num_batched_tokens=512, max_num_encoder_input_tokens=1500)


def test_page_sizes() -> None:
    assert FULL.page_size_bytes == 16 * 8 * (128 + 128) * 2 == 65536
    assert MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=BF16).page_size_bytes == 16 * 576 * 2
    assert (
        TQFullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=BF16, tq_slot_size=100).page_size_bytes
        == 16 * 8 * 100
    )
    per_token = dataclasses.replace(FULL, kv_quant_mode=KVQuantMode.FP8_PER_TOKEN_HEAD, dtype=DType.float8_e4m3fn)
    assert per_token.page_size_bytes == 16 * 8 * 256 + 2 * 16 * 8 * 4
    padded = dataclasses.replace(FULL, page_size_padded=70000)
    assert padded.page_size_bytes == 70000 and padded.real_page_size_bytes == 65536
    assert padded.copy_with_new_block_size(32).page_size_padded == 140000
    with pytest.raises(ValueError, match="page_size_padded=100 < real page size 65536"):
        dataclasses.replace(FULL, page_size_padded=100)


def test_max_memory_and_admission() -> None:
    assert FULL.max_admission_blocks_per_request(LIMITS) == 512
    assert SWA.max_admission_blocks_per_request(LIMITS) == -(-(1023 + 512) // 16) + 1 == 97
    chunk = ChunkedLocalAttentionSpec(
        block_size=16, num_kv_heads=8, head_size=128, dtype=BF16, attention_chunk_size=256
    )
    assert chunk.max_admission_blocks_per_request(LIMITS) == 48 + 1
    cross = CrossAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=BF16)
    assert cross.max_memory_usage_bytes(LIMITS) == 94 * 65536
    sink = SinkFullAttentionSpec(
        block_size=16, num_kv_heads=8, head_size=128, dtype=BF16, sliding_window=1024, sink_len=4
    )
    assert sink.kind == "sink" and sink.max_admission_blocks_per_request(LIMITS) == 1 + 96 + 1
    assert SWA.max_memory_usage_bytes(LIMITS) == 97 * 65536


def test_merge_and_uniform_types() -> None:
    recorded = dataclasses.replace(FULL, sliding_window=512)
    merged = FullAttentionSpec.merge([FULL, recorded, FULL])
    assert merged.sliding_window == 512 and merged.kind == "full"
    with pytest.raises(ValueError, match="one window size"):
        FullAttentionSpec.merge([recorded, dataclasses.replace(FULL, sliding_window=256)])
    with pytest.raises(ValueError, match="same attention spec"):
        FullAttentionSpec.merge([FULL, dataclasses.replace(FULL, num_kv_heads=4)])
    assert UniformTypeKVCacheSpecs.is_uniform_type({"a": FULL, "b": recorded})
    assert not UniformTypeKVCacheSpecs.is_uniform_type({"a": FULL, "b": SWA})
    both = UniformTypeKVCacheSpecs.from_specs({"a": FULL, "b": dataclasses.replace(FULL, head_size=64, head_size_v=64)})
    assert both is not None and both.page_size_bytes == 65536 + 32768
    assert UniformTypeKVCacheSpecs.from_specs({"a": FULL, "b": SWA}) is None


def test_quant_modes() -> None:
    assert get_kv_quant_mode("auto") is KVQuantMode.NONE
    assert get_kv_quant_mode("fp8_e4m3") is KVQuantMode.FP8_PER_TENSOR
    assert get_kv_quant_mode("fp8_per_token_head") is KVQuantMode.FP8_PER_TOKEN_HEAD
    assert kv_cache_uses_per_token_head_scales("int8_per_token_head") and not kv_cache_uses_per_token_head_scales("fp8")


def test_gemma3_like_grouping_shares_one_pool() -> None:
    specs = {f"l{i}": (FULL if i % 6 == 5 else SWA) for i in range(12)}  # 10 sliding + 2 full, 5:1
    config = get_kv_cache_config(specs, available_memory_bytes=2 * 65536 * 100 + 5)
    assert [len(g.layer_names) for g in config.kv_cache_groups] == [2] * 6
    kinds = [g.kv_cache_spec.kind for g in config.kv_cache_groups]
    assert kinds.count("sliding") == 5 and kinds.count("full") == 1
    assert config.num_blocks == 100 and config.group_size == 2 and config.bytes_per_block == 2 * 65536
    [tensor] = config.kv_cache_tensors
    assert tensor.size == 100 * 2 * 65536 and len(tensor.shared_by) == 2 and len(tensor.shared_by[0]) == 6
    slots = config.layer_slot()
    assert sorted(slots) == sorted(specs) and slots["l5"][1] in (0, 1)
    sliding_groups = [g for g in config.kv_cache_groups if g.kv_cache_spec.kind == "sliding"]
    assert sliding_groups[0].layer_names == ["l0", "l6"]  # layers[i::num_groups], as vLLM splits them


def test_mixed_page_sizes_are_padded() -> None:
    small = dataclasses.replace(SWA, num_kv_heads=4)
    config = get_kv_cache_config({"a": FULL, "b": small}, 10 * 65536)
    assert {g.kv_cache_spec.page_size_bytes for g in config.kv_cache_groups} == {65536}
    with pytest.raises(ValueError, match="one block_size"):
        get_kv_cache_config({"a": FULL, "b": FULL.copy_with_new_block_size(32)}, 10**9)
    with pytest.raises(ValueError, match="holds no block"):
        get_kv_cache_config({"a": FULL}, 100)


def test_shapes_and_reshape_share_storage() -> None:
    assert num_states_for(FULL) == 16 and compute_layer_kv_cache_shape_bytes(FULL, 10) == (10, 8, 16, 512)
    spec = FullAttentionSpec(block_size=2, num_kv_heads=2, head_size=2, dtype=DType.float32)
    raw = torch.zeros(3 * 4 * 2 * 2 * 16, dtype=torch.uint8)  # 3 slots, 4 blocks, 2 heads, 2 states, 16 bytes
    for layout in KVCacheLayout:
        views = reshape_kv_cache(raw, spec, 4, 3, layout)
        assert len(views) == 3 and views[1].shape == (4, 2, 2, 4) and views[1].dtype == torch.float32
        views[2][3, 1, 0, 2] = 7.0
        assert raw.view(torch.float32).sum() == 7.0
        raw.zero_()


def test_bridge_round_trip() -> None:
    cpu = [DeviceRef.CPU()]
    specs = {f"l{i}": (FULL if i % 2 else SWA) for i in range(4)}
    config = get_kv_cache_config(specs, 10 * 2 * 65536)
    tree = params_from_kv_cache_config(config, cpu, enable_prefix_caching=True)
    assert isinstance(tree, MultiKVCacheParams) and [c.attention_kind for c in tree.leaves()] == ["sliding", "full"]
    assert all(leaf.num_layers == 2 and leaf.enable_prefix_caching for leaf in tree.leaves())
    back = kv_cache_config_from_params(tree, config.num_blocks)
    assert [g.kv_cache_spec for g in back.kv_cache_groups] == [g.kv_cache_spec for g in config.kv_cache_groups]
    mla = KVCacheParams(dtype=BF16, n_kv_heads=1, head_dim=576, num_layers=3, devices=cpu, is_mla=True, num_q_heads=16)
    assert isinstance(spec_from_params(mla), MLAAttentionSpec)
    cross = KVCacheParams(dtype=BF16, n_kv_heads=8, head_dim=128, num_layers=3, devices=cpu, is_cross_attention=True)
    assert isinstance(spec_from_params(cross), CrossAttentionSpec)
    assert kv_cache_config_from_params(cross, 7).kv_cache_groups[0].layer_names == ["cache.0", "cache.1", "cache.2"]


def test_group_layer_specs_by_shape_splits_one_type_of_two_shapes() -> None:
    """Gemma 4: full layers with a larger head than the sliding ones; `by_shape` keeps one page shape per group
    (three types of 2, 1, 1 layers: groups of one layer, as vLLM sizes them)."""
    wide = dataclasses.replace(FULL, head_size=256)
    specs = {"0": SWA, "1": FULL, "2": wide, "3": SWA}
    assert [names for names, _ in group_layer_specs(specs)] == [["0", "3"], ["1", "2"]]
    grouped = group_layer_specs(specs, by_shape=True)
    assert [(names, spec) for names, spec in grouped] == [(["0"], SWA), (["3"], SWA), (["1"], FULL), (["2"], wide)]
