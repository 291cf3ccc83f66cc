"""`alloc` stays bookkeeping: a tier hit is staged at `alloc` and copied into its device page at `runtime_inputs`.

Each test proves one rule of the staged-load contract (`pagedkv.offload.staged_loads`):
no device byte changes inside `alloc`; the copies land before anything reads or writes
device pages; released requests, evicted pages, shared host rows and failed copies
leave no pinned host row, no leaked page and no wrong KV behind.
"""

from __future__ import annotations

import subprocess
import sys
import time
from typing import Any

import pytest
import torch
from test_disk_tier import stuck_reads
from test_host_tier import LAYOUTS, keys, pages, scramble

from helpers import ctx, decode, make_params, serve
from pagedkv.core.events import BlockRemoved
from pagedkv.manager.paged import PagedKVCacheManager
from pagedkv.offload import DiskTier, KVConnector, PageMover
from pagedkv.offload.format import key_bytes
from pagedkv.offload.staged_loads import LoadCopyError
from pagedkv.testing import PrefixStampModel

LOCAL = dict(enable_prefix_caching=True, kv_connector="local", host_kvcache_swap_space_gb=1)
PROMPT = list(range(1, 14))  # 13 tokens, pages of 4: pages 0-2 full and shareable
SENTINEL = 0xAB


def evicted_prefix_manager(num_pages: int = 6) -> tuple[PagedKVCacheManager, PrefixStampModel]:
    """A device pool whose PROMPT prefix (3 pages) was evicted from the device but sits in host rows."""
    params = make_params(**LOCAL, n_kv_heads=2, head_dim=2, num_layers=2)
    mgr = PagedKVCacheManager(params, None, num_pages, total_num_host_pages=16, max_batch_size=4,
                              enable_runtime_checks=True)  # fmt: skip
    model = PrefixStampModel(mgr)
    serve(mgr, model, ctx("a", PROMPT), 4)
    serve(mgr, model, ctx("evictor", range(50, 46 + 4 * num_pages)), 2)  # (+ 2 tokens: needs every device page)
    mgr.sync_tiers()
    return mgr, model


def fill_device(mgr: PagedKVCacheManager, value: int) -> None:
    for unit in mgr.tiers.connectors[0].mover.units:
        unit.buffer.fill_(value)


def host_bytes(mgr: PagedKVCacheManager, page: int) -> bytes:
    """The host row holding the hash the device prefix cache names for `page`."""
    conn = mgr.tiers.connectors[0]
    slot = conn.host.index.get(key_bytes(mgr._managers[0].pool.block_hash(page)))
    assert slot is not None
    return conn.host.buffer[slot].numpy().tobytes()


def nothing_pinned(mgr: PagedKVCacheManager) -> bool:
    """Every host row is free or held by an unpinned entry (and the index is consistent)."""
    index = mgr.tiers.connectors[0].host.index
    index.check_integrity()
    return index.available() == index.capacity


def test_alloc_only_stages_and_runtime_inputs_copies() -> None:
    mgr, model = evicted_prefix_manager()
    conn = mgr.tiers.connectors[0]
    fill_device(mgr, SENTINEL)  # so any byte `alloc` wrote would show
    b = ctx("b", [*PROMPT, 99])
    mgr.claim("b")
    mgr.alloc(b)
    loaded = mgr.get_req_blocks("b")[:3]
    assert b.cached_prefix_length == 12 and len(conn.staged) == 3  # hits counted, copies owed
    assert pages(mgr, loaded) == [bytes([SENTINEL]) * len(p) for p in pages(mgr, loaded)]  # alloc did no tensor work
    assert not nothing_pinned(mgr)  # the staged rows are pinned until copied
    expected = [host_bytes(mgr, p) for p in loaded]
    mgr.runtime_inputs([[b]])
    assert pages(mgr, loaded) == expected and len(conn.staged) == 0 and nothing_pinned(mgr)
    model.forward([[b]])  # every cached position holds this prefix's KV
    assert model.positions_checked >= 12
    mgr.release("b")
    mgr.check_integrity()
    mgr.close()


def test_request_released_before_forward_leaves_nothing_behind() -> None:
    mgr, model = evicted_prefix_manager()
    conn = mgr.tiers.connectors[0]
    b = ctx("b", [*PROMPT, 99])
    mgr.claim("b")
    mgr.alloc(b)
    mgr.release("b")  # released between alloc and the forward
    mgr.check_integrity()
    assert len(conn.staged) == 3  # still owed: the pages stay cached under their hashes
    mgr.step([[]])  # the next step (or forward) runs them
    assert len(conn.staged) == 0 and nothing_pinned(mgr)
    c = ctx("c", [*PROMPT, 98])  # hits the released pages on the device: their KV must have landed
    mgr.claim("c")
    mgr.alloc(c)
    assert c.cached_prefix_length == 12 and len(conn.staged) == 0 and mgr.tier_stats()["host"]["pages_loaded"] == 3
    model.forward([[c]])
    mgr.release("c")
    mgr.check_integrity()
    mgr.close()


def test_loaded_page_evicted_and_reused_before_the_forward() -> None:
    """Staged copies into pages another request took since run first; that request's forward writes over them."""
    mgr, model = evicted_prefix_manager()
    conn = mgr.tiers.connectors[0]
    b = ctx("b", [*PROMPT, 99])
    mgr.claim("b")
    mgr.alloc(b)
    loaded = mgr.get_req_blocks("b")[:3]
    mgr.release("b")
    evictor = ctx("evictor2", range(200, 223))  # all 6 device pages: the loaded ones are evicted and reused
    mgr.claim("evictor2")
    mgr.alloc(evictor)
    assert set(loaded) <= set(mgr.get_req_blocks("evictor2")) and len(conn.staged) == 3
    model.forward([[evictor]])  # the stale copies land before this forward writes
    assert len(conn.staged) == 0 and nothing_pinned(mgr)
    mgr.release("evictor2")
    c = ctx("c", [*PROMPT, 98])
    mgr.claim("c")
    mgr.alloc(c)
    assert c.cached_prefix_length == 12  # from host again
    model.forward([[c]])
    mgr.release("c")
    mgr.check_integrity()
    mgr.close()


def test_one_host_row_loaded_twice_and_one_page_staged_twice() -> None:
    mgr = PagedKVCacheManager(LAYOUTS["fp32"](), None, 10, total_num_host_pages=4, max_batch_size=4)
    conn = mgr.tiers.connectors[0]
    scramble(mgr, 1)
    a, b = pages(mgr, [1]), pages(mgr, [2])
    conn.offload([1, 2], keys("a", "b"))
    conn.wait_for_offloads()
    scramble(mgr, 2)
    assert conn.load([5], keys("a")) == 1 and conn.load([6], keys("a")) == 1  # one row, two pins
    assert conn.load([7], keys("a")) == 1 and conn.load([7], keys("b")) == 1  # page 7: the newer load wins
    assert len(conn.staged) == 3 and conn.host.index.available() == 2
    assert conn.complete_loads() == 3
    assert pages(mgr, [5]) == a and pages(mgr, [6]) == a and pages(mgr, [7]) == b
    assert len(conn.staged) == 0 and conn.host.index.available() == 4
    conn.host.index.check_integrity()
    mgr.close()


def test_lower_tier_pages_staged_without_a_host_tier(tmp_path: Any) -> None:
    """Disk pages fetched (and checked) at `load` into a staging buffer; copied at `complete_loads`."""
    mgr = PagedKVCacheManager(LAYOUTS["fp32"](), None, 10, max_batch_size=2)  # (its own tiers are not used)
    mgr.close()
    buffer = mgr.get_device_buffer()
    mover = PageMover(buffer)
    disk = DiskTier(tmp_path, mover.row_bytes, 1 << 20, b"f" * 16, "sha256", threads=1)
    conn = KVConnector("tiered", mover, host_pages=0, lower=[disk], page_size=mgr.page_size)
    assert conn.host is None
    scramble_units(mover, 1)
    before = pages_of(mover, [1, 2])
    conn.offload([1, 2], keys("a", "b"))
    conn.flush()
    scramble_units(mover, 2)
    stale = pages_of(mover, [7, 8])
    assert conn.load([7, 8], keys("a", "b")) == 2 and pages_of(mover, [7, 8]) == stale  # fetched, not copied
    conn.wait_for_loads()  # the older name of complete_loads
    assert pages_of(mover, [7, 8]) == before and len(conn.staged) == 0
    conn.shutdown()


def test_a_host_row_lent_to_an_abandoned_disk_read_stays_pinned_until_handed_back(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Disk pages are read straight into the host rows reserved for them (lent). A read the file system holds
    up past `timeout_s` is a miss, and its row stays pinned (nothing reuses it) until the read ends and the disk
    tier hands it back; then it is free and the host index is whole."""
    mgr = PagedKVCacheManager(LAYOUTS["fp32"](), None, 10, max_batch_size=2)
    mgr.close()
    mover = PageMover(mgr.get_device_buffer())
    disk = DiskTier(tmp_path, mover.row_bytes, 1 << 20, b"f" * 16, "sha256", threads=1, timeout_s=0.2)
    conn = KVConnector("tiered", mover, host_pages=4, lower=[disk], page_size=mgr.page_size)
    scramble_units(mover, 1)
    before = pages_of(mover, [1])
    conn.offload([1, 2], keys("a", "b"))
    conn.flush()
    conn.host.index.clear()  # only the disk holds them now
    assert conn.host.index.available() == 4
    stuck, release = stuck_reads(monkeypatch, str(disk.path(keys("b")[0])))
    assert conn.load([7, 8], keys("a", "b")) == 1 and stuck.is_set()  # page b's read was abandoned
    assert conn.host.index.available() == 2  # a's row (pinned until copied) and b's (lent to the stuck read)
    conn.complete_loads()
    assert pages_of(mover, [7]) == before
    assert conn.host.index.available() == 3  # b's row is still lent
    release.set()
    for _ in range(100):  # the reader hands b's row back when its read ends
        if conn.host.index.available() == 4:
            break
        time.sleep(0.05)
    assert conn.host.index.available() == 4 and keys("b")[0] not in conn.host.index
    conn.host.index.check_integrity()
    monkeypatch.undo()
    conn.shutdown()


def scramble_units(mover: PageMover, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for unit in mover.units:
        unit.buffer.copy_(torch.randint(0, 256, unit.buffer.shape, dtype=torch.uint8, generator=g))


def pages_of(mover: PageMover, ids: list[int]) -> list[bytes]:
    return [unit.buffer[i].numpy().tobytes() for unit in mover.units for i in ids]


def test_failed_device_copy_unpins_forgets_the_pages_and_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    mgr, model = evicted_prefix_manager()
    conn = mgr.tiers.connectors[0]
    b = ctx("b", [*PROMPT, 99])
    mgr.claim("b")
    mgr.alloc(b)
    loaded = mgr.get_req_blocks("b")[:3]
    pool = mgr._managers[0].pool
    keys = [pool.block_hash(p) for p in loaded]
    batches: list = []
    mgr.add_kv_event_listener(batches.append)

    def broken(*args: object) -> None:
        raise RuntimeError("copy engine fault")

    monkeypatch.setattr(conn.mover, "from_rows", broken)
    with pytest.raises(LoadCopyError, match="were rolled back: alloc them again") as info:
        mgr.runtime_inputs([[b]])
    assert info.value.pages == loaded and isinstance(info.value.__cause__, RuntimeError)
    mgr.check_integrity()  # b gave those pages back
    assert all(pool.block_hash(p) is None for p in loaded)  # no later request can hit their garbage
    assert len(conn.staged) == 0 and nothing_pinned(mgr)
    mgr.tiers.after_step()  # listeners hear that the device no longer holds those pages
    removed = [h for batch in batches for e in batch.events if isinstance(e, BlockRemoved) and e.medium == "GPU"
               for h in e.block_hashes]  # fmt: skip
    assert removed == keys
    monkeypatch.undo()
    mgr.release("b")  # (its caller may also give up on it)
    mgr.check_integrity()
    c = ctx("c", [*PROMPT, 98])
    mgr.claim("c")
    mgr.alloc(c)
    assert c.cached_prefix_length == 12  # from host again, and this time the copy lands
    model.forward([[c]])
    mgr.release("c")
    mgr.check_integrity()
    mgr.close()


def test_a_failed_device_copy_rolls_back_every_request_holding_its_pages() -> None:
    """A real copy failure (the host rows' tensor broken between `alloc` and the copy: torch's index_select
    raises): right after it every live request is consistent (`check_integrity`), and each one that held a
    failed page gave back its pages from there, its context moved back to match, so its next `alloc` and
    forward compute them, with the right KV."""
    mgr, model = evicted_prefix_manager(8)  # PROMPT's 3 pages are in host rows, not on the device
    conn, pool = mgr.tiers.connectors[0], mgr._managers[0].pool
    d = ctx("d", [300, 301, 302])  # running, on no page the load touches
    mgr.claim("d")
    decode(mgr, model, d, 1)
    serve(mgr, model, ctx("p", PROMPT[:5]), 1)  # puts PROMPT's first page back on the device (computed)
    b, c = ctx("b", [*PROMPT, 99]), ctx("c", [*PROMPT[:8], 77, 78])
    for x in (b, c):
        mgr.claim(x.request_id)
        mgr.alloc(x)
    first, loaded = mgr.get_req_blocks("b")[0], mgr.get_req_blocks("b")[1:3]
    assert (b.tokens.processed_length, c.tokens.processed_length) == (12, 8) and len(conn.staged) == 2
    assert mgr.get_req_blocks("c")[:2] == [first, loaded[0]]  # c hit b's loaded page on the device
    rows = conn.host.buffer
    shape = tuple(rows.shape)
    rows.resize_(0, shape[1])  # the copy's source is broken (same storage: restored below)
    with pytest.raises(LoadCopyError) as info:
        mgr.runtime_inputs([[b, c, d]])
    rows.resize_(shape)
    assert info.value.pages == loaded and isinstance(info.value.__cause__, RuntimeError)
    mgr.check_integrity()  # every live request is consistent at once
    assert mgr.get_req_blocks("b") == [first] and mgr.get_req_blocks("c") == [first]  # back to before the load
    assert (b.tokens.processed_length, c.tokens.processed_length) == (4, 4)  # and so are their contexts
    assert all(pool.block_hash(page) is None for page in loaded) and nothing_pinned(mgr)
    assert len(mgr.get_req_blocks("d")) == 1
    mgr.reset_prefix_cache()  # the host rows too: what the failed pages were to hold must be computed now
    for x in (b, c):
        mgr.alloc(x)  # each computes from its first lost token
    assert (b.tokens.processed_length, c.tokens.processed_length) == (4, 4)
    assert (b.cached_prefix_length, c.cached_prefix_length) == (4, 4)
    mgr.alloc(d)
    model.forward([[b, c, d]])  # every position read holds its own prefix's KV
    for x in (b, c, d):
        x.update(5)
    mgr.step([[b, c, d]])
    for x in (b, c, d):
        mgr.alloc(x)
    checked = model.positions_checked
    model.forward([[b, c, d]])  # reads b's and c's recomputed pages
    assert model.positions_checked - checked == 14 + 10 + 4
    for x in (b, c, d):
        mgr.release(x.request_id)
    mgr.sync_tiers()  # (the last forward's offloads)
    mgr.check_integrity()
    assert mgr.get_num_used_pages() == 0 and nothing_pinned(mgr)
    mgr.close()


def test_swap_out_right_after_alloc_takes_the_loaded_bytes() -> None:
    mgr, model = evicted_prefix_manager()
    b = ctx("b", [*PROMPT, 99])
    mgr.claim("b")
    mgr.alloc(b)
    assert len(mgr.tiers.connectors[0].staged) == 3
    assert mgr.swap_out("b")  # reads the pages: the staged copies run first
    assert len(mgr.tiers.connectors[0].staged) == 0
    mgr.swap_in(b)
    model.forward([[b]])  # the swapped-back prefix is this prompt's KV
    assert model.positions_checked >= 12
    mgr.release("b")
    mgr.check_integrity()
    mgr.close()


def test_offload_package_exports_without_optional_deps() -> None:
    """Every name the README shows under `pagedkv.offload` imports; redis and xxhash load only when used."""
    code = (
        "import sys\n"
        "sys.modules['redis'] = None; sys.modules['xxhash'] = None  # importing them now raises\n"
        "import pagedkv.offload as o\n"
        "from pagedkv.offload import (KVConnector, HostTier, LowerTier, DiskTier, RedisTier, PageMover,\n"
        "    SwapSpace, create_connector, LoadCopyError, format)\n"
        "from pagedkv.offload.format import key_bytes\n"
        "assert sorted(o.__all__) == sorted(o._EXPORTS) and issubclass(DiskTier, LowerTier) and issubclass(RedisTier, LowerTier)\n"
        "assert callable(create_connector) and KVConnector.load and SwapSpace.swap_out and PageMover.from_rows\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
    code = "import sys; sys.modules['torch'] = None\nimport pagedkv.offload.format\nimport pagedkv.offload\nprint('ok')"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr  # the package itself is torch-free
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        import pagedkv.offload

        pagedkv.offload.Nope  # noqa: B018
