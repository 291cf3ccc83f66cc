"""`WeightsAccess`: the model weights version of `PagedKVCacheManager`'s hash chains.

The version is folded into the root of every prefix-cache hash chain (see
`pagedkv.core.hashing`). After `set_weights_version(v)`, every request
admitted from then on hashes its prompt from v's root, so no page computed
under another version can be a hit, on device or in any tier (their keys
are the same hashes): no `reset_prefix_cache` is needed after a weight
update. Old pages are not deleted; they age out like any unused page.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.core.block_manager import BlockManager
from pagedkv.params_checks import check_weights_version

__all__ = ["WeightsAccess"]


class WeightsAccess:
    """`weights_version` and `set_weights_version` (a mixin of `PagedKVCacheManager`)."""

    _managers: Sequence[BlockManager]

    @property
    def weights_version(self) -> str | None:
        """The version new requests' hash chains start from (`KVCacheParams.weights_version` at first)."""
        return self._managers[0].hasher.version

    def set_weights_version(self, version: str | None) -> None:
        """Hash every later admission from `version`'s root, on every replica.

        Requests already holding pages keep their chains: pages they commit later stay under the old
        version's keys, which no request of the new version looks up. A request whose KV must be
        all new (an engine after a weight update) is released and recomputed by its caller.
        Raises TypeError/ValueError for a version that is not None or a str of 1 to 1024 characters.
        """
        check_weights_version(version, "version")
        for bm in self._managers:
            bm.hasher.set_version(version)
