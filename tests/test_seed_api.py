"""MAX's and vLLM's documented API, exactly: every signature their reference pages print for
`KVCacheParams`, `max.nn.kv_cache.manager`, `KVCacheBuffer`, `PagedKVCacheManager` and
`vllm.v1.kv_cache_interface`, checked with `inspect.signature`.

The signatures are transcribed from those pages as the text they print, e.g.
``(params, session, total_num_pages, ...)``; each table names its page. Two rules:

- EXACT rows: pagedkv's parameters are the documented ones, same names, order, kinds and defaults.
- COMPATIBLE rows: the documented parameters come first, same names, order and kinds; where the
  documentation gives a default pagedkv has the same one (pagedkv may add a default where it has
  none, e.g. ``replica_idx=0``); every extra parameter has a default. Code written against the
  documentation runs unchanged.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from typing import Any

import pytest
import torch

from helpers import ctx, make_params
from pagedkv import specs
from pagedkv.core.errors import MissingPagesError
from pagedkv.dtype import DeviceRef, DType
from pagedkv.interface import config as interface_config
from pagedkv.manager.base import KVCacheManager
from pagedkv.manager.continuous import ContinuousBatchingKVCacheManager
from pagedkv.manager.paged import PagedKVCacheManager
from pagedkv.params import BatchCharacteristics, KVCacheParamInterface, KVCacheParams
from pagedkv.params.multi import MultiKVCacheParams
from pagedkv.runtime.buffers import KVCacheBuffer
from pagedkv.runtime.inputs import KVCacheInputsSequence, PaddedKVCacheInputs, RaggedKVCacheInputs

EXACT, COMPATIBLE = "exact", "compatible"

# MAX's KVCacheParams: max.nn.kv_cache.KVCacheParams.
SEED_000: list[tuple[Any, str, str]] = [
    (
        KVCacheParams,
        "(dtype, n_kv_heads, head_dim, num_layers, devices, enable_prefix_caching=False, kv_connector=None, "
        "kv_connector_config=None, host_kvcache_swap_space_gb=None, page_size=128, is_mla=False, num_q_heads=None, "
        "data_parallel_degree=1, n_kv_heads_per_device=0, num_q_heads_per_device=None, kvcache_quant_config=None, "
        "num_eagle_speculative_tokens=0)",
        COMPATIBLE,  # pagedkv adds defaulted fields after the seed's (hash algorithm, eviction policy, ...)
    ),
    (KVCacheParams.allocate_buffers, "(total_num_pages)", EXACT),
    (KVCacheParams.copy_as_dp_1, "(replica_idx=0)", EXACT),
    (KVCacheParams.get_symbolic_inputs, "(prefix='')", EXACT),
]
SEED_000_PROPERTIES = [
    "bytes_per_block", "dtype_shorthand", "is_fp8_kv_dtype", "n_devices", "quantized_kv_cache",
    "shape_per_block", "shape_per_scale_block", "tensor_parallel_degree",
]  # fmt: skip

# The documented API of max.nn.kv_cache.manager (KVCacheManager and its input records).
SEED_001: list[tuple[Any, str, str]] = [
    (KVCacheManager, "(params, max_batch_size, max_seq_len, num_layers, devices, session, is_ragged=False)", EXACT),
    (ContinuousBatchingKVCacheManager, "(params, max_batch_size, max_seq_len, num_layers, devices, session, is_ragged=False)", EXACT),
    (KVCacheManager.claim, "(n)", EXACT),
    (KVCacheManager.contains, "(seq_id)", EXACT),
    (KVCacheManager.estimated_memory_size,
     "(params, max_batch_size, max_seq_len, num_layers, available_cache_memory, devices, **kwargs)", EXACT),
    (KVCacheManager.external_claim, "(seq_ids)", EXACT),
    (KVCacheManager.fetch, "(batch, num_steps=1)", EXACT),
    (KVCacheManager.increment_cache_lengths, "(kv_cache_inputs, prev_model_inputs)", EXACT),
    (KVCacheManager.infer_optimal_batch_size,
     "(params, max_seq_len, num_layers, available_cache_memory, devices, **kwargs)", EXACT),
    (KVCacheManager.input_symbols, "()", EXACT),
    (KVCacheManager.num_kv_inputs, "()", EXACT),
    (KVCacheManager.release, "(seq_id)", EXACT),
    (KVCacheManager.step, "(batch)", EXACT),
    (KVCacheInputsSequence, "(kv_cache_inputs)", EXACT),
    (PaddedKVCacheInputs, "(k_cache, v_cache, start_pos, null_op)", EXACT),
    (RaggedKVCacheInputs, "(blocks, cache_lengths, lookup_table, max_lengths)", COMPATIBLE),  # + kv_scales=None
    # The same planning signatures on the concrete managers (MAX's documentation names none for PagedKVCacheManager).
    (ContinuousBatchingKVCacheManager.estimated_memory_size,
     "(params, max_batch_size, max_seq_len, num_layers, available_cache_memory, devices, **kwargs)", EXACT),
    (ContinuousBatchingKVCacheManager.infer_optimal_batch_size,
     "(params, max_seq_len, num_layers, available_cache_memory, devices, **kwargs)", EXACT),
    (PagedKVCacheManager.estimated_memory_size,
     "(params, max_batch_size, max_seq_len, num_layers, available_cache_memory, devices, **kwargs)", EXACT),
    (PagedKVCacheManager.infer_optimal_batch_size,
     "(params, max_seq_len, num_layers, available_cache_memory, devices, **kwargs)", EXACT),
]  # fmt: skip

# The documented API of max.nn.kv_cache.KVCacheBuffer.
SEED_002: list[tuple[Any, str, str]] = [
    (KVCacheBuffer, "(replicates_kv_across_tp, values, scales=None)", EXACT),
    (KVCacheBuffer.to_memory, "()", EXACT),
]
SEED_002_PROPERTIES = ["all_buffers", "page_size", "total_num_pages"]

# The documented API of max.pipelines.kv_cache.PagedKVCacheManager.
P = PagedKVCacheManager
SEED_003: list[tuple[Any, str, str]] = [
    (P, "(params, session, total_num_pages, total_num_host_pages=0, enable_runtime_checks=False, *, max_batch_size)", EXACT),
    (P.alloc, "(data, replica_idx)", COMPATIBLE),  # + replica_idx=0, *, num_scheduled_tokens=None
    (P.alloc_dummy, "(request_id, replica_idx)", COMPATIBLE),
    (P.claim, "(request_id, replica_idx)", COMPATIBLE),
    (P.contains, "(request_id, replica_idx)", COMPATIBLE),
    (P.get_device_buffer, "(replica_idx)", COMPATIBLE),
    (P.get_metrics_aggregated, "()", EXACT),
    (P.get_num_disk_pages, "(replica_idx)", COMPATIBLE),
    (P.get_num_host_pages, "(replica_idx)", COMPATIBLE),
    (P.get_num_pages, "(replica_idx)", COMPATIBLE),
    (P.get_num_used_disk_pages, "(replica_idx)", COMPATIBLE),
    (P.get_num_used_host_pages, "(replica_idx)", COMPATIBLE),
    (P.get_num_used_pages, "(replica_idx)", COMPATIBLE),
    (P.get_pct_used_blocks_after_allocation, "(ctx, replica_idx)", COMPATIBLE),
    (P.get_req_blocks, "(request_id, replica_idx)", COMPATIBLE),  # + group=0 (hybrid models)
    (P.num_free_blocks, "(replica_idx=0)", EXACT),
    (P.release, "(request_id, replica_idx)", COMPATIBLE),
    (P.reserve, "(replica_batches)", EXACT),
    (P.reset_metrics, "()", EXACT),
    (P.reset_prefix_cache, "()", EXACT),
    (P.runtime_inputs, "(batches, *, max_cache_length=None, batch_characteristics=None)", EXACT),
    (P.runtime_inputs_for_leaf, "(batches, *, max_cache_length=None, batch_characteristics=None)", EXACT),
    (P.step, "(batches)", EXACT),
    (P.total_num_blocks, "(replica_idx=0)", EXACT),
    # BatchCharacteristics, as runtime_inputs names it (fields from MAX's record of that name).
    (BatchCharacteristics, "(batch_size, max_prompt_length, max_cache_valid_length)", EXACT),
]  # fmt: skip

# The documented API of vllm.v1.kv_cache_interface (the functions and methods it prints signatures for).
SEED_004: list[tuple[Any, str, str]] = [
    (specs.KVCacheSpec.max_memory_usage_bytes, "(vllm_config)", EXACT),
    (specs.UniformTypeKVCacheSpecs.from_specs, "(kv_cache_specs)", EXACT),
    (specs.UniformTypeKVCacheSpecs.is_uniform_type, "(kv_cache_specs)", EXACT),
    (specs.get_kv_quant_mode, "(kv_cache_dtype)", EXACT),
    (interface_config.compute_layer_kv_cache_shape_bytes, "(spec, num_blocks, block_size=None)", EXACT),
    (interface_config.reshape_kv_cache, "(raw, spec, num_blocks, num_layer_slots, layout, block_size=None)", EXACT),
]
SEED_004_CLASSES = [
    "ChunkedLocalAttentionSpec", "CrossAttentionSpec", "FullAttentionSpec", "HiddenStateCacheSpec", "KVCacheSpec",
    "KVQuantMode", "SinkFullAttentionSpec", "SlidingWindowMLASpec", "SlidingWindowSpec", "TQFullAttentionSpec",
    "UniformTypeKVCacheSpecs",
]  # fmt: skip
SEED_004_SPEC_PROPERTIES = ["num_heads", "tokens_per_state", "state_content_size_bytes"]  # RFC #42082 vocabulary

ROWS = SEED_000 + SEED_001 + SEED_002 + SEED_003 + SEED_004


def seed_parameters(text: str) -> list[inspect.Parameter]:
    """The parameters of a seed signature, parsed by Python itself."""
    namespace: dict[str, Any] = {}
    exec(f"def _seed{text}: pass", namespace)
    return list(inspect.signature(namespace["_seed"]).parameters.values())


def own_parameters(obj: Any) -> list[inspect.Parameter]:
    """`obj`'s parameters without self/cls (classes: their constructor's)."""
    params = list(inspect.signature(obj).parameters.values())
    if params and params[0].name in ("self", "cls"):
        params = params[1:]
    return params


def _id(row: tuple[Any, str, str]) -> str:
    return getattr(row[0], "__qualname__", repr(row[0]))


@pytest.mark.parametrize("row", ROWS, ids=_id)
def test_signature_matches_the_seed(row: tuple[Any, str, str]) -> None:
    obj, text, rule = row
    seed, ours = seed_parameters(text), own_parameters(obj)
    if rule == EXACT:
        assert [(p.name, p.kind, p.default) for p in ours] == [(p.name, p.kind, p.default) for p in seed], text
        return
    assert [p.name for p in ours[: len(seed)]] == [p.name for p in seed], text
    for s, o in zip(seed, ours, strict=False):
        assert o.kind == s.kind, f"{s.name}: {o.kind} != {s.kind}"
        if s.default is not inspect.Parameter.empty:
            assert o.default == s.default, f"{s.name}: default {o.default!r} != {s.default!r}"
    for extra in ours[len(seed) :]:
        assert extra.default is not inspect.Parameter.empty or extra.kind is inspect.Parameter.VAR_KEYWORD, extra


@pytest.mark.parametrize(
    ("cls", "names"), [(KVCacheParams, SEED_000_PROPERTIES), (KVCacheBuffer, SEED_002_PROPERTIES)], ids=str
)
def test_seed_properties(cls: type, names: list[str]) -> None:
    for name in names:
        assert isinstance(inspect.getattr_static(cls, name), property), f"{cls.__name__}.{name}"


def test_param_interface_is_a_base_class() -> None:
    """MAX's KVCacheParams: KVCacheParams has base KVCacheParamInterface (MAX's PagedKVCacheManager types `params` with it)."""
    assert issubclass(KVCacheParams, KVCacheParamInterface)
    assert issubclass(MultiKVCacheParams, KVCacheParamInterface)
    assert isinstance(KVCacheManager.slots_remaining, property)  # MAX's KVCacheManager


def test_seed_004_names() -> None:
    for name in SEED_004_CLASSES:
        assert hasattr(specs, name), name
    for name in SEED_004_SPEC_PROPERTIES:
        assert isinstance(inspect.getattr_static(specs.KVCacheSpec, name), property), name


# ----------------------------------------------------------------- behaviour behind the signatures
def _manager(dp: int = 1, **kwargs: Any) -> PagedKVCacheManager:
    params = make_params(page_size=4, devices=[DeviceRef.CPU()] * dp, data_parallel_degree=dp)
    return PagedKVCacheManager(params, None, 16, max_batch_size=4, **kwargs)


def test_session_positional_keyword_and_int_refused() -> None:
    params = make_params(page_size=4)
    session = object()
    assert PagedKVCacheManager(params, session, 16, max_batch_size=2).session is session
    by_keyword = PagedKVCacheManager(params, session=None, total_num_pages=16, max_batch_size=2)
    assert by_keyword.session is None and by_keyword.total_num_blocks() == 16
    assert PagedKVCacheManager(params, None, 8, 0, True, max_batch_size=2).enable_runtime_checks
    with pytest.raises(TypeError, match="session=16 is an int"):  # the older order is refused, never guessed
        PagedKVCacheManager(params, 16, 4, max_batch_size=2)
    with pytest.raises(TypeError, match="total_num_pages"):
        PagedKVCacheManager(params, 16, max_batch_size=2)  # type: ignore[call-arg]


def test_runtime_inputs_missing_pages_is_a_runtime_error() -> None:
    mgr = _manager()
    mgr.claim("a", 0)
    with pytest.raises(RuntimeError, match="request 'a' holds 0 pages but needs 2: alloc must be called first") as e:
        mgr.runtime_inputs([[ctx("a", range(5))]])
    assert isinstance(e.value, MissingPagesError) and isinstance(e.value, ValueError)


def test_batch_characteristics_size_every_replica_alike() -> None:
    mgr = _manager(dp=2)
    a, b = ctx("a", range(5)), ctx("b", range(9))
    mgr.claim("a", 0), mgr.alloc(a, 0), mgr.claim("b", 1), mgr.alloc(b, 1)
    plain = mgr.runtime_inputs([[a], [b]]).inputs
    assert [tuple(i.lookup_table.shape) for i in plain] == [(1, 24), (1, 24)]  # 2 and 3 pages: 8 + 16 cells
    assert [i.max_lengths.tolist() for i in plain] == [[[5, 5]], [[9, 9]]]
    bounds = BatchCharacteristics(batch_size=2, max_prompt_length=12, max_cache_valid_length=40)
    bounded = mgr.runtime_inputs_for_leaf([[a], [b]], batch_characteristics=bounds).inputs
    assert [tuple(i.lookup_table.shape) for i in bounded] == [(1, 32), (1, 32)]  # 10 pages: 16 + 16 cells
    assert [i.max_lengths.tolist() for i in bounded] == [[[12, 40]], [[12, 40]]]
    assert [i.cache_lengths.tolist() for i in bounded] == [[0], [0]]  # rows and lengths stay real
    for i, j in zip(plain, bounded, strict=True):
        assert (j.lookup_table[:, :24] == i.lookup_table).all() and (j.lookup_table[:, 24:] == 16).all()
    # An explicit max_cache_length still sizes the tables.
    sized = mgr.runtime_inputs([[a], [b]], max_cache_length=12, batch_characteristics=bounds).inputs
    assert [tuple(i.lookup_table.shape) for i in sized] == [(1, 24), (1, 24)]
    mgr.runtime_inputs([[a], [b]], batch_characteristics=BatchCharacteristics(1, 12, 40))
    with pytest.raises(
        ValueError, match="replica 1 max prompt length 9 exceeds batch_characteristics.max_prompt_length=8"
    ):
        mgr.runtime_inputs([[a], [b]], batch_characteristics=BatchCharacteristics(1, 8, 40))
    with pytest.raises(ValueError, match="max_prompt_length=9 exceeds max_cache_valid_length=8"):
        BatchCharacteristics(1, 9, 8)
    a.update(7)  # a decodes: 5 tokens cached, 1 active
    mgr.alloc(a, 0)
    with pytest.raises(
        ValueError, match="replica 0 max cache length 6 exceeds batch_characteristics.max_cache_valid_length=5"
    ):
        mgr.runtime_inputs([[a], []], batch_characteristics=BatchCharacteristics(1, 1, 5))
    assert mgr.runtime_inputs([[a], []], batch_characteristics=BatchCharacteristics(1, 1, 6)).inputs[
        0
    ].max_lengths.tolist() == [[1, 6]]
    mgr.claim("c", 0), mgr.alloc(c := ctx("c", range(3)), 0)
    with pytest.raises(ValueError, match="replica 0 batch of 2 exceeds batch_characteristics.batch_size=1"):
        mgr.runtime_inputs([[a, c], [b]], batch_characteristics=BatchCharacteristics(1, 12, 40))
    with pytest.raises(ValueError, match="batch_size=0 must be at least 1"):
        BatchCharacteristics(0, 1, 1)
    assert hash(bounds) == hash(BatchCharacteristics(2, 12, 40))


def test_kv_cache_buffer_page_size() -> None:
    params = make_params(page_size=4)
    (buffer,) = params.allocate_buffers(3)
    assert buffer.page_size == 4
    with pytest.raises(ValueError, match=r"page_size needs values shaped .*; got \(3, 8\)"):
        _ = KVCacheBuffer(False, [torch.zeros(3, 8)]).page_size


def test_dtype_shorthand_is_the_seeds() -> None:
    assert [make_params(dtype=d).dtype_shorthand for d in (DType.bfloat16, DType.float32, DType.float16)] == [
        "bf16", "f32", "f32",
    ]  # fmt: skip


def test_specs_take_torch_dtypes_and_speak_the_rfc_vocabulary() -> None:
    full = specs.FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=64, dtype=torch.bfloat16)  # type: ignore[arg-type]
    assert full.dtype is DType.bfloat16 and full == specs.FullAttentionSpec(
        block_size=16, num_kv_heads=4, head_size=64, dtype=DType.bfloat16
    )
    assert (full.num_heads, full.tokens_per_state, full.state_content_size_bytes) == (4, 1, 2 * 64 * 2)
    assert (
        full.block_size // full.tokens_per_state * full.num_heads * full.state_content_size_bytes
        == full.page_size_bytes
    )
    mla = specs.MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=DType.bfloat16)
    assert (mla.num_heads, mla.tokens_per_state, mla.state_content_size_bytes) == (1, 1, 576 * 2)
    fp8 = specs.FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=DType.float8_e4m3fn,
                                  kv_quant_mode=specs.KVQuantMode.FP8_PER_TOKEN_HEAD)  # fmt: skip
    assert fp8.state_content_size_bytes == 2 * 8 + 2 * 4  # K and V bytes plus their two float32 scales
    assert 16 * 2 * fp8.state_content_size_bytes == fp8.page_size_bytes
    with pytest.raises(TypeError, match="dtype='bf16' must be a pagedkv.DType or a torch.dtype"):
        specs.FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=64, dtype="bf16")  # type: ignore[arg-type]


def test_specs_stay_torch_free_at_import() -> None:
    code = "import sys, pagedkv.specs, pagedkv.params; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONPATH": "src"})
