"""SGLang's real host pool and storage factory for `PagedKVStorage` tests (the test module and its worker).

`sglang()` imports SGLang once (after `ensure_torchvision_ops`) or skips (fails under
PAGEDKV_REQUIRE_PEERS=1); `host_pool` builds an `MHATokenToKVPoolHost` on CPU (pin_memory=False)
filled with seeded random bits; `backend` builds a `PagedKVStorage` through
`StorageBackendFactory.create_backend("dynamic", ...)` and registers the pool, as SGLang's cache
controller does.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from types import SimpleNamespace
from typing import Any

import pytest
import torch

# SGLang JIT-builds its page-hash extension on first use: one build directory for every test process
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(tempfile.gettempdir(), "pagedkv-sglang-torch-ext"))

LAYERS, HEADS, HEAD_DIM, PAGE = 3, 2, 8, 4
HOST_PAGES = 33  # the pool's capacity: 2x the device pool's 64 tokens, + 1 page
_SGLANG: list[SimpleNamespace] = []


def sglang() -> SimpleNamespace:
    """SGLang's classes this test needs (imported once), or skip / fail (PAGEDKV_REQUIRE_PEERS=1)."""
    if _SGLANG:
        return _SGLANG[0]
    try:
        from benchmarks.compare.peers import ensure_torchvision_ops

        ensure_torchvision_ops()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from sglang.srt.mem_cache import hicache_storage
            from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
            from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
            from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
            from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
            from sglang.srt.mem_cache.utils import get_hash_str
            from sglang.srt.observability.metrics_collector import StorageMetrics
    except Exception as exc:  # noqa: BLE001 - any import failure means SGLang is not usable here
        if os.environ.get("PAGEDKV_REQUIRE_PEERS") == "1":
            pytest.fail(f"SGLang does not import ({exc}), and PAGEDKV_REQUIRE_PEERS=1")
        pytest.skip(f"SGLang does not import: {exc}")
    _SGLANG.append(SimpleNamespace(
        storage=hicache_storage, DevicePool=MHATokenToKVPool, HostPool=MHATokenToKVPoolHost,
        Factory=StorageBackendFactory, get_hash_str=get_hash_str, StorageMetrics=StorageMetrics,
        budget=host_memory_budget_scope,
    ))  # fmt: skip
    return _SGLANG[0]


def host_pool(layout: str, seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> Any:
    """A real `MHATokenToKVPoolHost` (CPU, not pinned) in `layout`, every byte seeded-random."""
    s = sglang()
    device = s.DevicePool(64, PAGE, dtype, HEADS, HEAD_DIM, LAYERS, "cpu", False, start_layer=0, end_layer=LAYERS)
    with s.budget(1 << 20):  # SGLang keeps 10 GB of the machine free unless the pool's budget is booked
        pool = s.HostPool(device.get_device_pool_infos()[0].buffer_info, 2.0, 0, PAGE, layout, pin_memory=False,
                          device="cpu", device_capacity_tokens=device.size, start_layer=0, end_layer=LAYERS)  # fmt: skip
    assert pool.page_num == HOST_PAGES
    raw = pool.kv_buffer.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)))
    return pool


def storage_config(extra: dict[str, Any], *, layout: str = "page_first", model: str = "tiny-llama",
                   tp_rank: int = 0, tp_size: int = 1, metrics: bool = False) -> Any:  # fmt: skip
    """SGLang's `HiCacheStorageConfig` of the dynamic backend `PagedKVStorage` with pagedkv keys `extra`."""
    loader = {"backend_name": "pagedkv", "module_path": "pagedkv.integrations.sglang",
              "class_name": "PagedKVStorage", "interface_v1": 1}  # fmt: skip
    return sglang().storage.HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
        enable_storage_metrics=metrics, is_page_first_layout=layout == "page_first", model_name=model,
        extra_config={**loader, **extra},
    )  # fmt: skip


def backend(pool: Any, extra: dict[str, Any], **kwargs: Any) -> Any:
    """`PagedKVStorage` built by SGLang's factory and registered with `pool`, as the cache controller does."""
    cfg = storage_config(extra, layout=pool.layout, **kwargs)
    store = sglang().Factory.create_backend("dynamic", cfg, pool)
    store.register_mem_pool_host(pool)
    return store


def page_keys(n: int, first_token: int = 100) -> list[str]:
    """`n` chained SGLang page keys (64-hex SHA-256) of consecutive tokens from `first_token`."""
    keys = sglang().get_hash_str(list(range(first_token, first_token + n * PAGE)), None, page_size=PAGE)
    assert len(keys) == n and all(len(k) == 64 for k in keys)
    return list(keys)


def slots(pages: list[int]) -> torch.Tensor:
    """The host token slots of host `pages` (`PAGE` per page), as the controller passes them."""
    return torch.tensor([p * PAGE + t for p in pages for t in range(PAGE)], dtype=torch.int64)


def page_bytes(pool: Any, page: int) -> bytes:
    """The flat data page of host `page` (K then V in the pool's layout): what a stored page holds."""
    return pool.get_data_page(page * PAGE).contiguous().view(torch.uint8).numpy().tobytes()
