"""Eviction policies, one file each, and the registry that names them (``eviction_policy=``).

`EVICTION_POLICIES` maps each name to its `EvictionPolicy` class, in registration order (the built-ins
first: lru, slru, lfu, arc); `register_eviction_policy` adds one. A pool builds its policy from the name once
(`make_eviction_policy`), and every check of ``eviction_policy`` (`KVCacheParams`, `BlockPool`) takes its
allowed names from here.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import TypeVar

from pagedkv.core.pool.policies.arc import ArcPolicy
from pagedkv.core.pool.policies.base import EvictionPolicy
from pagedkv.core.pool.policies.lfu import LfuPolicy
from pagedkv.core.pool.policies.lru import LruPolicy
from pagedkv.core.pool.policies.slru import SlruPolicy

__all__ = [
    "EVICTION_POLICIES", "ArcPolicy", "EvictionPolicy", "LfuPolicy", "LruPolicy", "SlruPolicy",
    "make_eviction_policy", "register_eviction_policy", "unregister_eviction_policy",
]  # fmt: skip

P = TypeVar("P", bound=type[EvictionPolicy])

_POLICIES: dict[str, type[EvictionPolicy]] = {}
EVICTION_POLICIES: Mapping[str, type[EvictionPolicy]] = MappingProxyType(_POLICIES)  # name -> class (read-only)


def register_eviction_policy(policy: P) -> P:
    """Make `policy` (an `EvictionPolicy` subclass) selectable as ``eviction_policy=policy.name``; returns it,
    so it also works as a class decorator. TypeError unless a subclass; ValueError when its name is empty
    or taken by another class (registering the same class again changes nothing)."""
    if not (isinstance(policy, type) and issubclass(policy, EvictionPolicy)):
        raise TypeError(f"policy={policy!r} must be a subclass of EvictionPolicy")
    name = policy.name
    if not isinstance(name, str) or not name:
        raise ValueError(f"{policy.__name__}.name={name!r} must be a non-empty str")
    taken = _POLICIES.get(name)
    if taken is not None and taken is not policy:
        raise ValueError(f"eviction_policy={name!r} is taken by {taken.__qualname__}")
    _POLICIES[name] = policy
    return policy


def unregister_eviction_policy(name: str) -> None:
    """Forget the policy registered as `name` (pools built with it keep it). ValueError for a built-in
    name or one not registered."""
    if name in _BUILT_IN:
        raise ValueError(f"name={name!r} is a built-in eviction policy: it stays registered")
    if name not in _POLICIES:
        raise ValueError(f"name={name!r} is not a registered eviction policy, one of {tuple(_POLICIES)}")
    del _POLICIES[name]


def make_eviction_policy(name: str, num_blocks: int) -> EvictionPolicy:
    """A new policy object of the class registered as `name`, for a pool of `num_blocks` pages (the caller
    checked the name)."""
    return _POLICIES[name](num_blocks)


_BUILT_INS = (LruPolicy, SlruPolicy, LfuPolicy, ArcPolicy)  # a new built-in policy: its file, and this line
_BUILT_IN = frozenset(policy.name for policy in _BUILT_INS)
for _policy in _BUILT_INS:
    register_eviction_policy(_policy)
