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
from pagedkv.core.context import TextContext
from pagedkv.core.errors import InsufficientBlocksError
from pagedkv.dtype import DeviceRef
from pagedkv.manager.paged import PagedKVCacheManager
from pagedkv.testing import PrefixStampModel

CPU = DeviceRef.CPU()
CPU = DeviceRef.CPU()
PREFIXES = [list(range(100, 117)), list(range(200, 205)), [7] * 9]
EXAMPLES = int(os.environ.get("PAGEDKV_FUZZ_EXAMPLES", "60"))


class ManagerMachine(RuleBasedStateMachine):
    @initialize(
        page_size=st.sampled_from([1, 2, 3, 4, 8]),
        num_pages=st.integers(6, 40),
        caching=st.booleans(),
        spec=st.sampled_from([0, 0, 2]),
        algo=st.sampled_from(["sha256", "sha256_64", "xxh3_128"]),
        layout=st.sampled_from(["mha", "mha-tp2", "mla-tp2"]),
    )
    def setup(self, page_size: int, num_pages: int, caching: bool, spec: int, algo: str, layout: str) -> None:
        shape = {"mha": {}, "mha-tp2": {"devices": [CPU, CPU]}, "mla-tp2": {"devices": [CPU, CPU], "is_mla": True}}
        params = make_params(
            page_size=page_size, n_kv_heads=1 if layout.startswith("mla") else 2, num_q_heads=4, num_layers=2,
            head_dim=2, enable_prefix_caching=caching, num_eagle_speculative_tokens=spec, kv_hash_algo=algo,
            **shape[layout],
        )  # fmt: skip
        self.mgr = PagedKVCacheManager(params, num_pages, enable_runtime_checks=True, max_batch_size=64)
        self.model = PrefixStampModel(self.mgr)
        self.bm = self.mgr._managers[0]
        self.live: dict[int, TextContext] = {}
        self.next_id = 0
        self.ops = 0

    def _ready(self) -> list[TextContext]:
        """Requests holding pages for every token (they may run a forward pass)."""
        ps, spec = self.mgr.page_size, self.mgr.params.num_eagle_speculative_tokens
        return [
            c for c in self.live.values() if len(self.mgr.get_req_blocks(c.request_id)) * ps >= len(c.tokens) + spec
        ]

    @rule(prefix=st.sampled_from(range(len(PREFIXES) + 1)), suffix=st.lists(st.integers(0, 5), max_size=12),
          salt=st.sampled_from([None, None, "t1"]))  # fmt: skip
    def new_request(self, prefix: int, suffix: list[int], salt: str | None) -> None:
        tokens = (PREFIXES[prefix] if prefix < len(PREFIXES) else []) + suffix or [1]
        c = TextContext(self.next_id, np.array(tokens), cache_salt=salt)
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
        except InsufficientBlocksError:
            assert snapshot(self.bm, c) == before, "a failed alloc changed state"
            if data.draw(st.booleans()):  # preempt: give the pages back and start over later
                self.mgr.release(c.request_id)
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
        batch = data.draw(st.lists(st.sampled_from(ready), unique_by=lambda c: c.request_id)) if ready else []
        self.model.forward([batch])
        for c in batch:
            c.update(data.draw(st.integers(0, 5)))
        self.mgr.step([batch])
        self.ops += 1 + len(batch)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.live)))
        self.mgr.release(rid)
        del self.live[rid]

    @rule()
    def reset_prefix_cache(self) -> None:
        self.mgr.reset_prefix_cache()

    @invariant()
    def integrity(self) -> None:
        if hasattr(self, "mgr"):
            self.mgr.check_integrity()
            assert self.mgr.get_num_used_pages() == self.bm.pool.num_used <= self.mgr.total_num_pages

    def teardown(self) -> None:
        if not hasattr(self, "mgr"):
            return
        for rid in list(self.live):
            self.mgr.release(rid)
        self.mgr.check_integrity()
        assert self.mgr.get_num_used_pages() == 0, "pages leaked after every release"
        assert self.mgr.num_free_blocks() == self.mgr.total_num_blocks()


ManagerMachine.TestCase.settings = settings(
    max_examples=EXAMPLES, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)  # fmt: skip
TestManagerMachine = ManagerMachine.TestCase
