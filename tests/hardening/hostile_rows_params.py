"""Hostile inputs, rows: the params, the connector config and the buffers.

Part of `hostile_cases.CASES`, which concatenates the row modules in order. Each row is a `Case`: entry
point, input class, example, setup, expected error type and a fragment of its message.
"""

from __future__ import annotations

import math

import torch
from hostile_beds import buffer_values, tiered_params
from hostile_support import (
    BAD_VALUE,
    BIG,
    HUGE,
    LOCAL,
    MISMATCH,
    NEGATIVE,
    NONFINITE_NUMBER,
    TERA,
    WRONG_DEVICE,
    WRONG_DTYPE,
    WRONG_SHAPE,
    WRONG_TYPE,
    ZERO,
    Case,
    construct,
    params,
)

from pagedkv.params.connector import KVConnectorConfig
from pagedkv.params.multi import MultiKVCacheParams
from pagedkv.runtime.buffers import KVCacheBuffer

C = Case

PARAMS_ROWS: list[Case] = [
    # --- KVCacheParams
    C("KVCacheParams", f"{WRONG_TYPE}: str", 'n_kv_heads="8"', construct(lambda: params(n_kv_heads="8")),
      TypeError, "n_kv_heads='8' must be an int"),
    C("KVCacheParams", f"{WRONG_TYPE}: float", "page_size=16.0", construct(lambda: params(page_size=16.0)),
      TypeError, "page_size=16.0 must be an int"),
    C("KVCacheParams", f"{WRONG_TYPE}: bool", "head_dim=True", construct(lambda: params(head_dim=True)),
      TypeError, "head_dim=True must be an int"),
    C("KVCacheParams", f"{WRONG_TYPE}: None", "dtype=None", construct(lambda: params(dtype=None)),
      TypeError, "dtype=None must be a pagedkv.DType"),
    C("KVCacheParams", f"{WRONG_TYPE}: str devices", 'devices="cpu"', construct(lambda: params(devices="cpu")),
      TypeError, "devices='cpu' must be a non-empty sequence of DeviceRef"),
    C("KVCacheParams", f"{WRONG_TYPE}: int flag", "enable_prefix_caching=1",
      construct(lambda: params(enable_prefix_caching=1)), TypeError, "enable_prefix_caching=1 must be a bool"),
    C("KVCacheParams", f"{NEGATIVE}: num_layers", "num_layers=-1", construct(lambda: params(num_layers=-1)),
      ValueError, "num_layers=-1 must be at least 1"),
    C("KVCacheParams", f"{ZERO}: page_size", "page_size=0", construct(lambda: params(page_size=0)),
      ValueError, "page_size=0 must be at least 1"),
    C("KVCacheParams", f"{HUGE}: 2**63", "page_size=2**63", construct(lambda: params(page_size=BIG)),
      ValueError, f"page_size={BIG} must be at most 9223372036854775807"),
    C("KVCacheParams", f"{BAD_VALUE}: nonfinite_kv", 'nonfinite_kv="drop"',
      construct(lambda: params(nonfinite_kv="drop")), ValueError, "nonfinite_kv='drop' must be one of ('pass', 'reject')"),
    C("KVCacheParams", f"{NEGATIVE}: max_state_checkpoints", "max_state_checkpoints=-1",
      construct(lambda: params(max_state_checkpoints=-1)), ValueError, "max_state_checkpoints=-1 must be at least 0"),
    C("KVCacheParams", f"{WRONG_TYPE}: float", "max_state_checkpoints=2.0",
      construct(lambda: params(max_state_checkpoints=2.0)), TypeError, "max_state_checkpoints=2.0 must be an int"),
    C("KVCacheParams", f"{NONFINITE_NUMBER}: protected_fraction", "protected_fraction=nan",
      construct(lambda: params(protected_fraction=math.nan)), ValueError, "protected_fraction=nan must be in [0, 1]"),
    C("KVCacheParams", f"{MISMATCH}: tiered without a directory", 'kv_connector="tiered", no kv_connector_config',
      construct(lambda: params(kv_connector="tiered", host_kvcache_swap_space_gb=1)), ValueError,
      "kv_connector=tiered requires kv_connector_config=KVConnectorConfig(disk_offload_dir=...)"),
    C("KVCacheParams", f"{MISMATCH}: partial reuse with a tier", 'enable_partial_page_reuse=True, kv_connector="local"',
      construct(lambda: params(enable_partial_page_reuse=True, **LOCAL)), ValueError,
      "enable_partial_page_reuse=True does not support kv_connector=local"),
    C("KVCacheParams", f"{MISMATCH}: GQA heads", "n_kv_heads=2, num_q_heads=3",
      construct(lambda: params(num_q_heads=3)), ValueError, "num_q_heads=3 must be a multiple of n_kv_heads=2"),
    # --- MultiKVCacheParams
    C("MultiKVCacheParams", f"{WRONG_TYPE}: list", "MultiKVCacheParams([params])",
      construct(lambda: MultiKVCacheParams([params()])), TypeError, "children must be a mapping name -> KVCacheParams"),
    C("MultiKVCacheParams", f"{WRONG_TYPE}: str child", 'MultiKVCacheParams({"a": "x"})',
      construct(lambda: MultiKVCacheParams({"a": "x"})), TypeError, "children['a']=str must be KVCacheParams"),
    C("MultiKVCacheParams", f"{ZERO}: no child", "MultiKVCacheParams({})", construct(lambda: MultiKVCacheParams({})),
      ValueError, "requires at least one param"),
    C("MultiKVCacheParams", f"{MISMATCH}: page size", "children with page_size 4 and 8",
      construct(lambda: MultiKVCacheParams({"a": params(), "b": params(page_size=8)})), ValueError,
      "All caches must have the same page size: 4 != 8"),
    C("MultiKVCacheParams", f"{MISMATCH}: tier settings", "children with different kv_connector_config",
      construct(lambda: MultiKVCacheParams({"a": tiered_params("/x"), "b": tiered_params("/y")})), ValueError,
      "All caches must have the same kv_connector_config"),
    # --- KVConnectorConfig
    C("KVConnectorConfig", f"{WRONG_TYPE}: int", "disk_offload_dir=5", construct(lambda: KVConnectorConfig(disk_offload_dir=5)),
      TypeError, "disk_offload_dir=5 must be a str"),
    C("KVConnectorConfig", f"{WRONG_TYPE}: bool", "io_threads=True", construct(lambda: KVConnectorConfig(io_threads=True)),
      TypeError, "io_threads=True must be an int"),
    C("KVConnectorConfig", f"{WRONG_TYPE}: None", "model_id=None", construct(lambda: KVConnectorConfig(model_id=None)),
      TypeError, "model_id=None must be a str"),
    C("KVConnectorConfig", f"{NEGATIVE}: size cap", "disk_offload_max_gb=-1",
      construct(lambda: KVConnectorConfig(disk_offload_max_gb=-1)), ValueError, "disk_offload_max_gb=-1 must be a finite number > 0"),
    C("KVConnectorConfig", f"{NONFINITE_NUMBER}: inf", "disk_offload_max_gb=inf",
      construct(lambda: KVConnectorConfig(disk_offload_max_gb=math.inf)), ValueError, "disk_offload_max_gb=inf must be a finite number > 0"),
    C("KVConnectorConfig", f"{NONFINITE_NUMBER}: timeout", "redis_timeout_s=nan",
      construct(lambda: KVConnectorConfig(redis_timeout_s=math.nan)), ValueError, "redis_timeout_s=nan must be a finite number > 0"),
    C("KVConnectorConfig", f"{ZERO}: disk timeout", "disk_timeout_s=0",
      construct(lambda: KVConnectorConfig(disk_timeout_s=0)), ValueError, "disk_timeout_s=0 must be a finite number > 0"),
    C("KVConnectorConfig", f"{ZERO}: threads", "io_threads=0", construct(lambda: KVConnectorConfig(io_threads=0)),
      ValueError, "io_threads=0 must be at least 1"),
    C("KVConnectorConfig", f"{HUGE}: 2**63", "io_threads=2**63", construct(lambda: KVConnectorConfig(io_threads=BIG)),
      ValueError, "must be at most 9223372036854775807"),
    C("KVConnectorConfig", f"{ZERO}: empty directory name", 'disk_offload_dir=""',
      construct(lambda: KVConnectorConfig(disk_offload_dir="")), ValueError, "disk_offload_dir='' must name a directory"),
    C("KVConnectorConfig", f"{BAD_VALUE}: URL scheme", 'redis_url="http://cache:6379"',
      construct(lambda: KVConnectorConfig(redis_url="http://cache:6379")), ValueError, "must start with redis://"),
    # --- KVCacheParams.allocate_buffers
    C("KVCacheParams.allocate_buffers", f"{ZERO}: pages", "allocate_buffers(0)", construct(lambda: params().allocate_buffers(0)),
      ValueError, "total_num_pages=0 must be at least 1"),
    C("KVCacheParams.allocate_buffers", f"{WRONG_TYPE}: float", "allocate_buffers(8.0)",
      construct(lambda: params().allocate_buffers(8.0)), TypeError, "total_num_pages=8.0 must be an int"),
    C("KVCacheParams.allocate_buffers", f"{HUGE}: 2**63", "allocate_buffers(2**63)",
      construct(lambda: params().allocate_buffers(BIG)), ValueError, "must be at most 2147483647"),
    C("KVCacheParams.allocate_buffers", f"{HUGE}: 10**12 pages", "allocate_buffers(10**12)",
      construct(lambda: params().allocate_buffers(TERA)), ValueError, f"total_num_pages={TERA} must be at most 2147483647"),
    C("KVCacheParams.allocate_buffers", f"{HUGE}: more than memory", "allocate_buffers(2**30), head_dim=8192",
      construct(lambda: params(head_dim=8192).allocate_buffers(2**30)), ValueError,
      "total_num_pages=1073741824 of 1048576 bytes need 1125899906842624 bytes on cpu"),
    # --- KVCacheBuffer
    C("KVCacheBuffer", f"{WRONG_TYPE}: tensor for a list", "KVCacheBuffer(False, values=tensor)",
      construct(lambda: KVCacheBuffer(False, buffer_values()[0])), TypeError, "values must be a list of tensors"),
    C("KVCacheBuffer", f"{WRONG_TYPE}: str flag", 'KVCacheBuffer("yes", values)',
      construct(lambda: KVCacheBuffer("yes", buffer_values())), TypeError, "replicates_kv_across_tp='yes' must be a bool"),
    C("KVCacheBuffer", f"{WRONG_DTYPE}: int64 pages", "values=[torch.zeros(..., dtype=int64)]",
      construct(lambda: KVCacheBuffer(False, buffer_values(dtype=torch.int64))), TypeError,
      "values[0] has dtype torch.int64; KV pages and scales are floating point"),
    C("KVCacheBuffer", f"{WRONG_SHAPE}: shards differ", "values=[pages [9, ...], pages [8, ...]]",
      construct(lambda: KVCacheBuffer(False, [*buffer_values(), torch.zeros(8, 2, 2, 4, 2, 4)])), ValueError,
      "All values buffers must have the same dtype and shape"),
    C("KVCacheBuffer", f"{WRONG_SHAPE}: scales pages", "scales with 8 pages, values with 9",
      construct(lambda: KVCacheBuffer(False, buffer_values(), [torch.zeros(8, 2, 2, 4, 2, 1)])), ValueError,
      "Values and scales must have the same number of pages: 9 != 8"),
    C("KVCacheBuffer", f"{WRONG_DEVICE}: scales on meta", 'scales=[torch.zeros(..., device="meta")]',
      construct(lambda: KVCacheBuffer(False, buffer_values(), [torch.zeros(9, 2, 2, 4, 2, 1, device="meta")])),
      ValueError, "values[0] is on cpu but scales[0] is on meta"),
]  # fmt: skip
