"""The manager state machine (`tests/manager/test_stateful.ManagerMachine`) over every tier below the device.

Each example builds a `PagedKVCacheManager` with a connector: "local" (host rows), "tiered" (host rows
written through to page files in a temporary directory, under a small size cap) or "redis" (one real
redis-server for the module, a key prefix of its own per example, with or without host rows in front),
on a layout tiers support (MHA, MHA over 2 TP shards, MLA replicated over 2 shards), with a small device
pool and a small host tier, so pages are evicted to and loaded back from the tiers all the time.

Each example starts warm: a seeded warm-up (`_warm_up`, up to 40 rounds of `traffic` chosen by an RNG
from one drawn seed) fills the device pool, the host rows and the tier below. Then, on top of the base
machine's rules (requests from shared prefixes with optional cache salts, chunked prefill, speculative
tokens, alloc with preemption by recompute, forward + step, release, pins, clock, `reset_prefix_cache`):

- `traffic`: an engine's life in miniature: new requests from the shared prefixes, then rounds of alloc
  every live request (on a full pool: wait, preempt by swap, or preempt by recompute), resume swapped
  ones, forward, step, and release the requests that reached their length;
- `swap_out` / `swap_in` / `release_swapped`: preemption by swap through the host tier (`mgr.can_swap`;
  a swap that cannot happen changes nothing, and a swapped-in request's KV is checked at once);
- `tier_fault`, done for real on the stored pages (`fuzz_support`): disk: flip a payload or header byte,
  truncate, delete some, another page's file or garbage under a page's name, wipe the directory; Redis:
  the same on values, FLUSHALL, and kill -9 of the server (started again, empty, on its port by a
  later `tier_fault`); with a signing key (`KVConnectorConfig.tier_hmac_key`, when it exists) also a
  forged page: a valid header and checksum over another prefix's KV (without a key the format cannot
  tell, by design). Half the faults are followed by a restart and a replay of recent prompts, so
  the damaged pages are read back;
- `peer_traffic`: a second manager (another process) on the same disk directory / Redis prefix serves
  recent prompts under its own stamp model: the two share, evict and refuse each other's pages;
- `maintenance`: `sync_tiers`, or a restart: everything released, the manager closed and built again on
  the same directory / Redis prefix (a new process: device and host empty, the tier below not).

After every rule `check_integrity()` holds (enable_runtime_checks, and the base invariant), and the
shadow model (`fuzz_support.check_request_kv`) proves every processed position of every live request holds
its own prefix's values; `PrefixStampModel` checks every position a forward reads, so a page loaded from
host, disk or Redis that holds anything else fails the example. Teardown releases everything, checks no
device page or host row is leaked, closes the connectors and removes the temporary directory and keys.

The machine is deterministic, so Hypothesis can replay and shrink what it finds (its draws depend on the
state): every `step` waits for the transfers it started, each offload of a push waits for its own before
the next one starts (`_build`, `fuzz_support.wait_for_each_offload`; the peer's too), disk writes use one
thread, and a Redis failure is retried at once. `test_fuzz_regressions.py` runs one warm-up several times
and requires one outcome. Transfers racing the steps are the engine machine's job (`test_stateful_engine.py`).
The swap, `traffic`, `tier_fault` and `peer_traffic` rules are in `fuzz_tier_rules.TierRules`; this
module holds the setup, `maintenance`, the checks and the teardown. The plain tests (the shadow check
and the forged page are not vacuous, and a bug the machine found) are in `test_fuzz_regressions.py`.
"""

from __future__ import annotations

import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fuzz_support import (
    EXAMPLES,
    REDIS,
    check_request_kv,
    drop_redis_prefix,
    hmac_kwargs,
    require_redis_or_skip_connector,
    shared_redis,
    stop_shared_redis,
    wait_for_each_offload,
)
from fuzz_tier_rules import REPORT, TierRules
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, rule
from test_stateful import ManagerMachine, layout_params

from pagedkv.core.context import TextContext
from pagedkv.core.pool import EVICTION_POLICIES
from pagedkv.manager.paged import PagedKVCacheManager
from pagedkv.params.connector import KVConnectorConfig
from pagedkv.testing import PrefixStampModel

CONNECTORS = ["local", "tiered", *(["redis"] if REDIS else [])]


@pytest.fixture(scope="module", autouse=True)
def _module_resources() -> Iterator[None]:
    require_redis_or_skip_connector()
    REPORT.start()
    yield
    stop_shared_redis()
    REPORT.write(connectors=CONNECTORS, hmac=bool(hmac_kwargs(0)))


class TierMachine(TierRules, ManagerMachine):
    """`ManagerMachine` with a connector, swap preemption, tier faults and warm restarts."""

    @initialize(
        page_size=st.sampled_from([1, 2, 3, 4, 8]),
        num_pages=st.integers(6, 16),  # small: prefixes keep leaving the device and coming back
        spec=st.sampled_from([0, 0, 2]),
        algo=st.sampled_from(["sha256", "sha256_64", "xxh3_128"]),
        layout=st.sampled_from(["mha", "mha-tp2", "mla-tp2"]),  # what tiers support (no hybrid)
        policy=st.sampled_from(list(EVICTION_POLICIES)),  # every registered policy
        protect=st.sampled_from([0.0, 0.25]),
        leaves=st.booleans(),
        connector=st.sampled_from(CONNECTORS + CONNECTORS[1:]),  # the lower tiers twice as often
        host_pages=st.integers(0, 32),
        disk_pages=st.integers(2, 40),
        io_threads=st.integers(1, 3),
        hmac_seed=st.integers(0, 2**31),
        warm_seed=st.integers(0, 2**32 - 1),
        warm_up=st.integers(0, 40),
    )
    def tier_setup(
        self, page_size: int, num_pages: int, spec: int, algo: str, layout: str, policy: str, protect: float,
        leaves: bool, connector: str, host_pages: int, disk_pages: int, io_threads: int, hmac_seed: int,
        warm_seed: int, warm_up: int,
    ) -> None:  # fmt: skip
        self.connector = connector
        self.dir: str | None = None
        self.prefix = f"fz{uuid.uuid4().hex[:12]}:"
        signed = hmac_kwargs(hmac_seed) if hmac_seed % 2 else {}  # half the examples sign pages (once supported)
        # one disk writer: concurrent writers pick LRU victims in a racy order, and this machine must be
        # deterministic (its draws depend on the state; see `_build`); Redis values do not depend on order
        config: dict[str, object] = {"io_threads": io_threads if connector == "redis" else 1, **signed}
        extra: dict[str, object] = {"kv_connector": connector}
        if connector in ("local", "tiered"):
            host_pages = max(1, host_pages)  # these connectors always have host rows
            extra["host_kvcache_swap_space_gb"] = 1  # required by the params; total_num_host_pages sizes it
        if connector == "tiered":
            self.dir = tempfile.mkdtemp(prefix="pagedkv-fuzz-disk-")
            # a cap of about disk_pages files (a file is a 112-byte header + a row of at most 512 bytes here)
            config.update(disk_offload_dir=self.dir, disk_offload_max_gb=disk_pages * 600 / 2**30)
        if connector == "redis":
            server = shared_redis()
            # retried at once, and a timeout no healthy call on a loaded machine reaches (a killed server is
            # refused at once): whether Redis is skipped must not depend on time
            config.update(redis_url=server.url, redis_key_prefix=self.prefix, redis_timeout_s=10.0,
                          redis_retry_s=1e-9)  # fmt: skip
        extra["kv_connector_config"] = KVConnectorConfig(**config)
        self.params = layout_params(
            layout, page_size=page_size, enable_prefix_caching=True, num_eagle_speculative_tokens=spec,
            kv_hash_algo=algo, eviction_policy=policy, protected_fraction=protect, evict_leaves_first=leaves,
            **extra,
        )  # fmt: skip
        self.num_pages, self.host_pages = num_pages, host_pages
        self.swapped: dict[int, TextContext] = {}
        self.next_id = 0
        self.ops = 0
        self.now = 0.0
        self.hybrid = False
        self.faults = 0
        self.positions = 0
        self.swaps = 0
        self.restarts = 0
        self.forward_steps = 0
        self.rules = -1  # Hypothesis steps (invariants run once after setup, then after every rule)
        self.targets: dict[int, int] = {}  # request id -> length at which `traffic` releases it
        self.history: list[tuple[list[int], str | None]] = []  # the last prompts `traffic` served
        self.peer: PagedKVCacheManager | None = None  # another process on the same tiers (`peer_traffic`)
        self._build()
        self._warm_up(warm_seed, warm_up)

    setup = None  # type: ignore[assignment]  # replaced by tier_setup

    def _build(self) -> None:
        """A fresh manager (and stamp model) on the example's params, tiers and directories."""
        self.mgr = PagedKVCacheManager(self.params, None, self.num_pages, self.host_pages, enable_runtime_checks=True,
                                       max_batch_size=64)  # fmt: skip
        self.model = PrefixStampModel(self.mgr)
        self.bm = self.mgr._managers[0]
        self.live: dict[int, TextContext] = {}
        self.allocated: set[int] = set()
        self.bm.pool.keyed_order().clock = lambda: self.now
        self.conn = self.mgr.tiers.connectors[0]
        wait_for_each_offload(self.conn)  # (the runs of one push would race each other for host rows)
        step = self.mgr.step

        def step_then_settle(batches: Any) -> None:
            """`step`, then wait for the transfers it left running (offloads to host, writes below).
            Hypothesis needs a deterministic machine (the draws depend on the state); a load racing a
            write is timing, so it happens in the engine machine, whose draws do not depend on state."""
            self.forward_steps += 1
            step(batches)
            self.conn.flush()

        self.mgr.step = step_then_settle  # type: ignore[method-assign]

    @property
    def row_bytes(self) -> int:
        return int(self.conn.mover.row_bytes)

    # ------------------------------------------------------------------ maintenance
    @rule(kind=st.sampled_from(["sync", "sync", "restart"]))
    def maintenance(self, kind: str) -> None:
        """`sync_tiers` (every committed page written below), or a restart: a new process on the same
        tiers (everything released, the manager closed and built again on the same directory / prefix)."""
        if kind == "sync":
            self.mgr.sync_tiers()
        else:
            for rid in [*self.live, *self.swapped]:
                self.mgr.release(rid)
            self._assert_nothing_leaked()
            self._account()
            self.mgr.close()
            self._close_peer()
            self.swapped = {}
            self._build()
            self.restarts += 1
        self.ops += 1

    def _account(self) -> None:
        """Add the current manager's stamp-model and tier counters to the report."""
        stats = self.mgr.tier_stats()
        REPORT.add(
            positions_checked=self.model.positions_checked,
            **{f"pages_loaded_{name}": int(s["pages_loaded"]) for name, s in stats.items()},
            **{f"pages_refused_{name}": int(s["refused"]) for name, s in stats.items() if name != "host"},
            **{f"errors_{name}": int(s["errors"]) for name, s in stats.items() if name != "host"},
            pages_swapped_out=int(stats.get("host", {}).get("pages_swapped_out", 0)),
        )  # fmt: skip

    # ------------------------------------------------------------------ checks
    @invariant()
    def shadow_kv(self) -> None:
        """Every live request's processed positions hold its own prefix's values (loaded pages included)."""
        if hasattr(self, "mgr"):
            self.rules += 1
            for c in self.live.values():
                self.positions += check_request_kv(self.mgr, c)
            if self.conn.host is not None:
                self.conn.host.index.check_integrity()

    def _assert_nothing_leaked(self) -> None:
        self.mgr.check_integrity()
        assert self.mgr.get_num_used_pages() == 0, "device pages leaked after every release"
        assert self.mgr.num_free_blocks() == self.mgr.total_num_blocks()
        assert not any(self.mgr.is_swapped(rid) for rid in self.swapped)
        if self.mgr.can_swap:
            assert self.mgr.tiers.swap_spaces[0].rows_lent == 0, "host rows lent to swapped requests leaked"
        self.mgr.sync_tiers()
        if self.conn.host is not None:
            index = self.conn.host.index
            index.check_integrity()
            assert index.available() == index.capacity, "host rows stay pinned after every transfer finished"

    def teardown(self) -> None:
        if not hasattr(self, "mgr"):  # setup failed: only the directory to remove
            if getattr(self, "dir", None) is not None:
                shutil.rmtree(self.dir, ignore_errors=True)
            return
        try:
            for rid in [*self.live, *self.swapped]:
                self.mgr.release(rid)
            self._assert_nothing_leaked()
            self._account()
            self.mgr.close()
            assert not self.mgr.tiers.connectors and not self.mgr.can_swap, "connectors still attached after close"
            self._close_peer()
            REPORT.add(examples=1, rules=self.rules, operations=self.ops, forward_steps=self.forward_steps,
                       shadow_positions_checked=self.positions, faults_injected=self.faults, swaps=self.swaps,
                       restarts=self.restarts, **{f"examples_{self.connector}": 1})  # fmt: skip
        finally:
            if self.peer is not None:  # after a failure
                self.peer.close()
            if self.dir is not None:
                shutil.rmtree(self.dir, ignore_errors=True)
                assert not Path(self.dir).exists()
            if self.connector == "redis":
                drop_redis_prefix(self.prefix)


TierMachine.TestCase.settings = settings(ManagerMachine.TestCase.settings, max_examples=EXAMPLES,
                                        stateful_step_count=60)  # fmt: skip
TestTierMachine = TierMachine.TestCase
