"""Errors raised by the bookkeeping layer."""

from __future__ import annotations

__all__ = ["InsufficientBlocksError", "IntegrityError", "MissingPagesError", "require"]


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

    @classmethod
    def for_request(
        cls, request_id: object, needed: int, available: int, used: int, total: int
    ) -> InsufficientBlocksError:
        """The error of an `alloc` of `request_id` that needs `needed` pages where `available` can be had
        (`used` of the pool's `total` pages are in use)."""
        return cls(f"Cannot get {needed} free blocks for request {request_id!r} (only {available} available; "
                   f"{used}/{total} blocks currently in use)", needed=needed, available=available)  # fmt: skip


class MissingPagesError(RuntimeError, ValueError):
    """A request in a batch holds fewer pages than its tokens need: `alloc` was not called for it.

    A RuntimeError, as MAX's `PagedKVCacheManager.runtime_inputs` documents; also a ValueError,
    which pagedkv raised for it before, so existing ``except ValueError`` handlers still catch it.
    """


class IntegrityError(RuntimeError):
    """A bookkeeping invariant does not hold (a bug in pagedkv or in its caller)."""


def require(condition: bool, message: str) -> None:
    """Raise `IntegrityError(message)` unless `condition` holds (never stripped by -O)."""
    if not condition:
        raise IntegrityError(message)
