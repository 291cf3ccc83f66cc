"""Errors raised by the bookkeeping layer."""

from __future__ import annotations

__all__ = ["InsufficientBlocksError", "IntegrityError", "require"]


class InsufficientBlocksError(Exception):
    """The pool cannot hold what was asked for; nothing was changed by the failing call.

    Attributes:
        needed: what the call needed (pages, unless the message names another unit).
        available: what it could have had (for pages: free plus evictable, minus its own hits).
    """

    def __init__(self, message: str, *, needed: int, available: int) -> None:
        super().__init__(message)
        self.needed = needed
        self.available = available


class IntegrityError(RuntimeError):
    """A bookkeeping invariant does not hold (a bug in pagedkv or in its caller)."""


def require(condition: bool, message: str) -> None:
    """Raise `IntegrityError(message)` unless `condition` holds (never stripped by -O)."""
    if not condition:
        raise IntegrityError(message)
