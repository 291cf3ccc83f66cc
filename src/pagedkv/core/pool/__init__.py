"""The page pool of one replica: reference counts, the prefix cache and the eviction order."""

from pagedkv.core.pool.block_pool import BlockPool

__all__ = ["BlockPool"]
