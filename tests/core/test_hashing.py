"""Prefix hashing: reproducible with hashlib alone, chained, salted, seeded."""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import pytest
import xxhash

from pagedkv.core.hashing import PrefixHasher, hash_tokens, root_digest
from pagedkv.params.deployment_seed import deployment_seed


def reference_sha256_chain(
    tokens: list[int], page: int, seed: bytes | None = None, salt: str | None = None
) -> list[bytes]:
    """MAX's prefix-cache hash chain, written from its documentation: d_i = SHA256(SHA256(int32_le(page_i)) || d_{i-1});
    the seed is the deployment's (hash_tokens' default) unless given."""
    seed = seed or deployment_seed()
    parent = seed
    if salt:
        parent = bytes(a ^ b for a, b in zip(seed, hashlib.sha256(salt.encode()).digest(), strict=True))
    out = []
    usable = tokens[:-1]
    for start in range(0, len(usable) - page + 1, page):
        block = struct.pack(f"<{page}i", *usable[start : start + page])
        parent = hashlib.sha256(hashlib.sha256(block).digest() + parent).digest()
        out.append(parent)
    return out


@pytest.mark.parametrize("page", [1, 3, 16, 64])
def test_sha256_matches_hashlib_reference(page: int) -> None:
    rng = np.random.default_rng(page)
    tokens = rng.integers(-(2**31), 2**31 - 1, size=200).tolist()
    assert hash_tokens(tokens, page) == reference_sha256_chain(tokens, page)


@pytest.mark.parametrize("page", [1, 2, 7, 16, 128, 1024])
def test_one_key_per_full_page_of_all_but_last_token(page: int) -> None:
    for n in (1, page, page + 1, 3 * page, 3 * page + 1):
        keys = hash_tokens(list(range(n)), page)
        assert len(keys) == (n - 1) // page
        assert all(len(k) == 32 and k != bytes(32) for k in keys)
        assert len(set(keys)) == len(keys)


def test_chain_property_and_incremental_extension() -> None:
    tokens = np.arange(100, dtype=np.int32)
    hasher = PrefixHasher("sha256", 8)
    keys, last = hasher.extend(tokens, 0, 12, hasher.root())
    first, mid = hasher.extend(tokens, 0, 5, hasher.root())
    rest, last2 = hasher.extend(tokens, 5, 12, mid)
    assert first + rest == keys and last2 == last == keys[-1]
    assert hasher.extend(tokens, 3, 3, b"p" * 32) == ([], b"p" * 32)


def test_prefix_equality_not_page_equality() -> None:
    page = 4
    a = [1, 2, 3, 4, 9, 9, 9, 9, 0]
    b = [5, 2, 3, 4, 9, 9, 9, 9, 0]  # same second page, different first token
    ka, kb = hash_tokens(a, page), hash_tokens(b, page)
    assert ka[0] != kb[0] and ka[1] != kb[1]


def test_salt_and_seed_isolate_chains() -> None:
    tokens = list(range(33))
    plain = hash_tokens(tokens, 8)
    salted = hash_tokens(tokens, 8, cache_salt="tenant-a")
    other = hash_tokens(tokens, 8, cache_salt="tenant-b")
    seeded = hash_tokens(tokens, 8, seed=b"\x01" * 32)
    assert len({plain[0], salted[0], other[0], seeded[0]}) == 4
    assert hash_tokens(tokens, 8, cache_salt="tenant-a") == salted  # deterministic
    assert salted == reference_sha256_chain(tokens, 8, salt="tenant-a")
    assert seeded == reference_sha256_chain(tokens, 8, seed=b"\x01" * 32)


def test_root_digest_formula() -> None:
    assert root_digest(None, None) == bytes(32)
    seed = bytes(range(32))
    assert root_digest(seed, None) == seed
    salt = hashlib.sha256(b"s").digest()
    assert root_digest(seed, "s") == bytes(a ^ b for a, b in zip(seed, salt, strict=True))


def test_sha256_64_is_the_truncated_chain() -> None:
    tokens = list(range(50))
    full = hash_tokens(tokens, 4)
    short = hash_tokens(tokens, 4, algo="sha256_64")
    assert short == [int.from_bytes(d[:8], "big", signed=True) for d in full]
    assert all(isinstance(k, int) and -(2**63) <= k < 2**63 for k in short)


def test_xxh3_128_chain() -> None:
    tokens = list(range(40))
    keys = hash_tokens(tokens, 8, algo="xxh3_128", cache_salt="t")
    parent = root_digest(deployment_seed(), "t")[:16]
    expected = []
    for start in range(0, 32, 8):
        block = struct.pack("<8i", *tokens[start : start + 8])
        parent = xxhash.xxh3_128_digest(xxhash.xxh3_128_digest(block) + parent)
        expected.append(parent)
    assert keys == expected and all(len(k) == 16 for k in keys)


def test_bad_inputs() -> None:
    with pytest.raises(ValueError, match="kv_hash_algo='md5' must be one of"):
        PrefixHasher("md5", 4)
    with pytest.raises(ValueError, match="outside int32"):
        hash_tokens([2**31, 1, 2], 1)
    with pytest.raises(ValueError, match=r"tokens must be a non-empty 1-D sequence, got shape \(2, 2\)"):
        hash_tokens(np.zeros((2, 2), dtype=np.int64), 1)
    with pytest.raises(TypeError, match=r"tokens\[1\]=True is not a token id"):
        hash_tokens([5, True, 7, 8, 9], 2)  # (not the keys of [5, 1, 7, 8, 9])
    assert hash_tokens([], 4) == [] and hash_tokens(np.array([5, 6, 7], dtype=object), 2) == hash_tokens([5, 6, 7], 2)


def test_empty_salt_is_refused_not_the_unsalted_chain() -> None:
    """The root is base for None and base XOR SHA256(salt) for a salt; "" is refused everywhere a salt enters
    (it used to give the unsalted root: a tenant with "" shared every unsalted request's pages)."""
    tokens = list(range(9))
    for call in (lambda: hash_tokens(tokens, 4, cache_salt=""), lambda: root_digest(None, ""),
                 lambda: PrefixHasher("sha256", 4).root("")):  # fmt: skip
        with pytest.raises(ValueError, match="cache_salt='' is empty"):
            call()
    assert hash_tokens(tokens, 4, cache_salt="a") != hash_tokens(tokens, 4) == hash_tokens(tokens, 4, cache_salt=None)


def test_memo_gives_the_same_chain_and_stays_bounded() -> None:
    rng = np.random.default_rng(1)
    shared = rng.integers(0, 50, 24)
    prompts = [np.concatenate([shared[: rng.integers(0, 25)], rng.integers(0, 3, 13)]) for _ in range(60)]
    memo, plain = PrefixHasher("sha256", 4, memo_pages=8), PrefixHasher("sha256", 4, memo_pages=0)
    for p in prompts:
        n = (len(p) - 1) // 4
        assert memo.extend(p, 0, n, memo.root()) == plain.extend(p, 0, n, plain.root())
        assert memo.memo_size <= 16  # two generations of at most 8 pages
    assert plain.memo_size == 0
    again = memo.extend(prompts[-1], 0, 2, b"\x07" * 32)  # a different parent never reuses a memo entry
    assert again == plain.extend(prompts[-1], 0, 2, b"\x07" * 32)


@pytest.mark.parametrize("memo_pages", [1, 3, 64])
def test_runs_give_the_chain_of_a_hasher_without_memo_whatever_the_calls(memo_pages: int) -> None:
    """Prompts branch off each other at every page and inside runs, are hashed in one call or in pieces
    (a request's later pages chained from its own digest), and repeat; every key equals a memo-less hasher's."""
    rng = np.random.default_rng(7)
    base = rng.integers(0, 4, 200)
    memo, plain = PrefixHasher("sha256", 4, memo_pages=memo_pages), PrefixHasher("sha256", 4, memo_pages=0)
    reused = 0
    for _ in range(300):
        cut = int(rng.integers(0, 150))
        prompt = np.concatenate([base[:cut], rng.integers(0, 2, int(rng.integers(1, 40)))])
        n = len(prompt) // 4
        parent_m = parent_p = memo.root()
        start = 0
        while start < n:  # in pieces of 1 to 9 pages
            stop = min(n, start + int(rng.integers(1, 10)))
            got, parent_m = memo.extend(prompt, start, stop, parent_m)
            want, parent_p = plain.extend(prompt, start, stop, parent_p)
            assert got == want and parent_m == parent_p
            start = stop
        assert memo.memo_size <= 2 * memo_pages
        reused += cut >= 8
    assert reused > 100
    assert memo.extend(base, 0, 3, b"\x07" * 32) == plain.extend(base, 0, 3, b"\x07" * 32)


def test_a_repeated_prefix_is_not_hashed_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """The second prompt sharing 6 pages makes two hash calls per new page only (the runs serve the rest)."""
    import pagedkv.core.hashing as hashing

    rng = np.random.default_rng(3)
    shared, hasher = rng.integers(0, 1000, 24), PrefixHasher("sha256", 4)
    first = np.concatenate([shared, rng.integers(0, 1000, 9)])
    second = np.concatenate([shared, rng.integers(0, 1000, 9)])
    hasher.extend(first, 0, 8, hasher.root())
    calls = []
    real = hashlib.sha256
    monkeypatch.setattr(hashing.hashlib, "sha256", lambda data: calls.append(1) or real(data))
    keys, _ = hasher.extend(second, 0, 8, hasher.root())
    assert len(calls) == 2 * 2  # pages 6 and 7 only
    assert keys == hash_tokens(second[:33], 4, seed=bytes(32))
