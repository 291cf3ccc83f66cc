"""Argument checks of the description layer, shared by every layer above: errors name the argument, its
value and the limit. Each layer above has its own `checks` module for its own entry points."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import numpy as np

__all__ = [
    "INT32_MAX", "INT64_MAX", "NONFINITE_KV", "as_token_array", "check_eviction", "check_int",
    "check_weights_version", "normalize_hash_seed", "validate_attention_kind", "validate_partial_page_reuse",
]  # fmt: skip

INT32_MAX = 2**31 - 1  # page ids, cache lengths and tokens are int32
INT32_MIN = -(2**31)
INT64_MAX = 2**63 - 1
_BOOLS = (bool, np.bool_)
_NO_BOOL = frozenset(_BOOLS).isdisjoint  # (one C-level pass over a list's element types)


def _where(name: str) -> str:
    return "" if name == "tokens" else f"{name}: "


def as_token_array(tokens: Any, copy: bool = True, *, allow_empty: bool = False, name: str = "tokens") -> np.ndarray:
    """`tokens` as an int32 array: the one check of every entry point that takes token ids.

    Accepts a 1-D sequence or array of integers (Python ints, numpy integers, an integer array, an
    object array of ints). TypeError unless every element is an integer: a float, a str, or a bool
    anywhere (True is not token 1; a bool array too) names the first offender. ValueError unless 1-D,
    non-empty (`allow_empty`: empty is fine) and inside int32. Messages call the argument `name`. Returns a
    fresh array (`copy` False: `tokens` itself when it is a 1-D int32 array already). Changes nothing.
    """
    if type(tokens) is np.ndarray and tokens.dtype == np.int32 and tokens.ndim == 1 and (tokens.size or allow_empty):
        return tokens.copy() if copy else tokens  # (int32 already: nothing to check)
    array = tokens if isinstance(tokens, np.ndarray) else np.asarray(tokens)
    if array.ndim == 0:
        raise TypeError(f"{name} must be a 1-D sequence of token ids, got {type(tokens).__name__}")
    if array.ndim != 1 or (array.size == 0 and not allow_empty):
        raise ValueError(f"{name} must be a non-empty 1-D sequence, got shape {array.shape}")
    if array.size == 0:
        return np.zeros(0, dtype=np.int32)  # (`allow_empty`: `[]` has no integer dtype to check)
    if array.dtype == object:  # Python ints past int64, or an object array: element by element
        values = array.tolist()
        for i, t in enumerate(values):
            if isinstance(t, _BOOLS) or not isinstance(t, int | np.integer):
                raise TypeError(f"{name}[{i}]={t!r} is not a token id (an int; bools are refused)")
        ints = [int(t) for t in values]
        bad = next((t for t in ints if not INT32_MIN <= t <= INT32_MAX), None)
        if bad is not None:
            raise ValueError(f"{_where(name)}token {bad} is outside int32 [{INT32_MIN}, {INT32_MAX}]")
        return np.array(ints, dtype=np.int32)
    if not np.issubdtype(array.dtype, np.integer):
        raise TypeError(f"{name} must be integers, got dtype {array.dtype}")
    if array is not tokens and not hasattr(tokens, "__array__") and not _NO_BOOL(map(type, tokens)):
        i, t = next((i, t) for i, t in enumerate(tokens) if isinstance(t, _BOOLS))  # numpy made a bool 0 or 1
        raise TypeError(f"{name}[{i}]={t!r} is not a token id (an int; bools are refused)")
    low, high = int(array.min()), int(array.max())
    if low < INT32_MIN or high > INT32_MAX:
        bad = low if low < INT32_MIN else high
        raise ValueError(f"{_where(name)}token {bad} is outside int32 [{INT32_MIN}, {INT32_MAX}]")
    return array.astype(np.int32)


def check_int(name: str, value: Any, minimum: int, maximum: int = INT64_MAX) -> None:
    """Raise TypeError unless `value` is an int (bool excluded), ValueError outside [`minimum`, `maximum`]
    (by default int64's range: no size of pagedkv is larger)."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name}={value!r} must be an int")
    if value < minimum:
        raise ValueError(f"{name}={value} must be at least {minimum}")
    if value > maximum:
        raise ValueError(f"{name}={value} must be at most {maximum}")


def check_eviction(eviction_policy: Any, protected_fraction: Any, leaves_first: Any, policies: Collection[str]) -> None:
    """Raise ValueError/TypeError unless the eviction settings of a page pool are valid; `policies` are the
    allowed names of ``eviction_policy`` (the registry's, `pagedkv.core.pool.EVICTION_POLICIES`)."""
    if not isinstance(leaves_first, bool):
        raise TypeError(f"evict_leaves_first={leaves_first!r} must be a bool")
    if not isinstance(eviction_policy, str) or eviction_policy not in policies:
        raise ValueError(f"eviction_policy={eviction_policy!r} must be one of {tuple(policies)}")
    if isinstance(protected_fraction, bool) or not isinstance(protected_fraction, int | float):
        raise TypeError(f"protected_fraction={protected_fraction!r} must be a float")
    if not 0.0 <= protected_fraction <= 1.0:
        raise ValueError(f"protected_fraction={protected_fraction} must be in [0, 1]")


NONFINITE_KV = ("pass", "reject")


def check_weights_version(version: object, name: str = "weights_version") -> None:
    """None or a non-empty str of at most 1024 characters."""
    if version is None:
        return
    if not isinstance(version, str):
        raise TypeError(f"{name}={version!r} must be a str or None")
    if not version or len(version) > 1024:
        raise ValueError(f"{name} has {len(version)} characters; it must have 1 to 1024")


def normalize_hash_seed(seed: bytes | str | None, resolve_default: bool = False) -> bytes | None:
    """A 32-byte seed from bytes or 64 hex characters; None stays None, or with `resolve_default`
    becomes the deployment's seed (`pagedkv.params.deployment_seed`)."""
    if seed is None:
        if not resolve_default:
            return None
        from pagedkv.params.deployment_seed import deployment_seed

        return deployment_seed()
    if isinstance(seed, str):
        try:
            seed = bytes.fromhex(seed)
        except ValueError:
            raise ValueError(f"kv_hash_seed={seed!r} is not hex") from None
    if not isinstance(seed, bytes | bytearray):
        raise TypeError(f"kv_hash_seed={seed!r} must be bytes, a hex str or None")
    if len(seed) != 32:
        raise ValueError(f"kv_hash_seed has {len(seed)} bytes; it must have exactly 32")
    return bytes(seed)


def validate_attention_kind(params: Any) -> None:
    """Window, chunk, sinks and cross-attention: valid values, and only combinations that exist."""
    for name in ("sliding_window", "attention_chunk_size"):
        if getattr(params, name) is not None:
            check_int(name, getattr(params, name), 1)
    check_int("sink_tokens", params.sink_tokens, 0)
    if not isinstance(params.is_cross_attention, bool):
        raise TypeError(f"is_cross_attention={params.is_cross_attention!r} must be a bool")
    if params.sliding_window is not None and params.attention_chunk_size is not None:
        raise ValueError("sliding_window and attention_chunk_size cannot both be set")
    if params.sink_tokens and params.sliding_window is None:
        raise ValueError(f"sink_tokens={params.sink_tokens} needs a sliding_window (full attention keeps every token)")
    if params.is_cross_attention and (params.sliding_window or params.attention_chunk_size or params.sink_tokens):
        raise ValueError("is_cross_attention=True takes no sliding_window, attention_chunk_size or sink_tokens")


def validate_partial_page_reuse(params: Any) -> None:
    """`enable_partial_page_reuse` needs prefix caching, and no tier below the device (not supported)."""
    if not params.enable_partial_page_reuse:
        return
    if not params.enable_prefix_caching:
        raise ValueError("enable_partial_page_reuse=True requires enable_prefix_caching=True")
    connector = params.kv_connector
    if connector is not None and connector.value != "null":
        raise ValueError(
            f"enable_partial_page_reuse=True does not support kv_connector={connector.value} (tiers below the device)"
        )
