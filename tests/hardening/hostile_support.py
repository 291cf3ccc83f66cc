"""Hostile inputs, support: the row types, `run_case`, and the core builders.

A `Case` is one row of `hostile_cases.CASES`; its `setup()` returns a `Trial` (the bad call, the state
it must leave as it was, a check for inputs accepted on purpose, a close). `run_case` runs a case once
per process and returns its `Outcome`. The builders here make fresh params, managers, contexts and block
managers; `hostile_beds` adds the ops, engine and tier beds and the composite setups.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from helpers import snapshot
from pagedkv.core.block_manager import BlockManager
from pagedkv.core.context import TextContext
from pagedkv.dtype import DeviceRef, DType
from pagedkv.manager.paged import PagedKVCacheManager
from pagedkv.params import KVCacheParams

CPU = DeviceRef.CPU()
LOCAL = dict(kv_connector="local", host_kvcache_swap_space_gb=1)
BIG = 2**63  # past int64: no size of pagedkv is that large
TERA = 10**12  # pages: past int32 page ids

# Input classes (the part of `Case.input_class` before ":").
WRONG_TYPE = "wrong type"
NEGATIVE = "negative size"
ZERO = "zero"
HUGE = "huge size"
UNKNOWN_ID = "unknown request id"
DUPLICATE_ID = "duplicate request id"
NEVER_CLAIMED = "release of never-claimed"
OUTSIDE_INT32 = "token outside int32"
NON_INTEGER = "non-integer tokens"
NONFINITE = "NaN/inf KV"
NONFINITE_NUMBER = "NaN/inf number"
WRONG_DTYPE = "wrong dtype"
WRONG_SHAPE = "wrong shape"
WRONG_DEVICE = "wrong device"
MISMATCH = "params mismatch"
LENGTHS = "mismatched lengths"
OUT_OF_RANGE = "out of range"
BAD_VALUE = "unknown value"
CAPACITY = "over capacity"


# ----------------------------------------------------------------- the table's rows
@dataclass
class Trial:
    """One run of a case: `call` (the bad call), `state` (what must not change), `check` (for accepted
    inputs: asserts the outcome from the call's result), `close` (releases threads and files)."""

    call: Callable[[], Any]
    state: Callable[[], Any] = lambda: None
    check: Callable[[Any], None] | None = None
    close: Callable[[], None] = lambda: None


@dataclass(frozen=True)
class Case:
    """A row: `entry` point, `input_class` ("class: detail"), `example` (code shown in the docs), `setup`,
    expected `error` type (None: accepted, see `outcome`) and a `fragment` of its message."""

    entry: str
    input_class: str
    example: str
    setup: Callable[[], Trial] = field(repr=False)
    error: type[BaseException] | None
    fragment: str
    outcome: str = ""  # for error None: what happens instead (docs)
    unchanged: bool = True  # the state after equals the state before

    @property
    def id(self) -> str:
        return f"{self.entry}/{self.input_class}"

    @property
    def kind(self) -> str:
        return self.input_class.split(":")[0]


@dataclass
class Outcome:
    """What running a case gave: the exception (or the result), and the state before and after."""

    error: BaseException | None
    result: Any
    before: Any
    after: Any


class Pages:
    """Tensor contents compared bit for bit: `torch.equal` on byte views (so NaN equals NaN)."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.raw = [t.detach().contiguous().view(torch.uint8).clone() for t in tensors]

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Pages)
            and len(self.raw) == len(other.raw)
            and all(torch.equal(a, b) for a, b in zip(self.raw, other.raw, strict=True))
        )

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Pages({len(self.raw)} tensors, {sum(t.numel() for t in self.raw)} bytes)"


@functools.cache
def run_case(case: Case) -> Outcome:
    """Set up, take the state, make the call, take the state again (once per process)."""
    trial = case.setup()
    try:
        before = trial.state()
        error: BaseException | None = None
        result = None
        try:
            result = trial.call()
        except Exception as exc:  # noqa: BLE001 - the table records whatever it is
            error = exc
        after = trial.state()
        if error is None and trial.check is not None:
            trial.check(result)
        return Outcome(error, result, before, after)
    finally:
        trial.close()


# ----------------------------------------------------------------- builders
def params(**overrides: Any) -> KVCacheParams:
    """fp32 MHA params: 2 KV heads of 4, 2 layers, pages of 4 tokens, prefix caching, one CPU device."""
    base: dict[str, Any] = dict(
        dtype=DType.float32, n_kv_heads=2, head_dim=4, num_layers=2, devices=[CPU], page_size=4,
        enable_prefix_caching=True,
    )  # fmt: skip
    base.update(overrides)
    return KVCacheParams(**base)


def manager(pages: int = 8, host_pages: int = 0, **overrides: Any) -> PagedKVCacheManager:
    return PagedKVCacheManager(params(**overrides), None, pages, host_pages, True, max_batch_size=4)


def running(mgr: PagedKVCacheManager, rid: str = "a", n: int = 9, replica: int = 0) -> TextContext:
    """A claimed, allocated request of `n` tokens (1, 2, ...)."""
    c = TextContext(rid, np.arange(1, n + 1))
    mgr.claim(rid, replica)
    mgr.alloc(c, replica)
    return c


def mgr_state(mgr: PagedKVCacheManager, *ctxs: TextContext) -> dict[str, Any]:
    """Everything observable about a manager: per replica the bookkeeping snapshot (pool, prefix
    cache, tables, metrics, contexts), its counters, the tiers, and the bytes of every page."""
    mgr.check_integrity()
    tiers = mgr.tiers
    return {
        "replicas": [snapshot(bm, *ctxs) for bm in mgr._managers],
        "free": [mgr.num_free_blocks(r) for r in range(mgr.num_replicas)],
        "used": [mgr.get_num_used_pages(r) for r in range(mgr.num_replicas)],
        "swapped": sorted(map(repr, mgr._swapped.keys())),
        "host": [
            (c.num_used_host_blocks, list(c.host.index._slots.items()), list(c.host.index._pins))
            for c in tiers.connectors
            if c.host is not None
        ],  # fmt: skip
        "pages": Pages([t for b in mgr._buffers for t in b.all_buffers]),
    }


def ctx_state(c: TextContext) -> tuple[Any, ...]:
    t = c.tokens
    return (t.all.tolist(), t.processed_length, t.current_position, c.max_length, c.cached_prefix_length)


def construct(fn: Callable[[], Any]) -> Callable[[], Trial]:
    """A constructor or pure function: nothing exists before it, so there is no state to compare."""
    return lambda: Trial(fn)


def on_manager(call: Callable[[PagedKVCacheManager, TextContext], Any], **kw: Any) -> Callable[[], Trial]:
    """`call(mgr, ctx)` on a fresh manager (`manager(**kw)`) holding request "a" of 9 tokens."""

    def setup() -> Trial:
        mgr = manager(**kw)
        c = running(mgr)
        return Trial(lambda: call(mgr, c), lambda: mgr_state(mgr, c), close=mgr.close)

    return setup


def on_context(call: Callable[[TextContext], Any], n: int = 3, max_length: int | None = None) -> Callable[[], Trial]:
    def setup() -> Trial:
        c = TextContext("r", np.arange(1, n + 1), max_length=max_length)
        return Trial(lambda: call(c), lambda: ctx_state(c))

    return setup


def on_block_manager(call: Callable[[BlockManager, TextContext], Any]) -> Callable[[], Trial]:
    """`call(bm, ctx)` on a BlockManager (8 pages of 4) where "a" (9 tokens) ran one step: 2 pages to commit."""

    def setup() -> Trial:
        bm = BlockManager(8, 4, enable_prefix_caching=True)
        c = TextContext("a", np.arange(1, 10))
        bm.claim("a")
        bm.alloc(c)
        c.update(10)
        return Trial(lambda: call(bm, c), lambda: (snapshot(bm, c), bm.check_integrity()))

    return setup
