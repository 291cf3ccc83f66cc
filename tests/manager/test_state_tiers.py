"""Tiers below the device on models with recurrent state (`PagedKVCacheManager`, real host rows and disk files).

A model here is an attention cache beside a recurrent state cache (`StateCacheParams`), as `kv_layout` builds
for a Mamba / gated delta net / short-conv hybrid. `RandomModel` stands in for the forward: it writes random
bytes into every position a step computes and into the request's whole live state row, so a position or a
state that a later manager holds was either loaded from a tier or is wrong (nothing recomputes those bytes).

Manager A serves a prompt and releases it (its release keeps its live state as a checkpoint at prompt +
generated - 1; its prompt end is one too), `sync_tiers`, `close`. Manager B (a new process: empty device and
host, same disk directory) serves A's tokens and more: it resumes exactly at the deepest checkpoint the tiers
hold, loading every full attention page before it and one checkpoint image (state row + tail page), and holds
A's bytes there bit for bit. `check_integrity()` runs after every mutating call (`enable_runtime_checks`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from state_tiers_support import (
    CPU,
    NEW,
    STATE,
    Held,
    RandomModel,
    checkpoint_file,
    layout,
    loaded,
    manager,
    page_hashes,
    run,
    serve_and_close,
    state_dir,
    tokens,
)

from helpers import ctx
from pagedkv import DType, KVCacheParams, MultiKVCacheParams, PagedKVCacheManager
from pagedkv.interface import MambaSpec
from pagedkv.manager.tier_link import tier_key
from pagedkv.offload.format import HEADER_SIZE, key_bytes
from pagedkv.offload.staged_loads import LoadCopyError
from pagedkv.params.connector import KVConnectorConfig
from pagedkv.params.state import StateCacheParams


# ----------------------------------------------------------------- a warm restart from disk
@pytest.mark.parametrize(("ps", "n"), [(4, 23), (4, 37), (16, 23), (16, 37)])
def test_a_new_manager_resumes_at_the_release_checkpoint_with_the_same_bytes(tmp_path: Path, ps: int, n: int) -> None:
    held, toks = serve_and_close(tmp_path, ps, tokens(n, n), seed=ps)
    pos = n + NEW - 1  # the release's checkpoint (the last generated token is never fed back)
    b = manager(layout(ps, "tiered", KVConnectorConfig(disk_offload_dir=str(tmp_path))))
    c = ctx("b", [*toks, *tokens(5, 99)])  # the conversation's next turn
    b.claim("b")
    b.alloc(c)
    assert c.cached_prefix_length == c.tokens.processed_length == pos
    assert loaded(b) == {"host": 0, "disk": pos // ps, "host_states": 0, "disk_states": 1}
    b.runtime_inputs([[c]])  # the loads land before the forward
    assert Held(b, "b", pos) == held
    model = RandomModel(b, 7)
    model.forward([c])
    c.update(5)
    b.step([[c]])
    b.release("b")
    b.check_integrity()
    b.close()


def test_the_deepest_checkpoint_at_or_before_the_last_token_wins(tmp_path: Path) -> None:
    """The tiers hold A's prompt end (23) and release (25). A request of exactly 25 tokens computes its last
    token, so 25 is past its reach: it resumes at 23 (5 full pages); 26 tokens resume at 25."""
    ps, prompt = 4, tokens(23, 1)
    held, toks = serve_and_close(tmp_path, ps, prompt, seed=3)
    config = KVConnectorConfig(disk_offload_dir=str(tmp_path))
    for length, want, pages in ((25, 23, 5), (26, 25, 6)):
        b = manager(layout(ps, "tiered", config))
        c = ctx("b", toks[:length])
        b.claim("b")
        b.alloc(c)
        assert (c.cached_prefix_length, loaded(b)["disk"], loaded(b)["disk_states"]) == (want, pages, 1)
        b.runtime_inputs([[c]])
        if want == 25:
            assert Held(b, "b", 25) == held
        b.release("b")
        b.close()


@pytest.mark.parametrize(("n", "aligned"), [(22, True), (23, False)])
def test_page_aligned_and_mid_page_checkpoint_images(tmp_path: Path, n: int, aligned: bool) -> None:
    """The disk file of the release checkpoint is the image [state row | tail page row]: the tail part is
    zeros at a page boundary (24 = 6 pages) and A's tail page at 25 (a tail of 1). B resumes bit-identically:
    at 24 its page 6 is untouched (no tail copy), at 25 it holds A's whole tail page."""
    ps = 4
    pos = n + NEW - 1
    cfg = KVConnectorConfig(disk_offload_dir=str(tmp_path))
    a = manager(layout(ps, "tiered", cfg))
    c = run(a, RandomModel(a, 5), "a", tokens(n, 2))
    held = Held(a, "a", pos)
    table = a.get_req_blocks("a", group=0)
    assert len(table) == 6 + (not aligned)  # (an aligned checkpoint's request holds no page past it)
    tail_row = a._buffers[0].arenas[0][table[6]].clone() if not aligned else None
    a.release("a")
    files = state_dir(a, tmp_path)
    a.close()
    path = checkpoint_file(a, files, c.tokens.all.tolist(), pos)
    payload = path.read_bytes()[HEADER_SIZE:]
    state_bytes, row_bytes = held.state[0].numel(), a._buffers[0].arenas[0].shape[1]
    assert len(payload) == state_bytes + row_bytes
    assert payload[:state_bytes] == held.state[0].numpy().tobytes()
    assert payload[state_bytes:] == (bytes(row_bytes) if tail_row is None else tail_row.numpy().tobytes())

    b = manager(layout(ps, "tiered", cfg))
    c2 = ctx("b", [*c.tokens.all.tolist(), *tokens(6, 3)])
    b.claim("b")
    b.alloc(c2)
    b.runtime_inputs([[c2]])
    assert c2.cached_prefix_length == pos and loaded(b)["disk"] == 6 and loaded(b)["disk_states"] == 1
    assert Held(b, "b", pos) == held
    own_tail = b._buffers[0].arenas[0][b.get_req_blocks("b", group=0)[6]]
    assert torch.equal(own_tail, torch.zeros_like(own_tail) if tail_row is None else tail_row)
    b.release("b")
    b.close()


def test_a_release_before_the_forward_still_lands_the_loads(tmp_path: Path) -> None:
    """B allocs (the tier hit commits 6 pages as device hits and stages the loads) and is released before any
    forward: the loads run at the release (no copy stays staged, no host row pinned), so the 6 pages the device
    prefix cache now names hold A's bytes. Never stepped, B's release keeps no checkpoint: the next request
    resumes at 25 again, from the host rows the disk reads were promoted into."""
    ps = 4
    held, toks = serve_and_close(tmp_path, ps, tokens(23, 4), seed=11)
    b = manager(layout(ps, "tiered", KVConnectorConfig(disk_offload_dir=str(tmp_path))))
    first = ctx("b", [*toks, 1, 2])
    b.claim("b")
    b.alloc(first)
    assert first.cached_prefix_length == 25 and sum(len(x.staged) for x in b.tiers.all_connectors) == 7
    b.release("b")
    for connector in b.tiers.all_connectors:
        assert not len(connector.staged) and connector.host.index.available() == connector.num_host_blocks
    pool = b._managers[0].pool
    cached = [pool.cached_page(h, 0) for h in page_hashes(b, toks, 6)]
    assert torch.equal(b._buffers[0].arenas[0][cached], held.pages[0][0])
    assert b.num_state_checkpoints() == 0
    again = ctx("c", [*toks, 3, 4, 5])
    b.claim("c")
    b.alloc(again)
    assert again.cached_prefix_length == 25
    assert loaded(b) == {"host": 6, "disk": 6, "host_states": 1, "disk_states": 1}
    b.runtime_inputs([[again]])
    assert Held(b, "c", 25) == held
    b.release("c")
    b.close()


@pytest.mark.parametrize("broken", ["pages", "states", "both"])
def test_a_failed_device_copy_restarts_the_request_and_it_resumes_with_the_same_bytes(
    tmp_path: Path, broken: str
) -> None:  # fmt: skip
    """B's alloc stages A's 6 pages and its checkpoint image from host rows; the copies fail for real (the
    host rows' tensor of the page connector, the checkpoint connector or both is broken until the failure:
    torch's index_select raises). Right after it B is consistent (`check_integrity`): it holds nothing, stays
    claimed and its context is back at its first token. Its next alloc looks it up again: it resumes at 25
    from the same host rows and holds A's bytes there bit for bit."""
    ps = 4
    held, toks = serve_and_close(tmp_path, ps, tokens(23, 5), seed=12)
    b = manager(layout(ps, "tiered", KVConnectorConfig(disk_offload_dir=str(tmp_path))))
    c = ctx("b", [*toks, 1, 2])
    b.claim("b")
    b.alloc(c)
    assert c.tokens.processed_length == 25 and [len(x.staged) for x in b.tiers.all_connectors] == [6, 1]
    page_rows, state_rows = (x.host.buffer for x in b.tiers.all_connectors)
    rows = {"pages": [page_rows], "states": [state_rows], "both": [page_rows, state_rows]}[broken]
    shapes = [tuple(r.shape) for r in rows]
    for r in rows:
        r.resize_(0, r.shape[1])  # (the same storage: restored below)
    with pytest.raises(LoadCopyError):
        b.runtime_inputs([[c]])
    for r, shape in zip(rows, shapes, strict=True):
        r.resize_(shape)
    b.check_integrity()
    assert all(b.get_req_blocks("b", group=g) == [] for g in range(2))
    assert c.tokens.processed_length == c.cached_prefix_length == 0
    b.alloc(c)
    assert c.tokens.processed_length == c.cached_prefix_length == 25
    b.runtime_inputs([[c]])
    assert Held(b, "b", 25) == held
    b.release("b")
    b.check_integrity()
    assert b.get_num_used_pages() == 0
    b.close()


def test_a_deeper_checkpoint_from_the_tiers_lands_after_the_device_restore(tmp_path: Path) -> None:
    """B's device holds a checkpoint at 10 on A's path (P: A's first 10 tokens, its own random KV). Q (A's
    tokens and more) resumes at 10 from the device (pages 0-1 shared, state and tail slots copied) and at 25
    from the tiers: pages 2-5 and the image load after the device's copies, so Q holds A's state, A's pages
    2-5 and A's tail slots (P's device copies never overwrite them)."""
    ps = 4
    held, toks = serve_and_close(tmp_path, ps, tokens(23, 12), seed=13)
    b = manager(layout(ps, "tiered", KVConnectorConfig(disk_offload_dir=str(tmp_path))))
    model = RandomModel(b, 14)
    b.release(run(b, model, "p", toks[:10], new=1).request_id)
    assert b.num_state_checkpoints() == 1 and loaded(b)["disk_states"] == 0
    q = ctx("q", [*toks, 7, 7])
    b.claim("q")
    b.alloc(q)
    assert q.cached_prefix_length == 25
    assert (loaded(b)["disk"], loaded(b)["disk_states"]) == (4, 1)  # after the device's 2 pages
    b.runtime_inputs([[q]])  # the device restore's copies, then the tiers' loads
    now = Held(b, "q", 25)
    assert all(torch.equal(x, y) for x, y in zip(now.state, held.state, strict=True))
    assert torch.equal(now.pages[0][0][2:], held.pages[0][0][2:]) and torch.equal(now.tails[0][0], held.tails[0][0])
    assert not torch.equal(now.pages[0][0][:2], held.pages[0][0][:2])  # P's own KV (shared from the device)
    b.release("q")
    b.close()


# ----------------------------------------------------------------- host rows only
def test_a_checkpoint_evicted_from_the_device_is_restored_from_host_rows() -> None:
    """One batch slot and max_state_checkpoints=0: one state row in all. A's release keeps its state in that
    row, `sync_tiers` copies it to a host row, X's admission takes the row (A's device checkpoint is gone);
    A's next turn finds the checkpoint in host rows and resumes at 25 with A's bytes. Nothing leaks."""
    ps = 4
    m = manager(layout(ps, "local", max_state_checkpoints=0), host_pages=16, batch=1)
    assert m.num_state_rows == 1 and m.tier_stats().keys() == {"host", "host_states"}
    images = m.tiers.state_connectors[0]
    assert images.num_host_blocks == 2  # a third of 16 rows of 512 bytes, in images of 656 + 512 bytes
    model = RandomModel(m, 0)
    a = run(m, model, "a", tokens(23, 5))
    held = Held(m, "a", 25)
    m.release("a")
    m.sync_tiers()
    assert m.tier_stats()["host_states"]["pages_stored"] == 1  # the release's (no row was free at its prompt end)
    x = run(m, model, "x", tokens(11, 6))
    assert x.cached_prefix_length == 0 and m.num_state_checkpoints() == 0  # X's live row was A's checkpoint
    m.release("x")
    b = ctx("b", [*a.tokens.all.tolist(), 8, 9])
    pool = m._managers[0].pool
    assert all(pool.cached_page(h, 0) is not None for h in page_hashes(m, a.tokens.all.tolist(), 6))
    m.claim("b")
    m.alloc(b)
    assert b.cached_prefix_length == 25
    # (the device still caches A's 6 pages, but without a device checkpoint its hit is 0: the tiers' hit
    # loads the pages before the checkpoint too, from host rows into the request's own pages)
    assert loaded(m) == {"host": 6, "host_states": 1}
    m.runtime_inputs([[b]])
    assert Held(m, "b", 25) == held
    model.forward([b])
    b.update(4)
    m.step([[b]])
    m.release("b")
    m.check_integrity()
    # nothing leaks: every page is free or evictable (B's checkpoint at 28 is page-aligned: it holds no tail
    # page), and with the prefix cache reset, every page and state row is free, every host row unpinned
    assert m.num_free_blocks() == 48 and m.num_state_checkpoints() == 1
    m.reset_prefix_cache()
    assert m.num_free_blocks() == m.total_num_blocks() == 48 and m.num_state_checkpoints() == 0
    states = m._managers[0].states
    assert states is not None and states.rows.num_free == states.rows.num_blocks == 1
    for connector in m.tiers.all_connectors:
        connector.host.index.check_integrity()
        assert connector.host.index.available() == connector.num_host_blocks and not len(connector.staged)
    m.close()


def test_a_release_checkpoint_reaches_the_host_even_when_the_next_admission_takes_its_row() -> None:
    """The engine's order: release, then the next step's allocs, then its forward (which pushes what was
    saved). With one state row the next admission evicts A's release checkpoint before that push."""
    m = manager(layout(4, "local", max_state_checkpoints=0), host_pages=16, batch=1)
    model = RandomModel(m, 0)
    a = run(m, model, "a", tokens(23, 5))
    m.release("a")
    m.release(run(m, model, "x", tokens(11, 6)).request_id)  # no sync_tiers in between, as in an engine
    b = ctx("b", [*a.tokens.all.tolist(), 8, 9])
    m.claim("b")
    m.alloc(b)
    assert m.tier_stats()["host_states"]["pages_stored"] >= 1 and b.cached_prefix_length == 25


# ----------------------------------------------------------------- several attention groups
def test_each_attention_group_goes_down_under_its_own_key(tmp_path: Path) -> None:
    """Two full attention groups (different shapes) beside two state caches: group g's page of hash h is the
    file `tier_key(h, g, 2)` (two files per page, neither under h itself); B loads both groups' pages and the
    checkpoint (whose image carries a tail page per group) and holds A's bytes in every group."""
    ps, n = 4, 23
    params = dict(attention=((2, 8), (1, 4)), states=(STATE, ((4, 4),)))
    cfg = KVConnectorConfig(disk_offload_dir=str(tmp_path))
    a = manager(layout(ps, "tiered", cfg, **params))
    assert a._managers[0].tier_groups.cacheable == [0, 1]
    c = run(a, RandomModel(a, 8), "a", tokens(n, 7))
    held = Held(a, "a", 25)
    a.release("a")
    files = state_dir(a, tmp_path)
    a.close()
    toks = c.tokens.all.tolist()
    hashes = page_hashes(a, toks, 6)
    assert {p.name for p in files.rglob("*.page")} == {checkpoint_file(a, files, toks, p).name for p in (23, 25)}
    [page_dir] = {p.parent.parent for p in tmp_path.rglob("*.page")} - {files}
    names = {p.name for p in page_dir.rglob("*.page")}
    assert names == {f"{tier_key(h, g, 2).hex()}.page" for h in hashes for g in (0, 1)}
    assert not names & {f"{key_bytes(h).hex()}.page" for h in hashes}

    b = manager(layout(ps, "tiered", cfg, **params))
    c2 = ctx("b", [*toks, 40, 41])
    b.claim("b")
    b.alloc(c2)
    assert c2.cached_prefix_length == 25
    assert loaded(b) == {"host": 0, "disk": 12, "host_states": 0, "disk_states": 1}  # 6 pages x 2 groups
    b.runtime_inputs([[c2]])
    assert Held(b, "b", 25) == held
    b.release("b")
    b.close()


def test_a_two_cache_tree_of_full_attention_is_one_row_per_page_under_its_hash(tmp_path: Path) -> None:
    """Two full attention caches and no state are not a hybrid: one page id holds both caches' KV, so a page
    goes down as one row under the prefix hash itself, and a second manager loads both caches' bytes."""
    cfg = KVConnectorConfig(disk_offload_dir=str(tmp_path))
    shared: dict[str, Any] = dict(page_size=4, enable_prefix_caching=True, kv_connector="tiered",
                                  kv_connector_config=cfg, host_kvcache_swap_space_gb=0.001, devices=[CPU],
                                  dtype=DType.float32, num_layers=1)  # fmt: skip
    params = MultiKVCacheParams({"a": KVCacheParams(n_kv_heads=2, head_dim=16, **shared),
                                 "b": KVCacheParams(n_kv_heads=1, head_dim=8, **shared)})  # fmt: skip
    toks = tokens(23, 9)
    mgrs = [PagedKVCacheManager(params, None, 16, 8, enable_runtime_checks=True, max_batch_size=1) for _ in "ab"]
    first, second = mgrs
    c = ctx("a", toks)
    first.claim("a")
    first.alloc(c)
    first.runtime_inputs([[c]])
    gen = torch.Generator().manual_seed(1)
    for child in first._buffers[0].children.values():
        for values in child.values:
            values.copy_(torch.randn(values.shape, generator=gen))
    pages = first.get_req_blocks("a")[:5]
    before = [v[pages].clone() for child in first._buffers[0].children.values() for v in child.values]
    c.update(1)
    first.step([[c]])
    first.release("a")
    first.close()
    hashes, _ = first._managers[0].hasher.extend(np.asarray(toks), 0, 5, first._managers[0].hasher.root())
    assert {p.name for p in tmp_path.rglob("*.page")} == {f"{key_bytes(h).hex()}.page" for h in hashes}
    c2 = ctx("b", toks)
    second.claim("b")
    second.alloc(c2)
    assert c2.cached_prefix_length == 20 and second.tier_stats()["disk"]["pages_loaded"] == 5
    second.runtime_inputs([[c2]])
    pages = second.get_req_blocks("b")[:5]
    after = [v[pages] for child in second._buffers[0].children.values() for v in child.values]
    assert all(torch.equal(x, y) for x, y in zip(before, after, strict=True))
    second.release("b")
    second.close()


def test_a_model_with_a_sliding_window_group_takes_no_tier_by_hash(tmp_path: Path) -> None:
    """A window group drops pages no later query reads, so its pages are not kept below by hash: a tiered
    connector is refused before any tier is built (kv_connector=local gives such a model swap rows only)."""
    common: dict[str, Any] = dict(page_size=4, enable_prefix_caching=True, kv_connector="tiered",
                                  kv_connector_config=KVConnectorConfig(disk_offload_dir=str(tmp_path / "tier")),
                                  host_kvcache_swap_space_gb=0.001)  # fmt: skip
    attention: dict[str, Any] = dict(dtype=DType.float32, n_kv_heads=2, head_dim=8, num_layers=1, devices=[CPU])
    spec = MambaSpec(block_size=4, shapes=STATE, dtypes=(torch.float32, torch.float32))
    params = MultiKVCacheParams({
        "full": KVCacheParams(**attention, **common),
        "window": KVCacheParams(**attention, **common, sliding_window=8),
        "state": StateCacheParams.from_spec(spec, 2, [CPU], **common),
    })  # fmt: skip
    with pytest.raises(ValueError, match="kv_connector=tiered: tiers below the device keep pages by hash"):
        PagedKVCacheManager(params, None, 16, 8, max_batch_size=1)
    assert not (tmp_path / "tier").exists()
