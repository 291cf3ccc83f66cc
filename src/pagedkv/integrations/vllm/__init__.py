"""pagedkv.integrations.vllm: `PagedKVConnector`, a vLLM v1 KV connector over pagedkv's disk and Redis tiers.

Load it in vLLM with ``KVTransferConfig(kv_connector="PagedKVConnector",
kv_connector_module_path="pagedkv.integrations.vllm", kv_role="kv_both",
kv_connector_extra_config={...})`` (docs/VLLM.md). Importing this package
imports neither vLLM nor torch nor redis: the connector class (a subclass of
vLLM's ``KVConnectorBase_V1``) is built on first attribute access, which is
what vLLM's ``KVConnectorFactory`` does (``getattr(module, "PagedKVConnector")``).

    PagedKVConnector          the connector (imports vLLM)
    PagedKVConnectorMetadata  one step's loads and saves, scheduler -> workers (imports vLLM)
    ConnectorSettings         the checked ``kv_connector_extra_config`` (`parse_extra_config`)
    BlockLayout               what a stored block holds, its fingerprint and keys
    BlockMover                blocks between vLLM's KV views and page rows (imports torch)
    TierSet                   the disk / Redis tiers of one layout (imports torch)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedkv.integrations.vllm.layout import BlockLayout
from pagedkv.integrations.vllm.settings import EXTRA_CONFIG_KEYS, ConnectorSettings, parse_extra_config
from pagedkv.lazy import lazy_exports

__all__ = [
    "EXTRA_CONFIG_KEYS",
    "BlockLayout",
    "BlockMover",
    "ConnectorSettings",
    "PagedKVConnector",
    "PagedKVConnectorMetadata",
    "TierSet",
    "parse_extra_config",
]

_LAZY = {
    "PagedKVConnector": "pagedkv.integrations.vllm.connector",
    "PagedKVConnectorMetadata": "pagedkv.integrations.vllm.connector",
    "BlockMover": "pagedkv.integrations.vllm.blocks",
    "TierSet": "pagedkv.integrations.vllm.tiers",
}


__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())


if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from pagedkv.integrations.vllm.blocks import BlockMover
    from pagedkv.integrations.vllm.connector import PagedKVConnector, PagedKVConnectorMetadata
    from pagedkv.integrations.vllm.tiers import TierSet
