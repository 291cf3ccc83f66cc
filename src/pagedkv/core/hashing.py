"""Chained page hashes for prefix caching (MAX's scheme, reproducible with hashlib).

For page i holding tokens ``t[i*P:(i+1)*P]`` (as little-endian int32)::

    d_i = H(H(int32_le(page_i)) || d_{i-1}),   d_{-1} = root
    root = base                                  (no cache_salt)
         = base XOR SHA256(utf8(cache_salt))     (with a cache_salt)
    base = seed                                  (no weights version: MAX's chain)
         = SHA256("pagedkv-weights" || 0x00 || seed || utf8(version))

``seed`` is the deployment's secret (`pagedkv.deployment_seed`; 32 zero
bytes when none is given to these functions). Because every digest folds
in its parent, equal keys mean equal whole prefixes, not just equal pages,
and requests of different tenants (salts) or different weights versions
never share a key. The algorithms:

- ``sha256``: H = SHA-256, key = the 32-byte digest.
- ``sha256_64``: the same chain; key = first 8 digest bytes as a big-endian
  signed int (the chain itself carries the full digests).
- ``xxh3_128``: H = XXH3-128 (needs the ``xxhash`` package), 16-byte keys,
  root truncated to 16 bytes. About 4x cheaper, not collision resistant:
  use it only where every client of the cache is trusted.

Only full pages are hashed, and never the last token of a sequence (its
logits must be computed), so a sequence of n tokens has (n - 1) // P keys.

`PrefixHasher` remembers recent digests by their exact inputs (parent digest
followed by the page's bytes). A prompt that repeats a recent prefix (a
shared system prompt, the previous turn of a chat) costs one dict lookup per
page instead of two hash calls; keys are compared byte for byte, so the
chain is the same, bit for bit.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import numpy as np

from pagedkv.validation import check_int

BlockHash = bytes | int
"""A prefix-cache key: bytes (sha256, xxh3_128) or a signed 64-bit int (sha256_64)."""

__all__ = ["BlockHash", "PrefixHasher", "check_salt", "check_seed", "root_digest", "hash_tokens"]

_ZERO_SEED = bytes(32)
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


def check_salt(cache_salt: object) -> None:
    """TypeError unless `cache_salt` is a str or None."""
    if cache_salt is not None and not isinstance(cache_salt, str):
        raise TypeError(f"cache_salt={cache_salt!r} must be a str or None")


def check_seed(name: str, seed: object) -> None:
    """TypeError unless `seed` is bytes or None, ValueError unless it has exactly 32 bytes."""
    if seed is not None and (not isinstance(seed, bytes) or len(seed) != 32):
        raise (ValueError if isinstance(seed, bytes) else TypeError)(f"{name}={seed!r} must be 32 bytes or None")


def root_digest(seed: bytes | None = None, cache_salt: str | None = None, version: str | None = None) -> bytes:
    """The 32-byte parent of a chain's first page: base(seed, version) XOR SHA256(cache_salt)."""
    base = seed or _ZERO_SEED
    if version:
        base = hashlib.sha256(b"pagedkv-weights\x00" + base + version.encode("utf-8")).digest()
    if not cache_salt:
        return base
    salt = hashlib.sha256(cache_salt.encode("utf-8")).digest()
    return bytes(a ^ b for a, b in zip(base, salt, strict=True))


def _xxh3_128() -> Callable[[bytes], bytes]:
    try:
        import xxhash
    except ImportError:  # pragma: no cover - depends on the environment
        raise ImportError("kv_hash_algo='xxh3_128' needs the xxhash package: pip install 'pagedkv[xxhash]'") from None
    return xxhash.xxh3_128_digest  # type: ignore[no-any-return]


class PrefixHasher:
    """Computes the keys of consecutive full pages of a token sequence.

    Stateless apart from its configuration: callers keep the digest of the
    last page they hashed and pass it back as `parent` to extend the chain.
    """

    def __init__(
        self, algo: str, page_size: int, seed: bytes | None = None, memo_pages: int = 32768, version: str | None = None
    ) -> None:
        """Args:
        algo: "sha256", "sha256_64" or "xxh3_128".
        page_size: tokens per page.
        seed: 32-byte chain seed (None: zeros).
        memo_pages: pages remembered, in two generations of this many
            (about 250 bytes each); 0 turns the memo off.
        version: the model weights version folded into every root (None: none).
        """
        if algo not in ("sha256", "sha256_64", "xxh3_128"):
            raise ValueError(f"kv_hash_algo={algo!r} must be one of ('sha256', 'sha256_64', 'xxh3_128')")
        self.algo = algo
        self.page_size = page_size
        self.seed = seed
        self.memo_pages = memo_pages
        self._xxh: Callable[[bytes], bytes] | None = _xxh3_128() if algo == "xxh3_128" else None
        self._width = 16 if algo == "xxh3_128" else 32
        self._memo: dict[bytes, bytes] = {}  # parent digest + page bytes -> digest (current generation)
        self._memo_old: dict[bytes, bytes] = {}  # the previous generation, dropped when this one fills
        self.version = version
        self._roots: dict[str | None, bytes] = {}  # cache_salt -> root, for the current version

    def root(self, cache_salt: str | None = None) -> bytes:
        """The parent digest of page 0 for a request with `cache_salt`, under the current weights version."""
        root = self._roots.get(cache_salt)
        if root is None:
            if len(self._roots) >= 4096:
                self._roots.clear()
            root = self._roots[cache_salt] = root_digest(self.seed, cache_salt, self.version)[: self._width]
        return root

    def set_version(self, version: str | None) -> None:
        """Start every later chain from `version`'s root; keys of earlier versions never match again.
        (The digest memo stays: its entries are keyed by their parent, which differs per version.)"""
        self.version = version or None
        self._roots = {}

    def extend(self, tokens: np.ndarray, start: int, stop: int, parent: bytes) -> tuple[list[BlockHash], bytes]:
        """Keys of pages [start, stop) of `tokens`, chained from `parent`.

        Args:
            tokens: the whole sequence, an integer array (values within int32).
            start, stop: page indices; ``stop * page_size`` must not exceed len(tokens).
            parent: the digest of page ``start - 1`` (or `root()` when start == 0).

        Returns:
            (keys, digest of page stop - 1); `parent` itself when the range is empty.
        """
        ps = self.page_size
        data = tokens[start * ps : stop * ps].astype("<i4", copy=False).tobytes()
        step = 4 * ps
        digests: list[bytes] = []
        append = digests.append
        memo, old, cap = self._memo, self._memo_old, self.memo_pages
        xxh, sha = self._xxh, hashlib.sha256
        seeking = cap > 0  # after the first miss every parent is new: stop looking, keep recording
        for offset in range(0, len(data), step):
            page = data[offset : offset + step]
            key = parent + page
            if seeking:
                digest = memo.get(key) or old.get(key)
                if digest is not None:
                    parent = digest
                    append(digest)
                    continue
                seeking = False
            # inlined: a helper call per page would cost ~15% here
            digest = xxh(xxh(page) + parent) if xxh else sha(sha(page).digest() + parent).digest()
            if cap:
                memo[key] = digest
                if len(memo) >= cap:
                    self._memo_old, self._memo = old, memo = memo, {}
            parent = digest
            append(digest)
        if self.algo == "sha256_64":
            from_bytes = int.from_bytes
            return [from_bytes(d[:8], "big", signed=True) for d in digests], parent
        return digests, parent  # type: ignore[return-value]


def hash_tokens(
    tokens: np.ndarray | list[int],
    page_size: int,
    algo: str = "sha256",
    seed: bytes | None = None,
    cache_salt: str | None = None,
    version: str | None = None,
) -> list[BlockHash]:
    """The prefix-cache keys of a whole sequence: one per full page of ``tokens[:-1]``, as a manager with
    the same algorithm, seed, salt and weights version computes them (`seed` None: the deployment's
    default seed, as in `KVCacheParams`)."""
    array = np.asarray(tokens)
    if array.ndim != 1 or (array.size and not np.issubdtype(array.dtype, np.integer)):
        raise TypeError(f"tokens must be a 1-D integer sequence, got shape {array.shape} dtype {array.dtype}")
    if array.size and (array.min() < _INT32_MIN or array.max() > _INT32_MAX):
        raise ValueError(f"tokens hold values outside int32 [{_INT32_MIN}, {_INT32_MAX}]")
    check_int("page_size", page_size, 1)
    check_seed("seed", seed)
    check_salt(cache_salt)
    if seed is None:
        from pagedkv.deployment_seed import deployment_seed

        seed = deployment_seed()
    hasher = PrefixHasher(algo, page_size, seed, memo_pages=0, version=version)
    n_pages = max(len(array) - 1, 0) // page_size
    return hasher.extend(array, 0, n_pages, hasher.root(cache_salt))[0]
