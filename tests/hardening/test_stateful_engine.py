"""Stateful fuzzing of the whole serving stack: `LLMEngine` + manager + host/disk/Redis tiers, checked
against transformers itself.

Each example serves a tiny fp32 Llama (`pagedkv.testing.build_llama`) with `LLMEngine.from_hf` on a small
device pool with a tier below it ("tiered": host rows + page files in a temporary directory under a
small cap; "redis": the module's redis-server, a key prefix of its own, with or without host rows),
chunked prefill under a small token budget, swap or recompute preemption. Each example starts warm (a
seeded warm-up of up to 12 rounds of add-and-step from one drawn seed). The rules:

- `add_requests`: 1-3 prompts from a few shared prefixes plus a random suffix, 1-6 new tokens each,
  optionally a `cache_salt` (shared tenants "a"/"b", or a fresh one that must never hit anything:
  checked on `Request.cached_tokens`), when the engine takes `cache_salt=`;
- `step` (1-4 engine steps), `drain` (run to completion);
- `reset_prefix_cache`, `sync_tiers`;
- `tier_fault`: damage stored pages for real while writes may be in flight (flip a byte, truncate,
  delete, garbage, another page's bytes, FLUSHALL, wipe the directory; a forged page when pages are
  signed), kill -9 Redis / start it again on its port; a third of the time followed by a restart: the
  engine drained and closed, a new one (a new process: device and host empty) built on the same tiers,
  and recent prompts served again, so damaged pages are read back;
- `switch_weights`: `LLMEngine.update_weights(state_dict, version)` between two weight sets (seeds 0
  and 1 of the same config), when the engine has it.

The shadow model is transformers itself: each (weights, prompt) is run greedily with no cache of any
kind on an identical model (eager attention, a full forward per token), once, and cached. Every
request that finishes must have produced the reference's tokens, and its logits must equal the
reference's within `ATOL` (`fuzz_engine_support`, where its value is argued). A request that was
running when the weights changed is recomputed with the new ones mid-life, so its expected output is
ambiguous: it is counted but not compared; every request whose whole life ran under one version is
compared, which includes every request added after the last switch. After every rule
`check_integrity()` holds; at the end every request has finished, no page is in use, no host row is
lent, and the connectors close.

The draws of this machine never depend on the engine's state (every rule is always enabled, choices
among live objects are made from drawn integers), so tier transfers run truly concurrently with the
steps (a load may race a write) without making Hypothesis see "inconsistent data generation".
The model, its reference and `Tracked` are in `fuzz_engine_support`, with the mixin holding the cache
and tier rules and the restart (`EngineTierRules`). The plain tests (the logits check is not vacuous: one
wrong page moves them by > 100 ATOL; an engine bug the machine found) are in `test_fuzz_regressions.py`.
"""

from __future__ import annotations

import shutil
import tempfile
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from fuzz_engine_support import (
    ATOL,
    CONFIG,
    CONNECTORS,
    HAS_SALT,
    HAS_UPDATE,
    HAS_VERSION,
    MAX_NEW,
    PREFIXES,
    REPORT,
    EngineTierRules,
    Tracked,
    reference,
    reference_model,
)
from fuzz_support import (
    EXAMPLES,
    drop_redis_prefix,
    hmac_kwargs,
    require_redis_or_skip_connector,
    shared_redis,
    stop_shared_redis,
)
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from pagedkv.engine import LLMEngine
from pagedkv.engine.request import Request
from pagedkv.params.connector import KVConnectorConfig
from pagedkv.testing import build_llama


@pytest.fixture(scope="module", autouse=True)
def _module_resources() -> Iterator[None]:
    require_redis_or_skip_connector()
    REPORT.start()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a model this small runs faster on one thread
    yield
    torch.set_num_threads(threads)
    stop_shared_redis()
    REPORT.write(connectors=CONNECTORS, cache_salt=HAS_SALT, update_weights=HAS_UPDATE, hmac=bool(hmac_kwargs(0)))


class EngineMachine(EngineTierRules, RuleBasedStateMachine):
    @initialize(
        connector=st.sampled_from(CONNECTORS),
        page_size=st.sampled_from([2, 3, 4]),
        extra_pages=st.integers(0, 10),
        host_pages=st.integers(0, 32),
        budget=st.sampled_from([3, 5, 8, 16, 64]),
        batch=st.sampled_from([2, 4, 8]),
        swap=st.booleans(),
        disk_pages=st.integers(2, 60),
        signed=st.booleans(),
        warm_seed=st.integers(0, 2**32 - 1),
        warm_up=st.integers(0, 12),
    )
    def setup(
        self, connector: str, page_size: int, extra_pages: int, host_pages: int, budget: int, batch: int,
        swap: bool, disk_pages: int, signed: bool, warm_seed: int, warm_up: int,
    ) -> None:  # fmt: skip
        self.connector = connector
        self.dir: str | None = None
        self.prefix = f"fe{uuid.uuid4().hex[:12]}:"
        num_pages = -(-20 // page_size) + extra_pages  # at least 20 token slots: most requests fit
        self.capacity = num_pages * page_size  # token slots; a longer request could never run (not added)
        config: dict[str, Any] = {"model_id": "fuzz-llama", **(hmac_kwargs(7) if signed else {})}
        kwargs: dict[str, Any] = {"kv_connector": connector}
        if connector == "tiered":
            self.dir = tempfile.mkdtemp(prefix="pagedkv-fuzz-engine-")
            host_pages = max(1, host_pages)
            config.update(disk_offload_dir=self.dir, disk_offload_max_gb=disk_pages * 2048 / 2**30)
            kwargs["host_kvcache_swap_space_gb"] = 1  # required; total_num_host_pages sizes the host tier
        else:
            server = shared_redis()
            config.update(redis_url=server.url, redis_key_prefix=self.prefix, redis_timeout_s=0.25,
                          redis_retry_s=0.02)  # fmt: skip
        kwargs["kv_connector_config"] = KVConnectorConfig(**config)
        self.weights = 0
        self.switches = 0
        self.restarts = 0
        self.settings = dict(
            page_size=page_size, num_pages=num_pages, max_batch_size=batch, max_num_batched_tokens=budget,
            record_logits=True, total_num_host_pages=host_pages,
            preemption_mode=None if host_pages == 0 else ("swap" if swap else "recompute"), **kwargs,
        )  # fmt: skip
        self._build()
        self.tracked: list[Tracked] = []
        self.salts = 0
        self.ops = 0
        self.faults = 0
        self.counts = dict(compared=0, ambiguous=0, ties=0, logits_compared=0, fresh_salt_checked=0,
                           skipped_too_long=0)  # fmt: skip
        self.max_error = 0.0
        self.rules = -1  # Hypothesis steps (the invariant runs once after setup, then after every rule)
        self._warm_up(warm_seed, warm_up)

    def _warm_up(self, seed: int, iterations: int) -> None:
        """`iterations` of add-requests-then-step driven by a seeded RNG instead of draws: every example
        starts with requests running, full pools and pages in the tiers (cheap, reproducible from the seed)."""
        rng = np.random.default_rng(seed)
        for _ in range(iterations):
            for _ in range(int(rng.integers(1, 4))):
                suffix = rng.integers(3, 97, size=int(rng.integers(0, 7))).tolist()
                salt = [None, None, "a", "b", "fresh"][int(rng.integers(5))]
                self.add_request(int(rng.integers(len(PREFIXES) + 1)), suffix, int(rng.integers(1, MAX_NEW + 1)), salt)
            self.step(int(rng.integers(1, 4)))

    def _build(self) -> None:
        """A new engine (a new process) on the example's tiers, serving the current weights."""
        model = build_llama(0, "eager", **CONFIG)
        if self.weights:
            model.load_state_dict(reference_model(self.weights).state_dict())
        settings = dict(self.settings)
        if HAS_UPDATE and HAS_VERSION:
            settings["weights_version"] = f"w{self.weights}"  # what update_weights switches between
        self.engine = LLMEngine.from_hf(model, **settings)
        self.mgr = self.engine.manager
        self.mgr.enable_runtime_checks = True  # check_integrity after every mutating manager call
        self.conn = self.mgr.tiers.connectors[0]

    # ------------------------------------------------------------------ requests
    @rule(
        requests=st.lists(
            st.tuples(st.integers(0, len(PREFIXES)), st.lists(st.integers(3, 96), max_size=6),
                      st.integers(1, MAX_NEW), st.sampled_from([None, None, "a", "b", "fresh"])),
            min_size=1, max_size=3,
        )
    )  # fmt: skip
    def add_requests(self, requests: list[tuple[int, list[int], int, str | None]]) -> None:
        for args in requests:
            self.add_request(*args)

    def add_request(self, prefix: int, suffix: list[int], max_new: int, salt: str | None) -> None:
        self._add((PREFIXES[prefix] if prefix < len(PREFIXES) else []) + suffix or [5], max_new, salt)

    def _add(self, prompt: list[int], max_new: int, salt: str | None) -> None:
        kwargs: dict[str, Any] = {}
        fresh = False
        if HAS_SALT and salt is not None:
            fresh = salt == "fresh"
            if fresh:
                self.salts += 1
                salt = f"fresh-{self.prefix}{self.salts}"
            kwargs["cache_salt"] = salt
        if len(prompt) + max_new - 1 > self.capacity:  # could never fit in the whole pool
            self.counts["skipped_too_long"] += 1
            return
        request = self.engine.add_request(prompt, max_new, **kwargs)
        self.tracked.append(Tracked(request, prompt, max_new, self.weights, self.switches, salt, fresh))
        self.ops += 1

    @rule(n=st.integers(1, 4))
    def step(self, n: int) -> None:
        for _ in range(n):
            if not self.engine.has_unfinished():
                break
            self._step()

    @rule()
    def drain(self) -> None:
        while self.engine.has_unfinished():
            self._step()

    def _step(self) -> None:
        for request in self.engine.step():
            self._finished(request)
        self.ops += 1

    @rule(to=st.integers(0, 2))
    def switch_weights(self, to: int) -> None:
        """Load weight set `to` (2: keep the current one); later requests must match its reference."""
        if not HAS_UPDATE or to > 1 or to == self.weights:
            return
        self.engine.update_weights(reference_model(to).state_dict(), f"w{to}")
        self.weights = to
        self.switches += 1
        self.ops += 1

    # ------------------------------------------------------------------ checks
    def _finished(self, request: Request) -> None:
        item = next(t for t in self.tracked if t.request is request)
        assert not item.done, f"request {request.request_id} finished twice"
        item.done = True
        assert len(request.output) == item.max_new, f"request {request.request_id}: {request.output}"
        if item.fresh_salt and request.preemptions == 0 and item.switches == self.switches:
            # a salt nobody used before shares no page (a weight switch recomputes a request without
            # counting a preemption, and it may then hit its own pages)
            assert request.cached_tokens == 0, f"request {request.request_id} hit pages of another salt"
            self.counts["fresh_salt_checked"] += 1
        if item.switches != self.switches:
            self.counts["ambiguous"] += 1  # recomputed with other weights mid-life: no single reference
            return
        tokens, logits = reference(item.weights, item.prompt)
        want, got = tokens[: item.max_new], request.output
        same = next((i for i, (a, b) in enumerate(zip(want, got, strict=True)) if a != b), len(want))
        n = min(same + 1, len(want))  # the logits up to and including the first differing token
        error = float((torch.stack(request.logits)[:n] - logits[:n]).abs().max())  # request.logits: [max_new] x [V]
        where = f"request {request.request_id} (prompt {item.prompt}, weights {item.weights})"
        assert error <= ATOL, f"{where}: logits differ from transformers' by {error:.3g}"
        self.max_error = max(self.max_error, error)
        if same < len(want):  # tokens differ only where the reference's top two logits tie within ATOL
            top = torch.topk(logits[same], 2).values
            assert float(top[0] - top[1]) <= 2 * ATOL, f"{where}: generated {got}, transformers {want}"
            self.counts["ties"] += 1
        self.counts["compared"] += 1
        self.counts["logits_compared"] += n

    @invariant()
    def integrity(self) -> None:
        if hasattr(self, "mgr"):
            self.rules += 1
            self.mgr.check_integrity()

    def teardown(self) -> None:
        if not hasattr(self, "engine"):  # setup failed: only the directory to remove
            if getattr(self, "dir", None) is not None:
                shutil.rmtree(self.dir, ignore_errors=True)
            return
        try:
            self._close()
            last = [t for t in self.tracked if t.switches == self.switches]
            assert all(t.done for t in last), "every request added after the last weight switch is checked"
            REPORT.add(
                examples=1, rules=self.rules, operations=self.ops, requests=len(self.tracked),
                faults_injected=self.faults, weight_switches=self.switches, restarts=self.restarts, **self.counts,
                **{f"examples_{self.connector}": 1},
            )  # fmt: skip
            REPORT.maximum(max_logit_error=self.max_error)
        finally:
            if self.dir is not None:
                shutil.rmtree(self.dir, ignore_errors=True)
            if self.connector == "redis":
                drop_redis_prefix(self.prefix)


EngineMachine.TestCase.settings = settings(
    max_examples=max(1, EXAMPLES // 3), stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)  # fmt: skip
TestEngineMachine = EngineMachine.TestCase
