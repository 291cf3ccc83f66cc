"""Request state the cache reads and advances: `TokenBuffer` and `TextContext`.

A token buffer splits a request's tokens into three regions::

    0 ......... processed_length ......... current_position ......... len(tokens)
    |  KV in the cache  |  active: this forward pass  |  later chunks (chunked prefill only)

`alloc` may move `processed_length` forward over a prefix-cache hit
(`skip_processing`); `update` moves the window past what the model just ran.
"""

from __future__ import annotations

import sys
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pagedkv.core.hashing import check_salt
from pagedkv.params.validation import as_token_array

__all__ = ["TokenBuffer", "TextContext", "RequestID", "Retention", "as_token_array", "check_request_id"]

RequestID = Hashable
"""Any hashable request id (MAX uses strings)."""

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
_NATIVE_LE = sys.byteorder == "little"  # (int32 token arrays are native: little-endian bytes need no swap)


def _count(method: str, n: Any) -> int:
    """`n` as an int; TypeError unless an integer (bool excluded)."""
    if type(n) is int:
        return n
    if isinstance(n, bool) or not isinstance(n, int | np.integer):
        raise TypeError(f"{method}(n={n!r}): n must be an int")
    return int(n)


class TokenBuffer:
    """A growable int32 token array with a processing window (see module docstring).

    Four plain fields, read on the bookkeeping's hot paths (a field read costs a fraction of a property's):
    `length` (tokens; ``len(tokens)``), `processed` (``processed_length``), `end` (``current_position``) and
    `prompt_end` (``prompt_length``). Read them freely; change them only through the methods below, which
    keep ``0 <= processed <= end <= length``.
    """

    __slots__ = ("_array", "length", "processed", "end", "prompt_end")

    def __init__(self, tokens: Sequence[int] | np.ndarray) -> None:
        array = as_token_array(tokens, copy=False)  # (copied into the buffer below)
        n = len(array)
        self._array = np.empty(max(16, 2 * n), dtype=np.int32)
        self._array[:n] = array
        self.length = n
        self.processed = 0
        self.end = n
        self.prompt_end = n

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int | slice) -> Any:
        return self.all[index]

    def __repr__(self) -> str:
        return f"TokenBuffer(len={self.length}, processed={self.processed}, active={self.active_length})"

    @property
    def all(self) -> np.ndarray:
        """Every token, prompt and generated: a read-only int32 view."""
        view = self._array[: self.length]
        view.flags.writeable = False
        return view

    def le_bytes(self, start: int, stop: int) -> bytes:
        """Tokens ``[start, stop)`` as int32 little-endian bytes (what prefix hashing reads), without a view of
        every token first."""
        if not 0 <= start <= stop <= self.length:
            raise ValueError(f"le_bytes({start}, {stop}) needs 0 <= start <= stop <= len(tokens)={self.length}")
        view = self._array[start:stop]
        return view.tobytes() if _NATIVE_LE else view.astype("<i4").tobytes()

    @property
    def active(self) -> np.ndarray:
        """The tokens of the next forward pass: ``all[processed_length:current_position]``."""
        return self.all[self.processed : self.end]

    @property
    def processed_length(self) -> int:
        """Tokens whose KV is already in the cache."""
        return self.processed

    @property
    def active_length(self) -> int:
        """Tokens the next forward pass runs."""
        return self.end - self.processed

    @property
    def current_position(self) -> int:
        """End of the active window."""
        return self.end

    @property
    def prompt_length(self) -> int:
        """Tokens given as prompt (everything, after `reset_as_new_prompt`)."""
        return self.prompt_end

    @property
    def generated_length(self) -> int:
        """Tokens appended by `advance_with_token`."""
        return self.length - self.prompt_end

    @property
    def is_chunked(self) -> bool:
        """True while the active window stops before the last token (chunked prefill)."""
        return self.end < self.length

    def skip_processing(self, n: int) -> None:
        """Treat the first `n` active tokens as already cached; one must stay active."""
        n = _count("skip_processing", n)
        if not 0 <= n < self.active_length:
            raise ValueError(f"skip_processing(n={n}) needs 0 <= n < active_length={self.active_length}")
        self.processed += n

    def rewind_processing(self, n: int) -> None:
        """Move `processed_length` back by `n` tokens (their KV must be recomputed)."""
        n = _count("rewind_processing", n)
        if not 0 <= n <= self.processed:
            raise ValueError(f"rewind_processing(n={n}) needs 0 <= n <= processed_length={self.processed}")
        self.processed -= n

    def chunk(self, n: int) -> None:
        """Shrink the active window to its first `n` tokens (chunked prefill)."""
        n = _count("chunk", n)
        if not 1 <= n < self.active_length:
            raise ValueError(f"chunk(n={n}) needs 1 <= n < active_length={self.active_length}")
        self.end = self.processed + n

    def unchunk(self) -> None:
        """Widen the active window back to every unprocessed token (undoes `chunk`)."""
        self.end = self.length

    def advance_chunk(self) -> None:
        """Mark the current chunk processed; the rest of the tokens become active."""
        self.processed = self.end
        self.end = self.length

    def advance_with_token(self, token: int) -> None:
        """Mark the window processed and append `token` as the new active token."""
        n, array = self.length, self._array  # (locals: this runs once per request per decode step)
        if self.end < n:
            raise ValueError("advance_with_token while chunked: call advance_chunk() first")
        if type(token) is not int and (not isinstance(token, int | np.integer) or isinstance(token, bool)):
            raise TypeError(f"token={token!r} must be an int")
        if not _INT32_MIN <= token <= _INT32_MAX:
            raise ValueError(f"token {token} is outside int32 [{_INT32_MIN}, {_INT32_MAX}]")
        if n == len(array):
            array = np.empty(2 * n, dtype=np.int32)
            array[:n] = self._array[:n]
            self._array = array
        array[n] = token
        self.processed = n
        self.length = self.end = n + 1

    def reset_as_new_prompt(self) -> None:
        """Forget all processing: every token (generated ones too) becomes prompt."""
        self.processed = 0
        self.end = self.length
        self.prompt_end = self.length


@dataclass(frozen=True)
class Retention:
    """How long the pages a request caches should stay (TensorRT-LLM's retention priorities).

    `priority` 0..100 (default pages have 35; lower is evicted first, 100 is evicted only when
    nothing else is free). `duration_s`: seconds after the page is cached (or reused) until it drops
    back to 35; None keeps it for as long as the page stays cached.
    """

    priority: int
    duration_s: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.priority, int) or isinstance(self.priority, bool) or not 0 <= self.priority <= 100:
            raise ValueError(f"priority={self.priority!r} must be an int in [0, 100]")
        d = self.duration_s
        if d is not None and (isinstance(d, bool) or not isinstance(d, int | float) or not d > 0 or d == float("inf")):
            raise ValueError(f"duration_s={d!r} must be a finite number of seconds > 0, or None")


def check_request_id(request_id: Any) -> None:
    """TypeError unless `request_id` is hashable and not None."""
    if request_id is None:
        raise TypeError("request_id=None: a request needs a hashable id (str, int, ...)")
    try:
        hash(request_id)
    except TypeError:
        raise TypeError(f"request_id={request_id!r} must be hashable, got {type(request_id).__name__}") from None


class TextContext:
    """One request: id, tokens, stopping length and tenant salt.

    Args:
        request_id: unique id of the request (hashable).
        tokens: prompt token ids (int32 range).
        max_length: longest the sequence may grow (prompt + generated); None means no limit.
        cache_salt: tenant key; requests with different salts never share pages.
        encoder_length: encoder tokens of an encoder-decoder request (cross-attention pages); 0 otherwise.
    """

    __slots__ = (
        "request_id", "tokens", "max_length", "cache_salt", "cached_prefix_length", "cache_seq_id", "encoder_length",
        "retention", "key_cache",
    )  # fmt: skip

    def __init__(
        self,
        request_id: RequestID,
        tokens: Sequence[int] | np.ndarray,
        max_length: int | None = None,
        cache_salt: str | None = None,
        encoder_length: int = 0,
    ) -> None:
        check_request_id(request_id)
        check_salt(cache_salt)
        self.tokens = TokenBuffer(tokens)
        if max_length is not None and (not isinstance(max_length, int) or isinstance(max_length, bool)):
            raise TypeError(f"max_length={max_length!r} must be an int or None")
        if max_length is not None and not len(self.tokens) <= max_length <= _INT32_MAX:
            raise ValueError(f"max_length={max_length!r} must be an int >= the prompt length {len(self.tokens)} "
                             f"and at most {_INT32_MAX}")  # fmt: skip
        self.request_id = request_id
        self.max_length = max_length
        self.cache_salt = cache_salt
        self.cached_prefix_length = 0
        self.cache_seq_id: int | None = None
        if not isinstance(encoder_length, int) or isinstance(encoder_length, bool):
            raise TypeError(f"encoder_length={encoder_length!r} must be an int")
        if not 0 <= encoder_length <= _INT32_MAX:
            raise ValueError(f"encoder_length={encoder_length!r} must be an int in [0, {_INT32_MAX}]")
        self.encoder_length = encoder_length
        self.retention: Retention | None = None  # eviction priority of the pages this request caches
        # (hasher, chain root, keys of the leading full pages, digest after them): a manager's memo of this
        # request's prefix keys, kept across failed admissions and preemptions (tokens only ever grow)
        self.key_cache: tuple[object, bytes, list[Any], bytes] | None = None

    def __repr__(self) -> str:
        return f"TextContext({self.request_id!r}, {self.tokens!r})"

    @property
    def is_done(self) -> bool:
        """True once the sequence has reached `max_length`."""
        return self.max_length is not None and len(self.tokens) >= self.max_length

    def update(self, token: int) -> None:
        """Record the forward pass just run: finish a prefill chunk, or append the sampled token.

        On a chunked context the token is ignored (it was sampled mid-prompt).
        """
        tokens = self.tokens  # (fields, not properties: this runs once per request per step)
        if tokens.end < tokens.length:
            tokens.advance_chunk()
            return
        if self.max_length is not None and tokens.length >= self.max_length:
            raise ValueError(f"request {self.request_id!r} reached max_length={self.max_length}")
        tokens.advance_with_token(token)

    def reset(self) -> None:
        """Restart as a new prompt (after preemption): nothing is processed any more."""
        self.tokens.reset_as_new_prompt()
        self.cached_prefix_length = 0

    def assign_to_cache(self, seq_id: int) -> None:
        """Bind this request to a `KVCacheManager` slot returned by `claim`."""
        self.cache_seq_id = seq_id
