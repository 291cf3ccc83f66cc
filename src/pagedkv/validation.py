"""Argument checks shared by every layer: errors name the argument, its value and the limit."""

from __future__ import annotations

from typing import Any

__all__ = ["check_int"]


def check_int(name: str, value: Any, minimum: int) -> None:
    """Raise TypeError unless `value` is an int (bool excluded), ValueError if it is below `minimum`."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name}={value!r} must be an int")
    if value < minimum:
        raise ValueError(f"{name}={value} must be at least {minimum}")
