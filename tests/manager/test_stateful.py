"""Hypothesis drives random request lifecycles through the real manager and real page buffers.

After every rule, `check_integrity()` must hold (each page free, cached-evictable or
in use; counts add up; hashes agree), and the stamp model proves every cached
position of every request holds its own prefix's KV. A failing `alloc` must
leave manager and context exactly as they were. Nothing may leak at the end.
"""

from __future__ import annotations

import os

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from helpers import make_params, snapshot
from pagedkv.core.context import Retention, TextContext
from pagedkv.core.errors import InsufficientBlocksError
from pagedkv.core.pool import EVICTION_POLICIES
from pagedkv.dtype import DeviceRef, DType
from pagedkv.manager.paged import PagedKVCacheManager
from pagedkv.params import KVCacheParams
from pagedkv.params.multi import MultiKVCacheParams
from pagedkv.params.state import StateCacheParams
from pagedkv.specs import MambaSpec
from pagedkv.testing import PrefixStampModel

CPU = DeviceRef.CPU()
PREFIXES = [list(range(100, 117)), list(range(200, 205)), [7] * 9]
EXAMPLES = int(os.environ.get("PAGEDKV_FUZZ_EXAMPLES", "60"))


def layout_params(layout: str, **kwargs: object) -> KVCacheParams | MultiKVCacheParams:
    """Cache layouts the machine runs: MHA, TP shards, replicated MLA, one sliding window, hybrid trees."""
    base = dict(n_kv_heads=2, num_q_heads=4, num_layers=2, head_dim=2, **kwargs)
    if layout in ("mha", "mha-tp2", "swa"):
        return make_params(**base, devices=[CPU] * (2 if layout.endswith("tp2") else 1),
                           sliding_window=5 if layout == "swa" else None)  # fmt: skip
    if layout == "mla-tp2":
        return make_params(**{**base, "n_kv_heads": 1}, devices=[CPU, CPU], is_mla=True)
    devices = [CPU] * (2 if layout.endswith("tp2") else 1)
    if layout.startswith("state"):  # recurrent state slots beside a full and a sliding-window group
        state = MambaSpec(block_size=int(kwargs["page_size"]), shapes=((4, 2), (2, 3)),  # type: ignore[call-overload]
                          dtypes=(DType.float32, DType.float32), num_speculative_blocks=int(kwargs.get("num_eagle_speculative_tokens", 0)))  # type: ignore[call-overload]  # fmt: skip
        return MultiKVCacheParams({
            "full": make_params(**base, devices=devices), "swa": make_params(**base, devices=devices, sliding_window=5),
            "state": StateCacheParams.from_spec(state, 2, devices, **kwargs),
        })  # fmt: skip
    kinds = {"full": {}, "swa": {"sliding_window": 5}, "chunk": {"attention_chunk_size": 6},
             "sink": {"sliding_window": 4, "sink_tokens": 3}}  # fmt: skip
    return MultiKVCacheParams({name: make_params(**base, devices=devices, **extra) for name, extra in kinds.items()})


class ManagerMachine(RuleBasedStateMachine):
    extra_params: dict[str, object] = {}  # more `KVCacheParams` fields (subclasses: test_stateful_partial.py)

    @initialize(
        page_size=st.sampled_from([1, 2, 3, 4, 8]),
        num_pages=st.integers(6, 40),
        caching=st.booleans(),
        spec=st.sampled_from([0, 0, 2]),
        algo=st.sampled_from(["sha256", "sha256_64", "xxh3_128"]),
        layout=st.sampled_from(["mha", "mha-tp2", "mla-tp2", "swa", "hybrid", "hybrid-tp2", "state", "state-tp2"]),
        policy=st.sampled_from(list(EVICTION_POLICIES)),  # every registered policy
        protect=st.sampled_from([0.0, 0.25, 1.0]),
        leaves=st.booleans(),
    )
    def setup(
        self, page_size: int, num_pages: int, caching: bool, spec: int, algo: str, layout: str, policy: str,
        protect: float, leaves: bool,
    ) -> None:  # fmt: skip
        self.mgr = PagedKVCacheManager(
            layout_params(layout, page_size=page_size, enable_prefix_caching=caching,
                          num_eagle_speculative_tokens=spec, kv_hash_algo=algo, eviction_policy=policy,
                          protected_fraction=protect, evict_leaves_first=leaves, **self.extra_params), None,
            num_pages, enable_runtime_checks=True, max_batch_size=64,
        )  # fmt: skip
        self.model = PrefixStampModel(self.mgr)
        self.bm = self.mgr._managers[0]
        self.live: dict[int, TextContext] = {}
        self.allocated: set[int] = set()  # requests alloc'ed since their last update: they may run
        self.next_id = 0
        self.ops = 0
        self.now = 0.0
        self.hybrid = layout.startswith(("swa", "hybrid", "state"))
        self.bm.pool.keyed_order().clock = lambda: self.now  # retention expiry on a clock the test moves

    def _ready(self) -> list[TextContext]:
        """Requests that hold pages for their active window (they may run a forward pass)."""
        return [self.live[rid] for rid in sorted(self.allocated)]

    @rule(prefix=st.sampled_from(range(len(PREFIXES) + 1)), suffix=st.lists(st.integers(0, 5), max_size=12),
          salt=st.sampled_from([None, None, "t1"]),
          retention=st.sampled_from([None, None, (80, None), (10, 2.0), (100, 1.0)]))  # fmt: skip
    def new_request(self, prefix: int, suffix: list[int], salt: str | None, retention: tuple | None) -> None:
        tokens = (PREFIXES[prefix] if prefix < len(PREFIXES) else []) + suffix or [1]
        c = TextContext(self.next_id, np.array(tokens), cache_salt=salt)
        c.retention = Retention(*retention) if retention else None
        self.mgr.claim(c.request_id)
        self.live[self.next_id] = c
        self.next_id += 1

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def alloc(self, data: st.DataObject) -> None:
        c = data.draw(st.sampled_from(sorted(self.live.values(), key=lambda x: x.request_id)))
        before = snapshot(self.bm, c)
        try:
            self.mgr.alloc(c)
            self.allocated.add(c.request_id)
        except InsufficientBlocksError:
            assert snapshot(self.bm, c) == before, "a failed alloc changed state"
            if self._may_preempt(c) and data.draw(st.booleans()):  # preempt: give the pages back, start over later
                self.mgr.release(c.request_id)
                self.allocated.discard(c.request_id)
                c.reset()
                self.mgr.claim(c.request_id)
        self.ops += 1

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def chunk(self, data: st.DataObject) -> None:
        c = data.draw(st.sampled_from(sorted(self.live.values(), key=lambda x: x.request_id)))
        if c.tokens.active_length > 1 and not c.tokens.is_chunked:
            c.tokens.chunk(data.draw(st.integers(1, c.tokens.active_length - 1)))

    @rule(data=st.data())
    def forward(self, data: st.DataObject) -> None:
        ready = self._ready()
        batch = (
            data.draw(st.lists(st.sampled_from(ready), min_size=1, unique_by=lambda c: c.request_id)) if ready else []
        )
        self._run(batch, data)

    @rule(data=st.data())
    def engine_step(self, data: st.DataObject) -> None:
        """What an engine does each step: alloc every live request that fits, run them all, commit."""
        for c in sorted(self.live.values(), key=lambda x: x.request_id):
            try:
                self.mgr.alloc(c)
                self.allocated.add(c.request_id)
            except InsufficientBlocksError:
                pass
        self._run(self._ready(), data)

    def _run(self, batch: list[TextContext], data: st.DataObject) -> None:
        self.model.forward([batch])
        for c in batch:
            c.update(data.draw(st.integers(0, 5)))
            self.allocated.discard(c.request_id)
        self.mgr.step([batch])
        self.ops += 1 + len(batch)

    def _may_preempt(self, c: TextContext) -> bool:
        """Whether `c` may be released after a failed alloc (subclasses with a stricter contract say no)."""
        return True

    def _releasable(self) -> list[int]:
        """Requests the `release` rule may pick."""
        return sorted(self.live)

    @precondition(lambda self: self._releasable())
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(self._releasable()))
        self.mgr.release(rid)
        self.allocated.discard(rid)
        del self.live[rid]

    @rule(prefix=st.sampled_from(range(len(PREFIXES))), priority=st.sampled_from([0, 35, 100]),
          duration=st.sampled_from([None, 1.0]))  # fmt: skip
    def pin_prefix(self, prefix: int, priority: int, duration: float | None) -> None:
        if not self.hybrid and self.bm.enable_prefix_caching:
            found = self.mgr.pin_prefix(PREFIXES[prefix], priority, duration)
            assert 0 <= found <= len(PREFIXES[prefix]) // self.mgr.page_size

    @rule(seconds=st.sampled_from([0.5, 3.0]))
    def clock_moves(self, seconds: float) -> None:
        self.now += seconds

    @rule()
    def reset_prefix_cache(self) -> None:
        self.mgr.reset_prefix_cache()

    @invariant()
    def integrity(self) -> None:
        if hasattr(self, "mgr"):
            self.mgr.check_integrity()
            states = getattr(self.bm, "states", None)
            idle = states.page_usage()[0] if states is not None else 0  # pages only checkpoints hold: not used
            assert self.mgr.get_num_used_pages() == self.bm.pool.num_used - idle <= self.mgr.total_num_pages
            assert self.mgr.get_num_used_pages() + self.mgr.num_free_blocks() == self.mgr.total_num_blocks()

    def teardown(self) -> None:
        if not hasattr(self, "mgr"):
            return
        for rid in list(self.live):
            self.mgr.release(rid)
        self.mgr.check_integrity()
        states = getattr(self.bm, "states", None)
        tails = set(states.tail_refs()) if states is not None else set()
        assert self.bm.pool.num_used == len(tails), "pages leaked after every release"
        assert self.mgr.get_num_used_pages() == 0  # (checkpoints' tails are not used: no request holds them)
        if states is not None:  # only state checkpoints' tails stay held, and dropping them frees everything
            assert states.rows.num_used == 0
            self.mgr.reset_prefix_cache()
            self.mgr.check_integrity()
            assert self.mgr.get_num_used_pages() == 0 and len(states) == 0
        assert self.mgr.num_free_blocks() == self.mgr.total_num_blocks()


ManagerMachine.TestCase.settings = settings(
    max_examples=EXAMPLES, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)  # fmt: skip
TestManagerMachine = ManagerMachine.TestCase


def test_one_token_prefill_chunk_is_not_a_decode_step() -> None:
    """Found by the machine above: a hybrid request chunked to one prompt token and alloc'ed twice
    took the decode fast path, which gave it the pages of a decode at its last token."""
    params = layout_params("hybrid", page_size=2, enable_prefix_caching=False)
    mgr = PagedKVCacheManager(params, None, 36, enable_runtime_checks=True, max_batch_size=4)
    ctx = TextContext(0, np.arange(100, 117))
    mgr.claim(0)
    ctx.tokens.chunk(1)
    mgr.alloc(ctx)
    before = [mgr.get_req_blocks(0, group=g) for g in range(4)]
    mgr.alloc(ctx)  # the same window again: nothing to add
    assert [mgr.get_req_blocks(0, group=g) for g in range(4)] == before
    mgr.check_integrity()
