"""Argument checks shared by every layer: errors name the argument, its value and the limit."""

from __future__ import annotations

from typing import Any

__all__ = ["EVICTION_POLICIES", "INT32_MAX", "INT64_MAX", "check_eviction", "check_int"]

EVICTION_POLICIES = ("lru", "slru", "lfu", "arc")


INT32_MAX = 2**31 - 1  # page ids, cache lengths and tokens are int32
INT64_MAX = 2**63 - 1


def check_int(name: str, value: Any, minimum: int, maximum: int = INT64_MAX) -> None:
    """Raise TypeError unless `value` is an int (bool excluded), ValueError outside [`minimum`, `maximum`]
    (by default int64's range: no size of pagedkv is larger)."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name}={value!r} must be an int")
    if value < minimum:
        raise ValueError(f"{name}={value} must be at least {minimum}")
    if value > maximum:
        raise ValueError(f"{name}={value} must be at most {maximum}")


def check_eviction(eviction_policy: Any, protected_fraction: Any, leaves_first: Any = False) -> None:
    """Raise ValueError/TypeError unless the eviction settings of a page pool are valid."""
    if not isinstance(leaves_first, bool):
        raise TypeError(f"evict_leaves_first={leaves_first!r} must be a bool")
    if eviction_policy not in EVICTION_POLICIES:
        raise ValueError(f"eviction_policy={eviction_policy!r} must be one of {EVICTION_POLICIES}")
    if isinstance(protected_fraction, bool) or not isinstance(protected_fraction, int | float):
        raise TypeError(f"protected_fraction={protected_fraction!r} must be a float")
    if not 0.0 <= protected_fraction <= 1.0:
        raise ValueError(f"protected_fraction={protected_fraction} must be in [0, 1]")
