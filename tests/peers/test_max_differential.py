"""pagedkv's `PagedKVCacheManager` against Modular MAX 26.3.0's own, on the same traces (run in `.venv-max`).

`make peers` builds `.venv-max` (MAX's pinned CPU requirements, CPU torch and pagedkv) and
`make test-peers` runs this file there. Both managers get the same operations: claim, alloc (whole
prompts, chunked prompts, decode steps, speculative tokens), runtime_inputs, update, step, release and
reset_prefix_cache, on pools small enough to evict. After every operation the observable results must
agree: the prefix each alloc skipped, `cache_lengths`, `max_lengths`, the lookup table's width and its
contents up to a renaming of page ids, the metrics' input and cache tokens, and the type of any
exception.

Where pagedkv differs on purpose, the comparison says so:
- which page an allocation takes: pagedkv takes a free page that holds no hash before it evicts a
  cached one; MAX 26.3 keeps both kinds in one queue in the order they were freed and takes its head
  (`BlockPool.alloc_block` pops `free_block_queue`, uncommitting the hash of a cached block), so it
  evicts a cached page while a page freed later holds nothing (a released request's last, partial
  page; a page `step` merged into a cached copy; a page `reset_prefix_cache` cleared). Evicting the
  page that holds nothing loses no hit, so pagedkv keeps it: its prefix cache then holds pages MAX's
  lost, and a later alloc skips more tokens than MAX's. `MaxSide` gives MAX's pool pagedkv's choice
  (`take_pages_holding_nothing_first`): everything else (which cached page goes first, the hits, the
  tables, the metrics) is still MAX's own; `test_a_page_holding_nothing_goes_before_a_cached_one`
  shows the difference on MAX as released;
- page ids: pagedkv reuses a freed page that holds no hash before a never-used one, so the ids differ
  and tables are compared up to a consistent renaming within each call;
- the hash chain's seed: pagedkv's is secret per deployment (MAX's is fixed); only hits are compared;
- speculative tokens: MAX 26.3 reserves two sets of draft slots (its overlap scheduler verifies one
  set while drafting the next) and counts them in `max_lengths`; pagedkv reserves
  `num_eagle_speculative_tokens` slots and reports the longest `processed + active` length;
- atomic alloc: when MAX raises from `alloc` it may have changed its state, so a trace stops at the
  first exception (after checking both sides raised the same type).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

try:
    from max.driver import CPU
    from max.dtype import DType as MaxDType
    from max.engine import InferenceSession
    from max.graph import DeviceRef as MaxDeviceRef
    from max.interfaces.tokens import TokenBuffer as MaxTokenBuffer
    from max.kv_cache import PagedKVCacheManager as MaxManager
    from max.nn.kv_cache import KVCacheParams as MaxParams
    from max.pipelines.core.context import TextContext as MaxContext
except ImportError as error:  # pragma: no cover - outside .venv-max
    if os.environ.get("PAGEDKV_REQUIRE_PEERS") == "1":
        raise
    pytest.skip(f"MAX 26.3.0 is not importable ({error}); `make peers` builds .venv-max", allow_module_level=True)

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pagedkv
from pagedkv import DeviceRef, DType, KVCacheParams, PagedKVCacheManager, TextContext


@dataclass(frozen=True)
class Shape:
    page_size: int
    num_pages: int
    speculative: int = 0


class Side:
    """One manager behind the operations of a trace; each returns what the other side must match."""

    def __init__(self, shape: Shape) -> None:
        self.shape = shape
        self.ctx: dict[str, Any] = {}

    def observe_inputs(self, rids: list[str]) -> dict[str, Any]:
        lut, lengths, max_lengths = self._inputs(rids)
        return {"lut": lut, "cache_lengths": lengths.tolist(), "max_lengths": max_lengths.tolist()}

    def hit(self, rid: str) -> int:
        return int(self.ctx[rid].tokens.processed_length)


def take_pages_holding_nothing_first(pool: Any) -> list[int]:
    """Make MAX's device `BlockPool` take a free block that holds no hash, when there is one, before it
    evicts the head of its free queue (pagedkv's choice, the first difference in the module docstring).
    Returns a list that gets one entry per allocation where this changed MAX's choice."""
    queue, alloc_block, changed = pool.free_block_queue, pool.alloc_block, []

    def alloc_holding_nothing_first() -> tuple[Any, int | None]:
        block = queue.free_list_head
        while block is not None and block.block_hash is not None:
            block = block.next_free_block
        if block is None or block is queue.free_list_head:
            return alloc_block()  # MAX's own: the head holds nothing, or every free block is cached
        changed.append(block.bid)  # MAX would have evicted the cached head
        queue.remove(block)  # what MAX's `alloc_block` does with a block that holds no hash
        assert block.ref_cnt == 0
        block.ref_cnt += 1
        return block, None

    pool.alloc_block = alloc_holding_nothing_first
    return changed


class MaxSide(Side):
    def __init__(self, shape: Shape, *, pagedkv_victims: bool = True) -> None:
        super().__init__(shape)
        params = MaxParams(dtype=MaxDType.float32, n_kv_heads=1, head_dim=8, num_layers=1,
                           devices=[MaxDeviceRef.CPU()], enable_prefix_caching=True, page_size=shape.page_size,
                           num_eagle_speculative_tokens=shape.speculative)  # fmt: skip
        self.mgr = MaxManager(params, InferenceSession(devices=[CPU()]), shape.num_pages, max_batch_size=16)
        pool = self.mgr._replica[0].block_manager.device_block_pool
        self.changed_victims = take_pages_holding_nothing_first(pool) if pagedkv_victims else []

    def claim(self, rid: str, tokens: list[int]) -> None:
        self.ctx[rid] = MaxContext(max_length=4096, tokens=MaxTokenBuffer(np.array(tokens, dtype=np.int64)),
                                   request_id=rid)  # fmt: skip
        self.mgr.claim(rid, 0)

    def alloc(self, rid: str, chunk: int | None) -> None:
        ctx = self.ctx[rid]
        self.mgr.alloc(ctx, 0)  # prefix hits first, then the chunk (MAX's order: a chunk set before
        if chunk is not None and chunk < ctx.tokens.active_length:  # alloc cannot absorb a longer hit)
            ctx.tokens.chunk(chunk)

    def _inputs(self, rids: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        leaf = self.mgr.runtime_inputs([[self.ctx[r] for r in rids]]).inputs[0]
        return (np.from_dlpack(leaf.lookup_table), np.from_dlpack(leaf.cache_lengths),
                np.from_dlpack(leaf.max_lengths))  # fmt: skip

    def update(self, rid: str, token: int) -> None:
        self.ctx[rid].update(token)

    def step(self, rids: list[str]) -> None:
        self.mgr.step([[self.ctx[r] for r in rids]])

    def release(self, rid: str) -> None:
        self.mgr.release(rid, 0)

    def reset(self) -> None:
        self.mgr.reset_prefix_cache()

    def metrics(self) -> tuple[int, int]:
        m = self.mgr.get_metrics(0)
        return m.input_tokens, m.cache_tokens


class PagedSide(Side):
    def __init__(self, shape: Shape) -> None:
        super().__init__(shape)
        params = KVCacheParams(dtype=DType.float32, n_kv_heads=1, head_dim=8, num_layers=1, devices=[DeviceRef.CPU()],
                               enable_prefix_caching=True, page_size=shape.page_size,
                               num_eagle_speculative_tokens=shape.speculative)  # fmt: skip
        self.mgr = PagedKVCacheManager(params, None, shape.num_pages, max_batch_size=16, enable_runtime_checks=True)

    def claim(self, rid: str, tokens: list[int]) -> None:
        self.ctx[rid] = TextContext(rid, np.array(tokens))
        self.mgr.claim(rid, 0)

    def alloc(self, rid: str, chunk: int | None) -> None:
        ctx = self.ctx[rid]
        self.mgr.alloc(ctx, 0)  # prefix hits first, then the chunk (MAX's order: a chunk set before
        if chunk is not None and chunk < ctx.tokens.active_length:  # alloc cannot absorb a longer hit)
            ctx.tokens.chunk(chunk)

    def _inputs(self, rids: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        leaf = self.mgr.runtime_inputs([[self.ctx[r] for r in rids]]).inputs[0]
        return leaf.lookup_table.numpy(), leaf.cache_lengths.numpy(), leaf.max_lengths.numpy()

    def update(self, rid: str, token: int) -> None:
        self.ctx[rid].update(token)

    def step(self, rids: list[str]) -> None:
        self.mgr.step([[self.ctx[r] for r in rids]])

    def release(self, rid: str) -> None:
        self.mgr.release(rid, 0)

    def reset(self) -> None:
        self.mgr.reset_prefix_cache()

    def metrics(self) -> tuple[int, int]:
        m = self.mgr.get_metrics(0)
        return m.input_tokens, m.cache_tokens


def same_up_to_renaming(ours: np.ndarray, theirs: np.ndarray, null: int) -> bool:
    """True when one consistent bijection of page ids (null to null) turns `theirs` into `ours`."""
    if ours.shape != theirs.shape:
        return False
    forward: dict[int, int] = {}
    backward: dict[int, int] = {}
    for a, b in zip(theirs.ravel().tolist(), ours.ravel().tolist(), strict=True):
        if (a == null) != (b == null) or forward.setdefault(a, b) != b or backward.setdefault(b, a) != a:
            return False
    return True


def run(shape: Shape, ops: list[tuple[Any, ...]]) -> int:
    """Apply `ops` to both managers, comparing after each; returns how many ran before a shared exception."""
    sides = [MaxSide(shape), PagedSide(shape)]
    for n, op in enumerate(ops):
        results = []
        for side in sides:
            try:
                results.append(("ok", apply(side, op)))
            except Exception as error:  # noqa: BLE001 - both sides must raise the same type
                results.append(("raised", type(error).__name__))
        theirs, ours = results
        if theirs[0] == "raised" or ours[0] == "raised":
            assert ours == theirs, f"op {n} {op}: MAX {theirs}, pagedkv {ours}"
            return n  # (MAX's alloc is not atomic: its state after an exception is not comparable)
        if op[0] == "inputs":
            assert ours[1]["cache_lengths"] == theirs[1]["cache_lengths"], f"op {n} {op}"
            spec = shape.speculative  # MAX's max cache length counts the draft slots; pagedkv's does not
            assert [[p, c + spec] for p, c in ours[1]["max_lengths"]] == theirs[1]["max_lengths"], f"op {n} {op}"
            their_lut = theirs[1]["lut"].astype(np.int64)
            if spec:  # MAX holds pages for its second set of draft slots too: compare the pages pagedkv holds
                their_lut = np.where(ours[1]["lut"] == shape.num_pages, shape.num_pages, their_lut)
            assert same_up_to_renaming(ours[1]["lut"], their_lut, shape.num_pages), (
                f"op {n} {op}: lookup tables differ beyond page ids\nMAX\n{theirs[1]['lut']}\npagedkv\n{ours[1]['lut']}"
            )
        else:
            assert ours == theirs, f"op {n} {op}: MAX {theirs}, pagedkv {ours}"
        assert sides[1].metrics() == sides[0].metrics(), f"after op {n} {op}"
    return len(ops)


def apply(side: Side, op: tuple[Any, ...]) -> Any:
    kind = op[0]
    if kind == "claim":
        side.claim(op[1], op[2])
        return None
    if kind == "alloc":
        side.alloc(op[1], op[2])
        return side.hit(op[1])
    if kind == "inputs":
        return side.observe_inputs(op[1])
    if kind == "update":
        side.update(op[1], op[2])
        return None
    if kind == "step":
        side.step(op[1])
        return None
    if kind == "release":
        side.release(op[1])
        return None
    side.reset()
    return None


def serve(rid: str, tokens: list[int], decode: int, chunk: int | None = None) -> list[tuple[Any, ...]]:
    """One request alone: claim, prefill (in chunks of `chunk`), `decode` decode steps, release. `update`
    after a chunk finishes it (both contexts ignore the token then)."""
    ops: list[tuple[Any, ...]] = [("claim", rid, tokens)]
    done = 0
    while done < len(tokens):
        done += len(tokens) - done if chunk is None else min(chunk, len(tokens) - done)
        ops += [("alloc", rid, chunk), ("inputs", [rid]), ("update", rid, 1000 + done), ("step", [rid])]
    for i in range(decode):
        ops += [("alloc", rid, None), ("inputs", [rid]), ("update", rid, 2000 + i), ("step", [rid])]
    return [*ops, ("release", rid)]


PREFIX = list(range(40))


@pytest.mark.parametrize("shape", [Shape(16, 12), Shape(4, 40), Shape(16, 12, speculative=2)], ids=str)
def test_shared_prefix_requests_in_turn(shape: Shape) -> None:
    """Four requests sharing a 40-token prefix (43, 56, 73, 17 tokens), three decode steps each, in turn."""
    ops: list[tuple[Any, ...]] = []
    for i, extra in enumerate((3, 16, 33, -23)):
        tokens = PREFIX + [500 + 10 * i + k for k in range(extra)] if extra > 0 else PREFIX[:17]
        ops += serve(f"r{i}", tokens, 3)
    assert run(shape, ops) == len(ops)


def test_a_small_pool_evicts_alike() -> None:
    ops: list[tuple[Any, ...]] = []
    for i in range(6):  # 6 distinct prompts of 3 pages in a 10-page pool, then the first again
        ops += serve(f"d{i}", [100 * i + k for k in range(13)], 2)
    ops += serve("again", list(range(13)), 1) + [("reset",)] + serve("after-reset", list(range(13)), 1)
    assert run(Shape(4, 10), ops) == len(ops)


def test_a_page_holding_nothing_goes_before_a_cached_one() -> None:
    """The first named difference on a 6-page pool of 4-token pages. Requests a and b (9 tokens: two cached
    pages and a partial one each) are served and released, in turn, which leaves MAX's free queue
    [a2, a1, a0, b2, b1, b0] (each request's tail first); c (9 new tokens) needs 3 pages. MAX takes the head:
    a2 and both of a's cached pages. pagedkv takes a2 and b2, which hold nothing, and evicts a1 only, so a's
    prompt served again skips its first page on pagedkv and nothing on MAX. Given pagedkv's choice (for c's
    second page and for the second page of a's prompt served again), MAX agrees with pagedkv on the whole trace."""
    a = list(range(9))
    ops = [*serve("a", a, 0), *serve("b", list(range(100, 109)), 0), *serve("c", list(range(200, 209)), 0),
           ("claim", "again", a), ("alloc", "again", None)]  # fmt: skip
    shape = Shape(4, 6)
    as_released, given_our_choice, ours = MaxSide(shape, pagedkv_victims=False), MaxSide(shape), PagedSide(shape)
    skipped = [[apply(side, op) for op in ops][-1] for side in (as_released, given_our_choice, ours)]
    assert skipped == [0, 4, 4]
    assert len(given_our_choice.changed_victims) == 2 and not as_released.changed_victims
    assert run(shape, ops) == len(ops)


def test_too_long_a_request_raises_the_same_error() -> None:
    ops = [("claim", "big", list(range(100))), ("alloc", "big", None)]
    assert run(Shape(4, 8), ops) == 1  # both raise InsufficientBlocksError at the alloc


def test_chunked_prefill_matches() -> None:
    ops = serve("c", PREFIX + list(range(900, 925)), 2, chunk=16) + serve("d", PREFIX + [7, 8], 1)
    assert run(Shape(8, 30), ops) == len(ops)


ACTIONS = st.lists(
    st.tuples(
        st.sampled_from(["serve", "reset"]),
        st.integers(0, 3),
        st.integers(1, 60),
        st.integers(0, 3),
        st.sampled_from([None, 5, 16]),
    ),  # fmt: skip
    min_size=1,
    max_size=8,
)


@settings(max_examples=int(os.environ.get("PAGEDKV_MAX_DIFF_EXAMPLES", "40")), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])  # fmt: skip
@given(actions=ACTIONS, page_size=st.sampled_from([4, 16]), pages=st.integers(6, 24))
def test_random_traces_agree(actions: list[tuple[Any, ...]], page_size: int, pages: int) -> None:
    """Random sequences of requests drawn from 4 shared prefixes (with lengths not page-aligned), chunked
    or not, with decode steps and prefix-cache resets, on pools that evict."""
    ops: list[tuple[Any, ...]] = []
    for n, (kind, prefix, length, decode, chunk) in enumerate(actions):
        if kind == "reset":
            ops.append(("reset",))
            continue
        tokens = [10_000 * prefix + k for k in range(length // 2)] + [n * 100 + k for k in range(length - length // 2)]
        ops += serve(f"q{n}", tokens, decode, chunk)
    run(Shape(page_size, pages), ops)


def test_pagedkv_is_the_package_under_test() -> None:
    assert pagedkv.PagedKVCacheManager is PagedKVCacheManager
