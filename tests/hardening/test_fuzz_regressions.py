"""Plain tests of the stateful fuzzers: their checks are not vacuous, and bugs the machines found.

Of the manager machine over the tiers (`test_stateful_tiers.py`): the shadow check (`check_request_kv`)
fails on a page holding another prefix's values; a forged page (the `forge` fault) is served unless
pages are signed; a disk page whose file vanished is written to disk again once recomputed; one warm-up
always ends in the same state (the machine is deterministic, as Hypothesis needs).
Of the engine machine (`test_stateful_engine.py`): one wrong page moves the logits far beyond `ATOL`;
a request longer than the whole cache is refused up front instead of blocking the queue.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import test_stateful_tiers as tiers
import torch
from fuzz_engine_support import ATOL, CONFIG, PREFIXES, reference
from fuzz_support import check_request_kv, disk_page_files, forge, hmac_kwargs
from test_stateful import layout_params

from pagedkv.core.context import TextContext
from pagedkv.core.errors import InsufficientBlocksError
from pagedkv.engine import LLMEngine
from pagedkv.manager.paged import PagedKVCacheManager
from pagedkv.params.connector import KVConnectorConfig
from pagedkv.testing import PrefixStampModel, build_llama


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread() -> Iterator[None]:
    """As in `test_stateful_engine.py` (these tests ran there): the tiny models run on one thread, and
    `reference()` caches logits computed under it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ----------------------------------------------------------------------------- manager + tiers
def test_shadow_check_catches_a_wrong_page() -> None:
    """The shadow model is not vacuous: a page holding another prefix's values fails it."""
    params = layout_params("mha", page_size=2, enable_prefix_caching=True)
    mgr = PagedKVCacheManager(params, None, 8, max_batch_size=4)
    model = PrefixStampModel(mgr)
    c = TextContext(0, np.arange(10, 15))
    mgr.claim(0)
    mgr.alloc(c)
    model.forward([[c]])
    c.update(3)
    mgr.step([[c]])
    assert check_request_kv(mgr, c) == 5
    mgr.get_device_buffer().values[0][mgr.get_req_blocks(0)[1], 0, 1, 0] += 1  # layer 1, slot 0 of page 1
    with pytest.raises(AssertionError, match=r"positions \[2\]"):
        check_request_kv(mgr, c)


def _serve(mgr: PagedKVCacheManager, model: PrefixStampModel, rid: int, tokens: list[int]) -> int:
    c = TextContext(rid, np.array(tokens))
    mgr.claim(rid)
    mgr.alloc(c)
    model.forward([[c]])
    c.update(1)
    mgr.step([[c]])
    mgr.release(rid)
    return c.cached_prefix_length


@pytest.mark.parametrize("signed", [False, True])
def test_forged_page_is_served_unless_pages_are_signed(tmp_path: Path, signed: bool) -> None:
    """The machine's `forge` fault is not vacuous: a page with a valid header and checksum over another
    prefix's KV passes the public format's checks, and only a signing key (tier_hmac_key) refuses it."""
    mac = hmac_kwargs(1)
    if signed and not mac:
        pytest.skip("KVConnectorConfig has no tier_hmac_key yet")
    config = KVConnectorConfig(disk_offload_dir=str(tmp_path), io_threads=1, **(mac if signed else {}))
    params = layout_params("mha", page_size=4, enable_prefix_caching=True, kv_connector="tiered",
                           host_kvcache_swap_space_gb=1, kv_connector_config=config)  # fmt: skip

    def fresh() -> tuple[PagedKVCacheManager, PrefixStampModel]:
        mgr = PagedKVCacheManager(params, None, 8, 4, enable_runtime_checks=True, max_batch_size=4)
        return mgr, PrefixStampModel(mgr)

    mgr, model = fresh()
    _serve(mgr, model, 0, list(range(10, 19)))  # pages [10..13], [14..17] go to disk
    mgr.sync_tiers()
    root = mgr.tiers.connectors[0].lower[0].root
    first = disk_page_files(root)
    _serve(mgr, model, 1, list(range(50, 59)))  # pages [50..53], [54..57]
    mgr.close()
    second = [f for f in disk_page_files(root) if f not in first]
    assert len(first) == len(second) == 2
    mgr, model = fresh()  # a new process: device and host empty, the pages come from disk
    victim, donor = first[0], second[0]
    row_bytes = int(mgr.tiers.connectors[0].mover.row_bytes)
    victim.write_bytes(forge(victim.read_bytes(), donor.read_bytes(), row_bytes))
    if signed:
        assert _serve(mgr, model, 2, list(range(10, 19))) < 8  # the forged page is refused, recomputed
        assert mgr.tier_stats()["disk"]["refused"] == 1
    else:
        with pytest.raises(AssertionError, match="another prefix's KV"):
            _serve(mgr, model, 2, list(range(10, 19)))
    mgr.close()


def test_a_disk_page_whose_file_vanished_is_written_again(tmp_path: Path) -> None:
    """A page file deleted behind the tier's back (an operator, another process sharing the directory
    and evicting under its own cap, a lost file) is a miss and the page is recomputed. But `DiskTier._read`
    returns on FileNotFoundError without dropping the key from `_index`, and `DiskTier.store` skips every
    key in `_index` without looking at the file: the recomputed page is never written to disk again, so
    every later request for that prefix recomputes it once the device and host tiers have evicted it
    (and `get_num_used_disk_pages` counts files that do not exist). Dropping the key in `_read` alone is
    not enough: a load stops at the first miss, so later pages of the prefix are never probed."""
    config = KVConnectorConfig(disk_offload_dir=str(tmp_path), io_threads=1)
    params = layout_params("mha", page_size=4, enable_prefix_caching=True, kv_connector="tiered",
                           host_kvcache_swap_space_gb=1, kv_connector_config=config)  # fmt: skip
    mgr = PagedKVCacheManager(params, None, 4, 1, max_batch_size=4)  # 4 device pages, 1 host row
    model = PrefixStampModel(mgr)
    try:
        a, b, c = list(range(10, 19)), list(range(50, 59)), list(range(70, 79))  # 9 tokens: 2 full pages each
        _serve(mgr, model, 0, a)
        mgr.sync_tiers()
        root = mgr.tiers.connectors[0].lower[0].root
        for path in disk_page_files(root):  # a's two pages vanish from disk
            path.unlink()
        for rid, prompt in enumerate([b, c, a], 1):  # b and c push a out of device and host; a is recomputed
            _serve(mgr, model, rid, prompt)
        mgr.sync_tiers()  # a's pages are written again (they are not: the index says they are there)
        for rid, prompt in enumerate([b, c], 4):
            _serve(mgr, model, rid, prompt)
        mgr.sync_tiers()
        assert _serve(mgr, model, 6, a) == 8  # fails: 0, a's pages were never written to disk again
    finally:
        mgr.close()


def _warmed_up() -> tuple[object, ...]:
    """What the tier machine holds after one seeded warm-up (40 rounds of `traffic`, no Hypothesis draw) on
    host rows and disk pages: every live request's progress, each tier's counters and the disk's files."""
    machine = tiers.TierMachine()
    machine.tier_setup(page_size=2, num_pages=12, spec=0, algo="sha256", layout="mha", policy="lru", protect=0.0,
                       leaves=False, connector="tiered", host_pages=3, disk_pages=10, io_threads=1, hmac_seed=0,
                       warm_seed=3, warm_up=40)  # fmt: skip
    try:
        stats = {name: (s["pages_stored"], s["pages_loaded"], s["evictions"], s["skipped_writes"])
                 for name, s in machine.mgr.tier_stats().items()}  # fmt: skip
        files = [p.name for p in disk_page_files(machine.conn.lower[0].root)]
        live = sorted((rid, c.tokens.processed_length, len(c.tokens)) for rid, c in machine.live.items())
        return (live, sorted(stats.items()), files, machine.swaps)
    finally:
        machine.teardown()


def test_the_tier_machine_holds_the_same_after_the_same_warm_up() -> None:
    """The tier machine's draws depend on its state, so its state must not depend on thread timing (or
    Hypothesis, replaying an example, finds other draws and raises FlakyStrategyDefinition). With few host
    rows, one `runtime_inputs` pushes several runs of pages whose copies and writes raced each other for
    host rows, and one offload's two `store` calls (host rows, staged) raced the disk tier's cap: five runs
    of this warm-up ended in two or more states. `fuzz_support.wait_for_each_offload` runs them in turn."""
    outcomes = [_warmed_up() for _ in range(5)]
    assert all(o == outcomes[0] for o in outcomes[1:])


# ----------------------------------------------------------------------------- engine + tiers
def _cached_pages(engine: LLMEngine, prompt: list[int]) -> list[int]:
    """The device pages the prefix cache holds for `prompt` (claimed, allocated and released again)."""
    mgr = engine.manager
    ctx = TextContext("probe", np.asarray(prompt))
    mgr.claim("probe")
    mgr.alloc(ctx)
    pages = mgr.get_req_blocks("probe")[: ctx.cached_prefix_length // mgr.page_size]
    mgr.release("probe")
    return pages


def test_one_wrong_page_moves_the_logits_far_beyond_atol() -> None:
    """The logits check is not vacuous: with one cached page replaced by another prefix's page (same
    position), the next request's logits leave ATOL by orders of magnitude."""
    engine = LLMEngine.from_hf(build_llama(0, "eager", **CONFIG), page_size=4, num_pages=40, record_logits=True)
    a, b = PREFIXES[0], [t + 1 for t in PREFIXES[0]]  # 12 tokens each: 3 full pages, 2 of them cached
    engine.generate([a, b], 1)
    pages_a, pages_b = _cached_pages(engine, a), _cached_pages(engine, b)
    assert len(pages_a) == len(pages_b) >= 2
    prompt = [*a, 5, 6]
    request = engine.add_request(prompt, 1)
    engine.run()
    assert float((request.logits[0] - reference(0, prompt)[1][0]).abs().max()) <= ATOL  # intact: equal
    for values in engine.manager.get_device_buffer().values:
        values[pages_a[1]] = values[pages_b[1]]  # page 1 of a now holds b's KV
    request = engine.add_request([*a, 5, 7], 1)
    engine.run()
    assert request.cached_tokens >= 8
    error = float((request.logits[0] - reference(0, [*a, 5, 7])[1][0]).abs().max())
    assert error > 100 * ATOL, error


def test_a_request_longer_than_the_whole_cache_is_refused_up_front() -> None:
    """Found by the machine when its pools got smaller than its longest prompt: `add_request` used to
    queue a 16-token prompt in a 10-slot cache (only `generate` checked the capacity); once it reached
    the head of the queue `Scheduler._admit_one` raised InsufficientBlocksError from `engine.step()`,
    and again at every later step (it stayed first in `waiting`), so requests behind it never ran. Now
    `pagedkv.engine.checks` refuses such a request before it is queued."""
    engine = LLMEngine.from_hf(build_llama(0, "eager", **CONFIG), page_size=2, num_pages=5)
    short = engine.add_request([5, 6, 7], 2)
    with pytest.raises(InsufficientBlocksError):
        engine.add_request(list(range(3, 19)), 2)  # 16 + 2 - 1 token slots > 10
    behind = engine.add_request([8, 9], 2)
    engine.run()
    assert short.output == reference(0, [5, 6, 7])[0][:2] and behind.output == reference(0, [8, 9])[0][:2]
