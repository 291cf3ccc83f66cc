"""A KV-aware router: engines' KV event streams -> a prefix index -> a routing policy -> `pagedkv route`.

Importing this package needs neither pyzmq, msgspec nor aiohttp: they are imported when an index starts,
a payload is decoded or the HTTP service runs (``pip install 'pagedkv[router]'``).
"""

from __future__ import annotations

from pagedkv.router.hashers import BlockHasher, PagedKVHasher, VLLMHasher
from pagedkv.router.index import EngineSpec, PrefixIndex
from pagedkv.router.policy import Decision, EngineLoad, Router, RouterPolicy, RouterStats
from pagedkv.router.state import StreamStats

__all__ = [
    "BlockHasher", "Decision", "EngineLoad", "EngineSpec", "PagedKVHasher", "PrefixIndex", "Router", "RouterPolicy",
    "RouterStats", "StreamStats", "VLLMHasher",
]  # fmt: skip
