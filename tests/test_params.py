"""KVCacheParams / MultiKVCacheParams: derived values and every validation error."""

from __future__ import annotations

import dataclasses

import pytest

from helpers import make_params
from pagedkv.dtype import DeviceRef, DType
from pagedkv.params import KVCacheParams, KVCacheQuantizationConfig, KVConnectorType
from pagedkv.params.multi import MultiKVCacheParams

CPU = DeviceRef.CPU()


def gpus(n: int) -> list[DeviceRef]:
    return [DeviceRef.GPU(i) for i in range(n)]


@pytest.mark.parametrize(
    "n_devices,dp,heads,expected",
    [(1, 1, 8, 8), (2, 1, 8, 4), (4, 1, 8, 2), (8, 1, 8, 1), (2, 2, 8, 8), (8, 2, 8, 2), (4, 4, 4, 4)],
)
def test_kv_heads_per_device(n_devices: int, dp: int, heads: int, expected: int) -> None:
    p = make_params(n_kv_heads=heads, devices=gpus(n_devices), data_parallel_degree=dp)
    assert p.n_kv_heads_per_device == expected
    assert p.tensor_parallel_degree == n_devices // dp
    assert p.n_devices == n_devices
    assert p.devices_per_replica == [
        gpus(n_devices)[r * (n_devices // dp) : (r + 1) * (n_devices // dp)] for r in range(dp)
    ]


def test_data_parallel_errors_match_max_wording() -> None:
    with pytest.raises(
        ValueError, match=r"Data parallelism degree \(4\) cannot be greater than the number of devices \(2\)"
    ):
        make_params(devices=gpus(2), data_parallel_degree=4)
    with pytest.raises(ValueError, match=r"Number of devices \(8\) must be divisible by data parallelism degree \(3\)"):
        make_params(devices=gpus(8), data_parallel_degree=3, n_kv_heads=8)
    with pytest.raises(ValueError, match="data_parallel_degree=0 must be at least 1"):
        make_params(data_parallel_degree=0)


def test_heads_must_divide_tp() -> None:
    with pytest.raises(
        ValueError, match=r"Number of KV heads \(8\) must be divisible by the tensor parallel degree \(3\)"
    ):
        make_params(n_kv_heads=8, devices=gpus(3))


def test_mla_rules() -> None:
    with pytest.raises(ValueError, match="is_mla=True needs num_q_heads"):
        make_params(is_mla=True)
    with pytest.raises(ValueError, match="n_kv_heads=4 must be 1 for MLA"):
        make_params(is_mla=True, num_q_heads=16, n_kv_heads=4)
    with pytest.raises(ValueError, match=r"query heads \(16\) must be divisible by the tensor parallel degree \(3\)"):
        make_params(is_mla=True, num_q_heads=16, devices=gpus(3))
    p = make_params(is_mla=True, num_q_heads=16, head_dim=576, devices=gpus(8), dtype=DType.bfloat16, page_size=128)
    assert (p.kv_dim, p.n_kv_heads_per_device, p.num_q_heads_per_device) == (1, 1, 2)
    assert p.shape_per_block == [1, 1, 128, 1, 576]
    assert p.replicates_kv_across_tp
    one = dataclasses.replace(p, devices=gpus(1))
    assert p.bytes_per_block == 8 * one.bytes_per_block == 8 * 128 * 576 * 2  # every shard holds a copy


def test_gqa_query_heads_must_be_multiple_of_kv_heads() -> None:
    with pytest.raises(ValueError, match=r"num_q_heads=12 must be a multiple of n_kv_heads=8"):
        make_params(n_kv_heads=8, num_q_heads=12)
    assert make_params(n_kv_heads=8, num_q_heads=32, devices=gpus(4)).num_q_heads_per_device == 8


def test_bytes_per_block_examples_from_max() -> None:
    one_mib = make_params(n_kv_heads=8, head_dim=128, num_layers=1, page_size=128)
    assert one_mib.bytes_per_block == 2 * 1 * 128 * 8 * 128 * 4 == 1024 * 1024
    assert make_params(n_kv_heads=1, head_dim=24, num_layers=17, page_size=128).bytes_per_block == 417792
    # MHA heads are sharded, so the replica total does not depend on TP.
    assert dataclasses.replace(one_mib, devices=gpus(8)).bytes_per_block == one_mib.bytes_per_block
    assert one_mib.bytes_per_token == 8192


def test_shapes_and_fp8_scales() -> None:
    qc = KVCacheQuantizationConfig(scale_dtype=DType.float32, quantization_granularity=64)
    p = make_params(
        dtype=DType.float8_e4m3fn, n_kv_heads=8, head_dim=128, num_layers=2, page_size=16, kvcache_quant_config=qc
    )
    assert p.quantized_kv_cache and p.is_fp8_kv_dtype
    assert p.shape_per_block == [2, 2, 16, 8, 128]
    assert p.shape_per_scale_block == [2, 2, 16, 8, 2]
    assert p.bytes_per_block == 2 * 2 * 16 * 8 * 128 * 1 + 2 * 2 * 16 * 8 * 2 * 4
    with pytest.raises(ValueError, match="head_dim=96 must be divisible by quantization_granularity=64"):
        dataclasses.replace(p, head_dim=96)
    bare = make_params(dtype=DType.float8_e4m3fnuz)
    assert bare.is_fp8_kv_dtype and not bare.quantized_kv_cache
    e8 = make_params(
        dtype=DType.float8_e4m3fn,
        head_dim=128,
        kvcache_quant_config=KVCacheQuantizationConfig(scale_dtype=DType.float8_e8m0fnu),
    )
    assert e8.quantized_kv_cache
    no_scales = make_params(
        dtype=DType.float8_e4m3fn, kvcache_quant_config=KVCacheQuantizationConfig(scale_dtype=DType.bfloat16)
    )
    assert no_scales.is_fp8_kv_dtype and not no_scales.quantized_kv_cache
    with pytest.raises(ValueError, match="kvcache_quant_config is set but dtype=bfloat16 is not an FP8 KV dtype"):
        make_params(dtype=DType.bfloat16, kvcache_quant_config=qc)
    with pytest.raises(ValueError, match="quantization_granularity=0 must be at least 1"):
        KVCacheQuantizationConfig(quantization_granularity=0)


def test_dtype_shorthand() -> None:
    assert make_params(dtype=DType.bfloat16).dtype_shorthand == "bf16"
    assert make_params(dtype=DType.float32).dtype_shorthand == "f32"
    # MAX's KVCacheParams: "bf16" for bfloat16, "f32" otherwise (even for float16 and FP8).
    assert make_params(dtype=DType.float16).dtype_shorthand == "f32"


def test_connector_rules() -> None:
    with pytest.raises(ValueError, match="kv_connector=local requires prefix caching to be enabled"):
        make_params(kv_connector=KVConnectorType.local, host_kvcache_swap_space_gb=1.0)
    with pytest.raises(ValueError, match="kv_connector=tiered requires host_kvcache_swap_space_gb to be set"):
        make_params(kv_connector="tiered", enable_prefix_caching=True)
    with pytest.raises(ValueError, match="kv_connector=redis requires prefix caching"):
        make_params(kv_connector="redis")
    with pytest.raises(
        ValueError, match=r"kv_connector='lmcache' must be one of \['null', 'local', 'tiered', 'redis'\]"
    ):
        make_params(kv_connector="lmcache")
    for bad in (-1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=rf"host_kvcache_swap_space_gb={bad!r} must be a finite number > 0"):
            make_params(host_kvcache_swap_space_gb=bad)
    p = make_params(kv_connector="local", enable_prefix_caching=True, host_kvcache_swap_space_gb=0.5)
    assert p.kv_connector is KVConnectorType.local


@pytest.mark.parametrize("page_size", [1, 2, 3, 13, 777])
def test_any_page_size_from_one(page_size: int) -> None:
    assert make_params(page_size=page_size).shape_per_block[2] == page_size


@pytest.mark.parametrize(
    "field,value,error,message",
    [
        ("dtype", "bfloat16", TypeError, "dtype='bfloat16' must be a pagedkv.DType"),
        ("n_kv_heads", 0, ValueError, "n_kv_heads=0 must be at least 1"),
        ("head_dim", 2.0, TypeError, "head_dim=2.0 must be an int"),
        ("num_layers", True, TypeError, "num_layers=True must be an int"),
        ("page_size", 0, ValueError, "page_size=0 must be at least 1"),
        ("num_eagle_speculative_tokens", -1, ValueError, "num_eagle_speculative_tokens=-1 must be at least 0"),
        ("devices", [], TypeError, "devices=.* must be a non-empty sequence of DeviceRef"),
        ("devices", ["cpu"], TypeError, "must be a non-empty sequence of DeviceRef"),
        ("enable_prefix_caching", 1, TypeError, "enable_prefix_caching=1 must be a bool"),
        ("kv_hash_algo", "md5", ValueError, "kv_hash_algo='md5' must be one of"),
        ("kv_hash_seed", b"short", ValueError, "kv_hash_seed has 5 bytes; it must have exactly 32"),
        ("kv_hash_seed", "zz", ValueError, "kv_hash_seed='zz' is not hex"),
        ("kv_hash_seed", 7, TypeError, "kv_hash_seed=7 must be bytes, a hex str or None"),
        ("kvcache_quant_config", {"scale_dtype": "f32"}, TypeError, "must be a KVCacheQuantizationConfig"),
    ],
)
def test_validation_errors(field: str, value: object, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        make_params(**{field: value})


def test_hash_seed_forms_and_defaults() -> None:
    assert make_params().kv_hash_algo == "sha256"
    assert make_params(kv_hash_seed="ab" * 32).kv_hash_seed == bytes([0xAB]) * 32
    assert make_params(kv_hash_seed=bytes(range(32))).kv_hash_seed == bytes(range(32))


def test_params_are_frozen_and_copy_as_dp_1() -> None:
    p = make_params(n_kv_heads=8, devices=gpus(8), data_parallel_degree=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.page_size = 8  # type: ignore[misc]
    r1 = p.copy_as_dp_1(1)
    assert (r1.devices, r1.data_parallel_degree, r1.n_kv_heads_per_device) == (tuple(gpus(8)[4:]), 1, 2)
    with pytest.raises(ValueError, match=r"replica_idx=2 must be in \[0, 2\)"):
        p.copy_as_dp_1(2)


def test_symbolic_inputs() -> None:
    p = make_params(n_kv_heads=4, head_dim=8, num_layers=3, devices=gpus(4), data_parallel_degree=2, page_size=16)
    sym = p.get_symbolic_inputs("m.")
    assert len(sym.inputs) == 4 and len(sym.flatten()) == 16
    first = sym.inputs[0]
    assert first.blocks.shape == ("total_num_pages", 2, 3, 16, 2, 8) and first.blocks.dtype == DType.float32
    assert first.cache_lengths.shape == ("replica_0_batch_size",)
    assert sym.inputs[2].lookup_table.shape == ("replica_1_batch_size", "replica_1_max_num_pages")
    assert first.max_lengths.shape == ("num_steps", 2) and first.max_lengths.device == CPU
    assert sym.inputs[3].blocks.device == DeviceRef.GPU(3) and first.blocks.name == "m.r0_s0_kv_blocks"
    assert first.blocks.static_dims == (None, 2, 3, 16, 2, 8)


def test_multi_params() -> None:
    a = make_params(n_kv_heads=2, head_dim=4)
    b = make_params(n_kv_heads=1, head_dim=8, num_layers=3)
    multi = MultiKVCacheParams({"target": a, "draft": MultiKVCacheParams({"b": b})})
    assert multi.bytes_per_block == a.bytes_per_block + b.bytes_per_block
    assert multi.leaves() == [a, b] and multi.page_size == 4
    sym = multi.get_symbolic_inputs()
    assert list(sym.children) == ["target", "draft"]
    assert [t.name for t in sym.flatten()][:1] == ["target.r0_s0_kv_blocks"]
    assert sym.flatten()[4].name == "draft.b.r0_s0_kv_blocks"
    with pytest.raises(ValueError, match="requires at least one param"):
        MultiKVCacheParams({})
    with pytest.raises(ValueError, match="same page size: 4 != 8"):
        MultiKVCacheParams({"a": a, "b": make_params(page_size=8)})
    with pytest.raises(ValueError, match="same data parallel degree"):
        MultiKVCacheParams(
            {"a": make_params(n_kv_heads=2, devices=gpus(2)), "b": make_params(devices=gpus(2), data_parallel_degree=2)}
        )
    with pytest.raises(TypeError, match=r"children\['x'\]=int must be KVCacheParams or MultiKVCacheParams"):
        MultiKVCacheParams({"x": 3})  # type: ignore[dict-item]
    with pytest.raises(dataclasses.FrozenInstanceError):
        multi.children = {}  # type: ignore[misc]
    assert multi.copy_as_dp_1(0).leaves() == [a, b]


def test_construction_by_keyword_and_position() -> None:
    p = KVCacheParams(DType.bfloat16, 8, 128, 32, [CPU], True)
    assert p.enable_prefix_caching and p.page_size == 128 and p.n_kv_heads_per_device == 8
