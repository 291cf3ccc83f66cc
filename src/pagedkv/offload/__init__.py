"""pagedkv.offload: the tiers below the device (host rows, disk, Redis) and the connector over them.

Names load on first use (a module `__getattr__`), so ``import pagedkv.offload``
imports nothing heavy, ``pagedkv.offload.format`` stays torch-free, and an
optional dependency (``redis`` for `RedisTier`, ``xxhash`` for checksums) is
imported only when the tier that needs it is built.

    KVConnector        one replica's tiers: `load` (stages) / `complete_loads` / `offload` / waits
    create_connector   the connector `KVCacheParams.kv_connector` asks for
    create_state_connector  the connector of a state model's checkpoint images
    HostTier           pinned host rows, LRU by content hash
    LowerTier          the contract of a tier below host memory
    DiskTier           one checked file per page, LRU under a byte cap (the directory's, across processes)
    RedisTier          pages under content-hash keys in Redis / Valkey (standalone or cluster)
    PageMover          whole pages between device buffers and host rows
    StateImageMover    state checkpoints (state row + tail pages) between device buffers and host rows
    RowMover           what a connector needs of its rows' source (both movers)
    SwapSpace          host rows lent to swapped-out (preempted) requests
    LoadCopyError      a staged load's device copy failed
    format             the checked on-disk / on-wire page format (a submodule)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedkv.lazy import lazy_exports

_EXPORTS = {
    "KVConnector": "pagedkv.offload.connector",
    "LoadCopyError": "pagedkv.offload.staged_loads",
    "StagedLoads": "pagedkv.offload.staged_loads",
    "create_connector": "pagedkv.offload.factory",
    "describe_layout": "pagedkv.offload.factory",
    "create_state_connector": "pagedkv.offload.factory",
    "HostTier": "pagedkv.offload.host",
    "LowerTier": "pagedkv.offload.tier",
    "DiskTier": "pagedkv.offload.disk",
    "RedisTier": "pagedkv.offload.redis_tier",
    "PageMover": "pagedkv.offload.transfer",
    "RowMover": "pagedkv.offload.transfer",
    "StateImageMover": "pagedkv.offload.state_images",
    "SwapSpace": "pagedkv.offload.swap_space",
}

__all__ = [
    "DiskTier",
    "HostTier",
    "KVConnector",
    "LoadCopyError",
    "LowerTier",
    "PageMover",
    "RedisTier",
    "RowMover",
    "StagedLoads",
    "StateImageMover",
    "SwapSpace",
    "create_connector",
    "create_state_connector",
    "describe_layout",
]


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())


if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from pagedkv.offload.connector import KVConnector
    from pagedkv.offload.disk import DiskTier
    from pagedkv.offload.factory import create_connector, create_state_connector, describe_layout
    from pagedkv.offload.host import HostTier
    from pagedkv.offload.redis_tier import RedisTier
    from pagedkv.offload.staged_loads import LoadCopyError, StagedLoads
    from pagedkv.offload.state_images import StateImageMover
    from pagedkv.offload.swap_space import SwapSpace
    from pagedkv.offload.tier import LowerTier
    from pagedkv.offload.transfer import PageMover, RowMover
