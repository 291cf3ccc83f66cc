"""Chained page hashes for prefix caching (MAX's scheme, reproducible with hashlib).

For page i holding tokens ``t[i*P:(i+1)*P]`` (as little-endian int32)::

    d_i = H(H(int32_le(page_i)) || d_{i-1}),   d_{-1} = root
    root = base                                  (cache_salt None: no salt)
         = base XOR SHA256(utf8(cache_salt))     (a cache_salt: a non-empty str; "" is refused)
    base = seed                                  (no weights version: MAX's chain)
         = SHA256("pagedkv-weights" || 0x00 || seed || utf8(version))

``seed`` is the deployment's secret (`pagedkv.params.deployment_seed`; 32 zero
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

`PrefixHasher` remembers the chains it computed as *runs*: the bytes of
consecutive pages and their digests, each run found by its exact start (the
parent digest followed by its first page's bytes). A prompt that repeats a
recent prefix (a shared system prompt, the previous turn of a chat) follows
the runs it shares (one dict lookup and a byte comparison per run) instead of
making two hash calls per page, and a prompt nobody saw before is recorded as
one run, not page by page. Bytes are compared exactly, so the chain is the
same, bit for bit.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from pagedkv.params.validation import as_token_array, check_int

BlockHash = bytes | int
"""A prefix-cache key: bytes (sha256, xxh3_128) or a signed 64-bit int (sha256_64)."""

__all__ = ["BlockHash", "PrefixHasher", "check_salt", "check_seed", "root_digest", "hash_tokens"]

_ZERO_SEED = bytes(32)
_LE_INT32 = np.dtype("<i4")


def check_salt(cache_salt: object) -> None:
    """TypeError unless `cache_salt` is a str or None; ValueError for the empty str.

    The one check of every entry a salt comes in by (contexts, engines, `hash_tokens`, `pin_prefix`,
    the router's hashers and HTTP bodies). None means no salt; every non-empty str is a tenant of its
    own. "" is refused rather than read as "no salt" or as one more tenant (as vLLM's server refuses it):
    a caller that means no salt says None, so no tenant can land in the unsalted chain by accident."""
    if cache_salt is None:
        return
    if not isinstance(cache_salt, str):
        raise TypeError(f"cache_salt={cache_salt!r} must be a str or None")
    if not cache_salt:
        raise ValueError("cache_salt='' is empty: give None for no salt, or a non-empty str (one per tenant)")


def check_seed(name: str, seed: object) -> None:
    """TypeError unless `seed` is bytes or None, ValueError unless it has exactly 32 bytes."""
    if seed is not None and (not isinstance(seed, bytes) or len(seed) != 32):
        raise (ValueError if isinstance(seed, bytes) else TypeError)(f"{name}={seed!r} must be 32 bytes or None")


def root_digest(seed: bytes | None = None, cache_salt: str | None = None, version: str | None = None) -> bytes:
    """The 32-byte parent of a chain's first page: base(seed, version) XOR SHA256(cache_salt) (`cache_salt`
    None: base alone; "" raises ValueError, see `check_salt`)."""
    check_salt(cache_salt)
    base = seed or _ZERO_SEED
    if version:
        base = hashlib.sha256(b"pagedkv-weights\x00" + base + version.encode("utf-8")).digest()
    if cache_salt is None:
        return base
    salt = hashlib.sha256(cache_salt.encode("utf-8")).digest()
    return bytes(a ^ b for a, b in zip(base, salt, strict=True))


def _xxh3_128() -> Callable[[bytes], bytes]:
    try:
        import xxhash
    except ImportError:  # pragma: no cover - depends on the environment
        raise ImportError("kv_hash_algo='xxh3_128' needs the xxhash package: pip install 'pagedkv[xxhash]'") from None
    return xxhash.xxh3_128_digest  # type: ignore[no-any-return]


@dataclass(slots=True, eq=False)
class _Run:
    """Consecutive pages of one chain: their bytes (int32 little-endian, page after page) and the digest after
    each page."""

    data: bytes
    digests: list[bytes]


def _common_pages(run: bytes, data: bytes, offset: int, step: int, limit: int) -> int:
    """How many leading whole pages (`step` bytes each, at most `limit`) of `run` equal those of `data` from
    `offset`; the first one is known to match. (Byte slices compare with memcmp: a binary search costs a few
    short copies.)"""
    hi = min(len(run) // step, limit)
    if run[: hi * step] == data[offset : offset + hi * step]:
        return hi
    lo = 1  # pages [0, lo) match; [0, hi) do not all match
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if run[lo * step : mid * step] == data[offset + lo * step : offset + mid * step]:
            lo = mid
        else:
            hi = mid
    return lo


class PrefixHasher:
    """Computes the keys of consecutive full pages of a token sequence.

    Stateless apart from its configuration and its memo of runs (module docstring): callers keep the digest
    of the last page they hashed and pass it back as `parent` to extend the chain.
    """

    def __init__(
        self, algo: str, page_size: int, seed: bytes | None = None, memo_pages: int = 32768, version: str | None = None
    ) -> None:
        """Args:
        algo: "sha256", "sha256_64" or "xxh3_128".
        page_size: tokens per page.
        seed: 32-byte chain seed (None: zeros).
        memo_pages: pages remembered in runs, in two generations of about this many (the older one is
            dropped when the newer fills); 0 turns the memo off.
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
        self._runs: dict[bytes, _Run] = {}  # parent digest + first page bytes -> run (current generation)
        self._runs_old: dict[bytes, _Run] = {}  # the previous generation, dropped when this one fills
        self._run_pages = 0  # pages in the current generation's runs
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
        (The memo stays: its runs are keyed by their parent, which differs per version.)"""
        self.version = version or None
        self._roots = {}

    @property
    def memo_size(self) -> int:
        """Pages remembered now, over both generations of runs."""
        return sum(len(run.digests) for runs in (self._runs, self._runs_old) for run in runs.values())

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
        return self.extend_bytes(tokens[start * ps : stop * ps].astype(_LE_INT32, copy=False).tobytes(), parent)

    def extend_bytes(self, data: bytes, parent: bytes, memo: bool = True) -> tuple[list[BlockHash], bytes]:
        """`extend` over pages given as their bytes: `data` holds whole pages of int32 little-endian tokens
        (``4 * page_size`` bytes each). Returns (keys, digest of the last page); `parent` when `data` is empty.
        `memo` False neither reads nor records runs: for a request's own next pages (a decode step's), which
        nobody else hashed, and which cost less to hash again, should a later prompt hold them, than to record."""
        if not (memo and self.memo_pages):
            digests: list[bytes] = []
            parent = self._hash_pages(data, 0, parent, digests)
            return self._keys(digests), parent
        step = 4 * self.page_size
        n = len(data) // step
        digests = []
        done = 0
        runs, old = self._runs, self._runs_old
        while done < n:  # follow the recorded runs this chain shares
            key = parent + data[done * step : (done + 1) * step]
            run = runs.get(key)
            if run is None:
                run = old.get(key)
                if run is None:
                    break
                self._keep(key, run)  # (still in use: into the current generation)
                runs, old = self._runs, self._runs_old
            m = _common_pages(run.data, data, done * step, step, n - done)
            digests += run.digests[:m]
            parent = run.digests[m - 1]
            done += m
        else:
            return self._keys(digests), parent
        parent = self._hash_pages(data, done * step, parent, digests)  # (`key` starts the new run)
        self._keep(key, _Run(data[done * step :], digests[done:]))  # (bytes[0:] is the same object)
        return self._keys(digests), parent

    def _hash_pages(self, data: bytes, offset: int, parent: bytes, digests: list[bytes]) -> bytes:
        """Chain the pages of `data` from byte `offset` onto `parent`, appending each digest to `digests`;
        returns the last digest."""
        step, append = 4 * self.page_size, digests.append
        xxh, sha = self._xxh, hashlib.sha256
        for start in range(offset, len(data) - step + 1, step):
            page = data[start : start + step]
            # inlined: a helper call per page would cost ~15% here
            parent = xxh(xxh(page) + parent) if xxh else sha(sha(page).digest() + parent).digest()
            append(parent)
        return parent

    def _keep(self, key: bytes, run: _Run) -> None:
        """Record `run` (its first `memo_pages` pages) under `key` in the current generation; when that would
        pass `memo_pages` pages, the current generation becomes the old one and the old one goes."""
        cap = self.memo_pages
        if len(run.digests) > cap:
            run = _Run(run.data[: cap * 4 * self.page_size], run.digests[:cap])
        if self._run_pages + len(run.digests) > cap:
            self._runs_old, self._runs, self._run_pages = self._runs, {}, 0
        self._runs_old.pop(key, None)
        self._runs[key] = run
        self._run_pages += len(run.digests)

    def _keys(self, digests: list[bytes]) -> list[BlockHash]:
        if self.algo == "sha256_64":
            from_bytes = int.from_bytes
            return [from_bytes(d[:8], "big", signed=True) for d in digests]
        return digests  # type: ignore[return-value]


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
    array = as_token_array(tokens, allow_empty=True)
    check_int("page_size", page_size, 1)
    check_seed("seed", seed)
    check_salt(cache_salt)
    if seed is None:
        from pagedkv.params.deployment_seed import deployment_seed

        seed = deployment_seed()
    hasher = PrefixHasher(algo, page_size, seed, memo_pages=0, version=version)
    n_pages = max(len(array) - 1, 0) // page_size
    return hasher.extend(array, 0, n_pages, hasher.root(cache_salt))[0]
