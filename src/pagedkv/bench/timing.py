"""The timing loops the benches share: garbage collector held still, best-of-N rounds, prefix hashing cost."""

from __future__ import annotations

import gc
import hashlib
import math
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

from pagedkv.core.hashing import PrefixHasher

__all__ = ["best_of", "best_of_cuda", "gc_frozen", "gc_paused", "hash_ns_per_token", "sha256_chain_floor_ns"]


@contextmanager
def gc_paused() -> Iterator[None]:
    """Collect, then keep the garbage collector off inside the block (vLLM's measurements run so)."""
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@contextmanager
def gc_frozen() -> Iterator[None]:
    """Collect and freeze what exists (vLLM's engine core does so after setup); unfreeze after the block."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def best_of(calls: dict[str, Callable[[], Any]], repeats: int, sync: Callable[[], None] = lambda: None) -> dict[str, float]:  # fmt: skip
    """Milliseconds per call, the minimum over `repeats` rounds that run every call once in turn, after one
    warm-up call each; `sync` waits for queued device work before and after each timed call."""
    best = {name: math.inf for name in calls}
    for call in calls.values():
        call()
    for _ in range(repeats):
        for name, call in calls.items():
            sync()
            start = time.perf_counter()
            call()
            sync()
            best[name] = min(best[name], 1e3 * (time.perf_counter() - start))
    return best


def best_of_cuda(fn: Callable[[], object], warmup: int, repeats: int, inner: int) -> float:
    """Best over `repeats` of the mean milliseconds of `inner` back-to-back calls, timed by CUDA events."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    best = math.inf
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / inner)
    return best


def hash_ns_per_token(prompts: Sequence[np.ndarray], page_size: int, algo: str, repeats: int = 3, *,
                      last_page: bool = False) -> float:  # fmt: skip
    """Best-of-`repeats` nanoseconds per hashed token, hashing every full page of `prompts` in order with a
    fresh hasher per pass. Without `last_page` a prompt's last token is never hashed (a manager does not
    cache it: a page ending there is left out), as at admission."""
    pages = [(len(p) if last_page else len(p) - 1) // page_size for p in prompts]
    tokens = page_size * sum(pages)
    best = math.inf
    with gc_paused():
        for _ in range(repeats):
            hasher = PrefixHasher(algo, page_size)
            root = hasher.root()
            start = time.perf_counter()
            for p, n in zip(prompts, pages, strict=True):
                hasher.extend(p, 0, n, root)
            best = min(best, time.perf_counter() - start)
    return 1e9 * best / tokens


def sha256_chain_floor_ns(prompts: Sequence[np.ndarray], page_size: int, repeats: int = 3) -> float:
    """Best-of-`repeats` nanoseconds per token of the two `hashlib` SHA-256 calls a page of the sha256 chain
    needs (`hashing`: ``H(H(page) || parent)``) and nothing else: every full page's bytes are cut before the
    clock starts, no memo, no keys kept. No implementation of that chain on `hashlib` goes below it."""
    pages = [p[i * page_size : (i + 1) * page_size].astype("<i4").tobytes()
             for p in prompts for i in range(len(p) // page_size)]  # fmt: skip
    sha, best = hashlib.sha256, math.inf
    with gc_paused():
        for _ in range(repeats):
            parent = bytes(32)
            start = time.perf_counter()
            for page in pages:
                parent = sha(sha(page).digest() + parent).digest()
            best = min(best, time.perf_counter() - start)
    return 1e9 * best / max(1, page_size * len(pages))
