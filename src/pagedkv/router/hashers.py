"""Block hashes as an engine's KV events carry them, recomputed by the router from a request's tokens.

A router cannot read an engine's cache; it can only recompute, for a new request, the keys the engine
would give its leading blocks and look them up in what the engine announced. Two schemes:

- `PagedKVHasher`: pagedkv's chain (`pagedkv.core.hashing`): ``sha256``, ``sha256_64`` or ``xxh3_128``
  from the deployment's 32-byte seed, the cache salt and the weights version.
- `VLLMHasher`: vLLM's ``hash_block_tokens``: ``H((parent or NONE_HASH, tuple(block), extra_keys))`` with
  ``H`` one of ``sha256`` (pickle), ``sha256_cbor`` (canonical CBOR), ``xxhash`` / ``xxhash_cbor``
  (XXH3-128), ``NONE_HASH = H(seed)`` (``"vllm-none-hash"`` unless ``PYTHONHASHSEED`` was set for the
  engine), and ``extra_keys = (("cache_salt", salt),)`` on the first block only.

Both hash the full blocks of ``tokens[:-1]`` (an engine always computes the last token) and return
the keys in the events' form: with ``int_hashes`` (vLLM's default) the low 64 bits of the key as an
unsigned int, else the raw key. No side effects beyond a small memo of roots.
"""

from __future__ import annotations

import hashlib
import pickle
import struct
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from pagedkv.core.hashing import PrefixHasher, check_salt
from pagedkv.params.validation import as_token_array, check_int

__all__ = ["BlockHasher", "PagedKVHasher", "VLLMHasher", "cbor_canonical", "wire_hash"]

_MASK64 = (1 << 64) - 1
VLLM_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")


def wire_hash(key: bytes | int, int_hashes: bool = True) -> bytes | int:
    """`key` as KV events send it: the low 64 bits (big-endian bytes) as an unsigned int, or unchanged."""
    if not int_hashes:
        return key
    if isinstance(key, int):
        return key & _MASK64
    return int.from_bytes(key, "big") & _MASK64


class BlockHasher(Protocol):
    """Computes an engine's event hashes for a token sequence."""

    block_size: int

    def hashes(self, tokens: Sequence[int] | np.ndarray, salt: str | None = None) -> list[bytes | int]:
        """The event hashes of the full blocks of ``tokens[:-1]``, in order."""
        ...  # pragma: no cover


class PagedKVHasher:
    """pagedkv's chained page keys (`PrefixHasher`) in event form.

    Args:
        page_size: the engine's tokens per page.
        algo: the engine's ``kv_hash_algo``.
        seed: the engine's 32-byte ``kv_hash_seed`` (None: this machine's `deployment_seed`, as the
            engine resolves it when it runs here with the same environment).
        version: the engine's weights version (None: none).
        int_hashes: how the engine's publisher sends hashes (`ZmqEventPublisher.int_hashes`).
    """

    def __init__(
        self, page_size: int, algo: str = "sha256", seed: bytes | None = None, version: str | None = None,
        int_hashes: bool = True,
    ) -> None:  # fmt: skip
        check_int("page_size", page_size, 1)
        if seed is None:
            from pagedkv.params.deployment_seed import deployment_seed

            seed = deployment_seed()
        self.block_size = page_size
        self.int_hashes = bool(int_hashes)
        self._hasher = PrefixHasher(algo, page_size, seed, memo_pages=4096, version=version)

    def hashes(self, tokens: Sequence[int] | np.ndarray, salt: str | None = None) -> list[bytes | int]:
        """See `BlockHasher.hashes`; raises as `as_token_array` (allowing empty) and `check_salt` do."""
        array = as_token_array(tokens, copy=False, allow_empty=True)
        check_salt(salt)
        n = max(len(array) - 1, 0) // self.block_size
        keys, _ = self._hasher.extend(array, 0, n, self._hasher.root(salt))
        return [wire_hash(k, self.int_hashes) for k in keys]


def cbor_canonical(value: Any) -> bytes:
    """Canonical CBOR (RFC 8949 §4.2.1, as ``cbor2.dumps(canonical=True)``) of the values vLLM hashes:
    None, bool, int, bytes, str and lists/tuples of them. Raises TypeError for anything else."""
    out = bytearray()
    _cbor(value, out)
    return bytes(out)


def _cbor_head(major: int, n: int, out: bytearray) -> None:
    if n < 24:
        out.append(major << 5 | n)
    elif n < 1 << 8:
        out += bytes((major << 5 | 24, n))
    elif n < 1 << 16:
        out += bytes((major << 5 | 25,)) + struct.pack(">H", n)
    elif n < 1 << 32:
        out += bytes((major << 5 | 26,)) + struct.pack(">I", n)
    elif n < 1 << 64:
        out += bytes((major << 5 | 27,)) + struct.pack(">Q", n)
    else:
        raise TypeError(f"integer {n} does not fit CBOR's 64-bit heads")


def _cbor(value: Any, out: bytearray) -> None:
    if value is None:
        out.append(0xF6)
    elif value is True or value is False:
        out.append(0xF5 if value else 0xF4)
    elif isinstance(value, int):
        _cbor_head(0, value, out) if value >= 0 else _cbor_head(1, -1 - value, out)
    elif isinstance(value, bytes | bytearray):
        _cbor_head(2, len(value), out)
        out += value
    elif isinstance(value, str):
        data = value.encode("utf-8")
        _cbor_head(3, len(data), out)
        out += data
    elif isinstance(value, list | tuple):
        _cbor_head(4, len(value), out)
        for item in value:
            _cbor(item, out)
    else:
        raise TypeError(f"cannot CBOR-encode {type(value).__name__} value {value!r}")


def _xxh3_128(data: bytes) -> bytes:
    try:
        import xxhash
    except ImportError:  # pragma: no cover - depends on the environment
        raise ImportError("vLLM's xxhash block hashes need the xxhash package: pip install xxhash") from None
    return xxhash.xxh3_128_digest(data)  # type: ignore[no-any-return]


def _hash_fn(algo: str) -> Callable[[Any], bytes]:
    if algo == "sha256":
        return lambda v: hashlib.sha256(pickle.dumps(v, protocol=pickle.HIGHEST_PROTOCOL)).digest()
    if algo == "sha256_cbor":
        return lambda v: hashlib.sha256(cbor_canonical(v)).digest()
    if algo == "xxhash":
        return lambda v: _xxh3_128(pickle.dumps(v, protocol=pickle.HIGHEST_PROTOCOL))
    return lambda v: _xxh3_128(cbor_canonical(v))


class VLLMHasher:
    """vLLM's block hashes (``prefix_caching_hash_algo``) in event form.

    Args:
        block_size: the engine's ``hash_block_size`` (its block size unless set apart).
        algo: one of ``sha256``, ``sha256_cbor``, ``xxhash``, ``xxhash_cbor``.
        none_hash_seed: the seed of ``NONE_HASH``: the engine's ``PYTHONHASHSEED`` when set, else
            ``"vllm-none-hash"`` (an xxhash engine without ``PYTHONHASHSEED`` draws a random seed
            and cannot be predicted: set it there).
        int_hashes: ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` of the engine (default 1).

    LoRA, multimodal and prompt-embeds extra keys are not modelled: such requests score 0.
    """

    def __init__(
        self, block_size: int, algo: str = "sha256", none_hash_seed: str = "vllm-none-hash", int_hashes: bool = True
    ) -> None:
        check_int("block_size", block_size, 1)
        if algo not in VLLM_ALGOS:
            raise ValueError(f"algo={algo!r} must be one of {VLLM_ALGOS}")
        if not isinstance(none_hash_seed, str):
            raise TypeError(f"none_hash_seed={none_hash_seed!r} must be a str")
        self.block_size = block_size
        self.algo = algo
        self.int_hashes = bool(int_hashes)
        self._fn = _hash_fn(algo)
        self.none_hash = self._fn(none_hash_seed)

    def hashes(self, tokens: Sequence[int] | np.ndarray, salt: str | None = None) -> list[bytes | int]:
        """See `BlockHasher.hashes`; raises as `as_token_array` (allowing empty) and `check_salt` do."""
        values = as_token_array(tokens, copy=False, allow_empty=True).tolist()
        check_salt(salt)
        bs, fn = self.block_size, self._fn
        parent, out = self.none_hash, []
        for i in range(max(len(values) - 1, 0) // bs):
            extra = (("cache_salt", salt),) if (i == 0 and salt is not None) else None
            parent = fn((parent, tuple(values[i * bs : (i + 1) * bs]), extra))
            out.append(wire_hash(parent, self.int_hashes))
        return out
