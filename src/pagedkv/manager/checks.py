"""Argument checks of `PagedKVCacheManager`'s entry points, run before anything changes.

Each raises TypeError (wrong type) or ValueError (bad value), naming the argument, the value and
the limit; capacity stays `InsufficientBlocksError`, raised by the bookkeeping itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pagedkv.core.context import TextContext, check_request_id
from pagedkv.manager import hybrid
from pagedkv.params.kv import BatchCharacteristics, KVCacheParams
from pagedkv.params.multi import MultiKVCacheParams
from pagedkv.params.validation import INT32_MAX, check_int
from pagedkv.runtime.buffers import check_fits

__all__ = [
    "check_alloc",
    "check_batch_characteristics",
    "check_batches",
    "check_claim",
    "check_context",
    "check_group",
    "check_manager",
    "check_request_id",
    "check_session",
    "check_step",
]

HOST_BYTES_PER_PAGE = 64  # bookkeeping of one page id in host memory (ref count, hash, lists), rounded up


def check_manager(
    params: Any, total_num_pages: Any, total_num_host_pages: Any, enable_runtime_checks: Any, max_batch_size: Any
) -> None:
    """The constructor's arguments; ValueError when the pages cannot fit a device's memory."""
    if not isinstance(params, KVCacheParams | MultiKVCacheParams):
        raise TypeError(f"params must be KVCacheParams or MultiKVCacheParams, got {type(params).__name__}")
    check_int("total_num_pages", total_num_pages, 1, INT32_MAX - 1)  # (+ the null page: int32 page ids)
    check_int("total_num_host_pages", total_num_host_pages, 0, INT32_MAX)
    check_int("max_batch_size", max_batch_size, 1, INT32_MAX)
    if not isinstance(enable_runtime_checks, bool):
        raise TypeError(f"enable_runtime_checks={enable_runtime_checks!r} must be a bool")
    host = HOST_BYTES_PER_PAGE * params.data_parallel_degree
    check_fits(params, total_num_pages, null_page=True, shared=hybrid.is_hybrid(params), host_bytes_per_page=host)


def check_session(session: Any) -> None:
    """The constructor's `session` (MAX's `InferenceSession` slot): anything but an int.

    An int there is the older call ``PagedKVCacheManager(params, total_num_pages, ...)``; it is
    refused rather than guessed at, since ``(params, 8, 4)`` would otherwise mean two things."""
    if isinstance(session, int):
        raise TypeError(
            f"session={session!r} is an int: the signature is PagedKVCacheManager(params, session, total_num_pages, "
            f"total_num_host_pages=0, enable_runtime_checks=False, *, max_batch_size) as in MAX; pass session=None "
            f"before the page count, e.g. PagedKVCacheManager(params, None, {session!r}, max_batch_size=...)"
        )


def check_batch_characteristics(bounds: Any, batches: Sequence[Sequence[TextContext]], max_batch_size: int) -> None:
    """`runtime_inputs(batch_characteristics=...)`: a `BatchCharacteristics` whose bounds hold every
    replica's real batch size, longest active window and longest ``cached + active`` length."""
    if not isinstance(bounds, BatchCharacteristics):
        raise TypeError(f"batch_characteristics must be a BatchCharacteristics or None, got {type(bounds).__name__}")
    if bounds.batch_size > max_batch_size:
        raise ValueError(
            f"batch_characteristics.batch_size={bounds.batch_size} exceeds max_batch_size={max_batch_size}"
        )
    for r, batch in enumerate(batches):
        if len(batch) > bounds.batch_size:
            raise ValueError(
                f"replica {r} batch of {len(batch)} exceeds batch_characteristics.batch_size={bounds.batch_size}"
            )
        ends = [ctx.tokens.current_position for ctx in batch]
        prompt = max((e - ctx.tokens.processed_length for e, ctx in zip(ends, batch, strict=True)), default=0)
        if prompt > bounds.max_prompt_length:
            raise ValueError(
                f"replica {r} max prompt length {prompt} exceeds "
                f"batch_characteristics.max_prompt_length={bounds.max_prompt_length}"
            )
        cache = max(ends, default=0)
        if cache > bounds.max_cache_valid_length:
            raise ValueError(
                f"replica {r} max cache length {cache} exceeds "
                f"batch_characteristics.max_cache_valid_length={bounds.max_cache_valid_length}"
            )


def check_claim(swapped: Any, request_id: Any, replica_idx: int) -> None:
    """`claim`: a valid id that is not swapped out (a swapped-out request is resumed with `swap_in`)."""
    check_request_id(request_id)
    if (replica_idx, request_id) in swapped:
        raise ValueError(f"request {request_id!r} is swapped out on replica {replica_idx}: swap_in or release it")


def check_context(ctx: Any, name: str = "data") -> None:
    """TypeError unless `ctx` is a `TextContext`."""
    if not isinstance(ctx, TextContext):
        raise TypeError(f"{name} must be a TextContext, got {type(ctx).__name__}")


def check_alloc(ctx: Any, num_scheduled_tokens: Any) -> None:
    """`alloc`: a context and None or a token count >= 1."""
    check_context(ctx)
    if num_scheduled_tokens is not None:
        check_int("num_scheduled_tokens", num_scheduled_tokens, 1, INT32_MAX)


def check_batches(batches: Any, num_replicas: int) -> None:
    """One sequence of `TextContext` per replica."""
    if not isinstance(batches, Sequence) or isinstance(batches, str | TextContext):
        raise TypeError(
            f"batches must be a list with one list of TextContext per replica, got {type(batches).__name__}"
        )
    if len(batches) != num_replicas:
        raise ValueError(f"got {len(batches)} batches; need one per replica ({num_replicas})")
    for r, batch in enumerate(batches):
        if not isinstance(batch, Sequence) or isinstance(batch, str):
            raise TypeError(f"batches[{r}] must be a list of TextContext, got {type(batch).__name__}")
        for ctx in batch:
            if type(ctx) is not TextContext:
                check_context(ctx, f"batches[{r}] item")


def check_step(managers: Sequence[Any], batches: Any) -> None:
    """`step`: every replica's batch holds claimed requests, none twice (checked before any commit).

    This runs once per step over every request, so the common case is decided with C-level set
    operations; only a batch that fails them is walked again for the precise error."""
    if type(batches) is not list or len(batches) != len(managers):
        check_batches(batches, len(managers))
    for bm, batch in zip(managers, batches, strict=True):
        if type(batch) is not list or (batch and set(map(type, batch)) != {TextContext}):
            check_batches(batches, len(managers))  # the slow walk: raises unless a tuple of contexts
        bm.check_batch(batch)  # raises: unknown or repeated request


def check_group(bm: Any, group: Any) -> None:
    """`get_req_blocks`: `group` indexes the model's page tables."""
    groups = len(bm.groups)
    if not isinstance(group, int) or isinstance(group, bool):
        raise TypeError(f"group={group!r} must be an int")
    if not 0 <= group < groups:
        raise ValueError(f"group={group} must be in [0, {groups}): this model has {groups} page table(s)")
