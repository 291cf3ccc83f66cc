"""pagedkv's disk / Redis tiers as an SGLang HiCache L3 storage backend (docs/SGLANG.md).

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config
      '{"backend_name": "pagedkv", "module_path": "pagedkv.integrations.sglang",
        "class_name": "PagedKVStorage", "interface_v1": 1, "redis_url": "redis://host:6379/0"}'

    PagedKVStorage    the `HiCacheStorage` subclass SGLang loads (module `storage`; importing it imports
                      sglang, so it is built on first access, and only where sglang is installed)
    StorageSettings   its extra_config keys, checked (module `settings`; no sglang, no torch)
    HostPages         zero-copy byte views of an MHA host pool's pages (module `host_pages`; torch)

``import pagedkv.integrations.sglang`` imports neither sglang nor torch nor redis.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedkv.integrations.sglang.settings import StorageSettings
from pagedkv.lazy import lazy_exports

__all__ = ["HostPages", "PagedKVStorage", "StorageSettings"]

_LAZY = {
    "PagedKVStorage": "pagedkv.integrations.sglang.storage",
    "HostPages": "pagedkv.integrations.sglang.host_pages",
}


__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())


if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from pagedkv.integrations.sglang.host_pages import HostPages
    from pagedkv.integrations.sglang.storage import PagedKVStorage
