"""The rules `test_stateful_tiers.TierMachine` adds to `ManagerMachine`, as a mixin (`TierRules`) that the
machine lists before `ManagerMachine` in its bases, so Hypothesis finds these `@rule`s on it.

- `swap_out` / `swap_in` / `release_swapped`: preemption by swap through the host tier;
- `traffic` (and `_warm_up`, the same from a seeded RNG): new requests from the shared prefixes, then
  rounds of alloc / preempt / resume / forward / step / release (`_round`);
- `tier_fault`: a real fault of the disk or Redis tier (`fuzz_support`), optionally followed by a
  restart and a replay of recent prompts (`_replay`);
- `peer_traffic`: a second manager on the same disk directory / Redis prefix (`_close_peer` ends it).

The machine provides the state these use (`mgr`, `bm`, `conn`, `model`, `live`, `swapped`, `targets`,
`history`, the counters) and `maintenance`, `_build`, `_ready`, `row_bytes`. `REPORT` is the module's
`FuzzReport`: `test_stateful_tiers` starts and writes it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
from fuzz_support import (
    DISK_FAULTS,
    REDIS_FAULTS,
    FuzzReport,
    check_request_kv,
    disk_fault,
    has_hmac,
    redis_fault,
    redis_is_up,
    shared_redis,
    wait_for_each_offload,
)
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule
from test_stateful import PREFIXES

from helpers import snapshot
from pagedkv.core.context import TextContext
from pagedkv.core.errors import InsufficientBlocksError
from pagedkv.manager.paged import PagedKVCacheManager
from pagedkv.testing import PrefixStampModel

T = TypeVar("T")
REPORT = FuzzReport("manager+tiers")


class TierRules:
    """Swap preemption, traffic, tier faults and a peer process: the rules of `TierMachine` on top of
    `ManagerMachine`'s (a mixin: the state and the other helpers are the machine's)."""

    # ------------------------------------------------------------------ swap preemption
    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def swap_out(self, data: st.DataObject) -> None:
        c = data.draw(st.sampled_from(sorted(self.live.values(), key=lambda x: x.request_id)))
        before = snapshot(self.bm, c)
        lent = self.mgr.tiers.swap_spaces[0].rows_lent if self.mgr.can_swap else 0
        if self.mgr.swap_out(c.request_id):
            assert self.mgr.is_swapped(c.request_id) and not self.mgr.contains(c.request_id)
            assert self.mgr.tiers.swap_spaces[0].rows_lent == lent + self.mgr.swapped_pages(c.request_id)
            del self.live[c.request_id]
            self.allocated.discard(c.request_id)
            self.swapped[c.request_id] = c
            self.swaps += 1
        else:  # no host tier, or too few rows it can lend: nothing changed
            assert snapshot(self.bm, c) == before and self.mgr.contains(c.request_id)
        self.ops += 1

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data: st.DataObject) -> None:
        c = data.draw(st.sampled_from(sorted(self.swapped.values(), key=lambda x: x.request_id)))
        before = snapshot(self.bm, c)
        pages = self.mgr.swapped_pages(c.request_id)
        try:
            self.mgr.swap_in(c)
        except InsufficientBlocksError:
            assert snapshot(self.bm, c) == before, "a failed swap_in changed state"
            assert self.mgr.is_swapped(c.request_id) and self.mgr.swapped_pages(c.request_id) == pages
        else:
            del self.swapped[c.request_id]
            self.live[c.request_id] = c
            self.positions += check_request_kv(self.mgr, c)  # the bytes came back
        self.ops += 1

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def release_swapped(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.swapped)))
        self.mgr.release(rid)
        assert not self.mgr.is_swapped(rid)
        del self.swapped[rid]
        self.ops += 1

    # ------------------------------------------------------------------ traffic
    def _new_request(self, prefix: int, suffix: list[int], salt: str | None, new_tokens: int) -> None:
        tokens = (PREFIXES[prefix] if prefix < len(PREFIXES) else []) + suffix or [1]
        self.history = [*self.history[-31:], (tokens, salt)]
        c = TextContext(self.next_id, np.array(tokens), cache_salt=salt)
        self.mgr.claim(c.request_id)
        self.live[self.next_id] = c
        self.targets[self.next_id] = len(tokens) + new_tokens
        self.next_id += 1

    def _warm_up(self, seed: int, iterations: int) -> None:
        """`iterations` of `traffic` driven by a seeded RNG instead of draws: every example starts
        with full device and host tiers and pages below them (cheap, and reproducible from the seed)."""
        rng = np.random.default_rng(seed)

        def pick(options: Sequence[T]) -> T:
            return options[int(rng.integers(len(options)))]

        for _ in range(iterations):
            for _ in range(int(rng.integers(1, 3))):
                suffix = rng.integers(0, 6, size=int(rng.integers(0, 7))).tolist()
                self._new_request(pick(range(len(PREFIXES) + 1)), suffix, pick([None, None, "t1"]), pick(range(1, 9)))
            for _ in range(int(rng.integers(1, 4))):
                self._round(pick)

    @rule(
        data=st.data(),
        new=st.lists(st.tuples(st.sampled_from(range(len(PREFIXES) + 1)), st.lists(st.integers(0, 5), max_size=6),
                               st.sampled_from([None, None, "t1"]), st.integers(1, 8)), min_size=1, max_size=4),
        rounds=st.integers(1, 6),
    )  # fmt: skip
    def traffic(self, data: st.DataObject, new: list[tuple[int, list[int], str | None, int]], rounds: int) -> None:
        """An engine's life in miniature: new requests from the shared prefixes, then rounds of alloc all
        (preempting by swap or recompute on a full pool, resuming swapped ones), forward, step, and the
        release of requests that reached their length: pages keep going down the tiers and coming back."""
        for args in new:
            self._new_request(*args)
        for _ in range(rounds):
            self._round(lambda options: data.draw(st.sampled_from(options)))

    def _round(self, pick: Callable[[Sequence[Any]], Any]) -> None:
        for c in sorted(self.swapped.values(), key=lambda x: x.request_id):  # resume the swapped first
            if pick([False, True]):
                try:
                    self.mgr.swap_in(c)
                except InsufficientBlocksError:
                    continue
                del self.swapped[c.request_id]
                self.live[c.request_id] = c
        for c in sorted(self.live.values(), key=lambda x: x.request_id):
            try:
                self.mgr.alloc(c)
                self.allocated.add(c.request_id)
            except InsufficientBlocksError:
                how = pick(["wait", "swap", "recompute"])
                if how == "swap" and self.mgr.swap_out(c.request_id):
                    del self.live[c.request_id]
                    self.allocated.discard(c.request_id)
                    self.swapped[c.request_id] = c
                    self.swaps += 1
                elif how == "recompute":
                    self.mgr.release(c.request_id)
                    self.allocated.discard(c.request_id)
                    c.reset()
                    self.mgr.claim(c.request_id)
        batch = self._ready()
        self.model.forward([batch])
        for c in batch:
            c.update(pick(range(6)))
            self.allocated.discard(c.request_id)
        self.mgr.step([batch])
        self.ops += 1 + len(batch)
        for c in batch:
            if len(c.tokens) >= self.targets.get(c.request_id, 1 << 30):
                self.mgr.release(c.request_id)
                del self.live[c.request_id]

    # ------------------------------------------------------------------ tiers
    def _quiesce(self) -> None:
        """Wait for the tiers' writes in flight (a fault hits pages at rest, so draws reproduce)."""
        self.conn.flush()

    @precondition(lambda self: self.connector != "local")
    @rule(data=st.data(), picks=st.lists(st.integers(0, 2**16), min_size=2, max_size=4), cold=st.booleans())
    def tier_fault(self, data: st.DataObject, picks: list[int], cold: bool) -> None:
        """A fault of the disk or Redis tier, done for real (see `fuzz_support`); for Redis also kill -9
        and, once down, a restart (empty, on the same port); a forged page when pages are signed.
        `cold`: then a new process starts on these tiers, so the next prompts read the damaged pages."""
        forge = ["forge"] if has_hmac(self.params.kv_connector_config) else []
        if self.connector == "tiered":
            kind = data.draw(st.sampled_from([*DISK_FAULTS, *forge]))
            self._quiesce()
            done = disk_fault(self.conn.lower[0].root, kind, picks, self.row_bytes)
        elif not redis_is_up():
            kind, done = "redis_up", 1
            shared_redis()  # restarts it on the same port, empty
        else:
            kind = data.draw(st.sampled_from([*REDIS_FAULTS, *forge, "redis_down"]))
            self._quiesce()
            if kind == "redis_down":
                done = 1
                shared_redis().stop()  # kill -9: serving goes on without it until a later tier_fault
            else:
                client = shared_redis().client()
                try:
                    done = redis_fault(client, self.prefix, kind, picks, self.row_bytes)
                finally:
                    client.close()
        self.faults += done
        REPORT.add(**{f"fault_{self.connector}_{kind}": done})
        self.ops += 1
        if cold:
            self.maintenance("restart")
            self._replay(picks[0])

    def _replay(self, seed: int) -> None:
        """Serve again some prompts served before (as a restarted engine would): their pages come from
        the tier below, damaged ones included."""
        rng = np.random.default_rng(seed)
        for i in rng.permutation(len(self.history))[:4].tolist():
            tokens, salt = self.history[i]
            self._new_request(len(PREFIXES), tokens, salt, int(rng.integers(1, 4)))
        for _ in range(3):
            self._round(lambda options: options[int(rng.integers(len(options)))])

    @precondition(lambda self: self.connector != "local")
    @rule(seed=st.integers(0, 2**16), n=st.integers(1, 4))
    def peer_traffic(self, seed: int, n: int) -> None:
        """Another process shares the disk directory / Redis prefix (its own device pool, host rows and
        disk index and LRU) and serves some recent prompts, one at a time, under its own stamp model: the
        two write, read, evict and refuse each other's pages."""
        if self.peer is None:
            self.peer = PagedKVCacheManager(self.params, None, self.num_pages, self.host_pages, enable_runtime_checks=True,
                                            max_batch_size=4)  # fmt: skip
            wait_for_each_offload(self.peer.tiers.connectors[0])  # deterministic, as the machine's own
            self.peer_model = PrefixStampModel(self.peer)
        peer, conn = self.peer, self.peer.tiers.connectors[0]
        rng = np.random.default_rng(seed)
        prompts = self.history or [(p, None) for p in PREFIXES]
        for i in rng.integers(len(prompts), size=n).tolist():
            tokens, salt = prompts[i]
            c = TextContext(f"peer{self.next_id}", np.array(tokens), cache_salt=salt)
            self.next_id += 1
            peer.claim(c.request_id)
            for _ in range(int(rng.integers(1, 4))):
                try:
                    peer.alloc(c)
                except InsufficientBlocksError:  # longer than its whole pool
                    break
                self.peer_model.forward([[c]])
                c.update(int(rng.integers(6)))
                peer.step([[c]])
                conn.flush()  # deterministic, as `step_then_settle`
            peer.release(c.request_id)
        assert peer.get_num_used_pages() == 0
        peer.sync_tiers()
        self.ops += 1

    def _close_peer(self) -> None:
        if self.peer is not None:
            self.peer.check_integrity()
            assert self.peer.get_num_used_pages() == 0
            REPORT.add(positions_checked=self.peer_model.positions_checked, peer_managers=1)
            self.peer.close()
            self.peer = None
