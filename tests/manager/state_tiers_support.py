"""Helpers of the tier tests of models with recurrent state (`test_state_tiers.py`,
`offload/test_state_checkpoint_tiers.py`): their cache layouts, a stand-in model that writes random bytes,
and what a request holds at a checkpoint (`Held`), compared bit for bit between managers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from helpers import ctx
from pagedkv import DeviceRef, DType, KVCacheParams, MultiKVCacheParams, PagedKVCacheManager
from pagedkv.core.context import TextContext
from pagedkv.core.state.checkpoints import checkpoint_key
from pagedkv.interface import MambaSpec
from pagedkv.params.connector import KVConnectorConfig
from pagedkv.params.state import StateCacheParams
from pagedkv.runtime.state_buffers import StateCacheBuffer

CPU = DeviceRef.CPU()
NEW = 3  # tokens each request generates: its release keeps a checkpoint at prompt + NEW - 1
STATE = ((6, 3), (2, 4, 8))  # one state layer's tensors (fp32); two layers per state group


def layout(
    ps: int, connector: str, config: KVConnectorConfig | None = None, *, attention: tuple[tuple[int, int], ...] = ((2, 8),),
    states: tuple[tuple[tuple[int, ...], ...], ...] = (STATE,), **extra: Any,
) -> MultiKVCacheParams:  # fmt: skip
    """Full attention caches (n_kv_heads, head_dim; one layer each) and state caches (one `MambaSpec` each)."""
    shared: dict[str, Any] = dict(page_size=ps, enable_prefix_caching=True, kv_connector=connector,
                                  kv_connector_config=config, **extra)  # fmt: skip
    if connector in ("local", "tiered"):
        shared["host_kvcache_swap_space_gb"] = 0.001  # (the host rows are given by total_num_host_pages)
    children: dict[str, KVCacheParams] = {}
    for i, (heads, dim) in enumerate(attention):
        children[f"attn{i}"] = KVCacheParams(dtype=DType.float32, n_kv_heads=heads, head_dim=dim, num_layers=1,
                                             devices=[CPU], **shared)  # fmt: skip
    for i, shapes in enumerate(states):
        spec = MambaSpec(block_size=ps, shapes=shapes, dtypes=(torch.float32,) * len(shapes))
        children[f"state{i}"] = StateCacheParams.from_spec(spec, 2, [CPU], **shared)
    return MultiKVCacheParams(children)


def manager(params: MultiKVCacheParams, host_pages: int = 16, batch: int = 2) -> PagedKVCacheManager:
    return PagedKVCacheManager(params, None, 48, host_pages, enable_runtime_checks=True, max_batch_size=batch)


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class RandomModel:
    """The forward of a model on `mgr`'s buffers: random K/V at every computed position of every attention
    group (every slot of the step's window, nothing else) and random bytes over the live state row."""

    def __init__(self, mgr: PagedKVCacheManager, seed: int) -> None:
        self.mgr = mgr
        self.gen = torch.Generator().manual_seed(seed)

    def forward(self, batch: list[TextContext]) -> None:
        mgr = self.mgr
        mgr.runtime_inputs([batch])  # (state copies, then the tiers' loads, land here)
        buffer, ps = mgr._buffers[0], mgr.page_size
        for c in batch:
            start, end = c.tokens.processed_length, c.tokens.current_position
            for g, child in enumerate(buffer.children.values()):
                if isinstance(child, StateCacheBuffer):
                    continue
                pages = mgr.get_req_blocks(c.request_id, group=g)
                for pos in range(start, end):
                    for values in child.values:  # [pages, 2, layers, ps, heads, dim] per shard
                        slot = values[pages[pos // ps], :, :, pos % ps]
                        slot.copy_(torch.randn(slot.shape, generator=self.gen))
            for arena in buffer.state_arenas:
                row = live_row(mgr, c.request_id)
                arena[row] = torch.randint(0, 256, (arena.shape[1],), generator=self.gen, dtype=torch.uint8)


def live_row(mgr: PagedKVCacheManager, rid: object) -> int:
    return mgr.get_req_blocks(rid, group=mgr._managers[0].tier_groups.state)[0]


def run(mgr: PagedKVCacheManager, model: RandomModel, rid: object, prompt: list[int], new: int = NEW) -> TextContext:
    """Claim and serve `prompt` for `new` steps (one token each after the prefill); not released. The
    context's `cached_prefix_length` is what its first alloc resumed from."""
    c = ctx(rid, prompt)
    mgr.claim(rid)
    for t in range(new):
        mgr.alloc(c)
        model.forward([c])
        c.update(1000 + t)
        mgr.step([[c]])
    return c


class Held:
    """What a request holds at position `pos`: its state row, the arena rows of its full pages and the
    written slots of its tail page, per attention group (every shard)."""

    def __init__(self, mgr: PagedKVCacheManager, rid: object, pos: int) -> None:
        buffer, ps = mgr._buffers[0], mgr.page_size
        self.state = [a[live_row(mgr, rid)].clone() for a in buffer.state_arenas]
        self.pages, self.tails = [], []
        for g, child in enumerate(buffer.children.values()):
            if isinstance(child, StateCacheBuffer):
                continue
            table = mgr.get_req_blocks(rid, group=g)
            self.pages.append([a[table[: pos // ps]].clone() for a in buffer.arenas])
            if pos % ps:
                self.tails.append([v[table[pos // ps], :, :, : pos % ps].clone() for v in child.values])

    def __eq__(self, other: object) -> bool:
        assert isinstance(other, Held)
        pairs = [*zip(self.state, other.state, strict=True)]
        for mine, theirs in [*zip(self.pages, other.pages, strict=True), *zip(self.tails, other.tails, strict=True)]:
            pairs.extend(zip(mine, theirs, strict=True))
        return all(a.shape == b.shape and torch.equal(a, b) for a, b in pairs)

    __hash__ = None  # type: ignore[assignment]


def state_dir(mgr: PagedKVCacheManager, directory: Path) -> Path:
    """The directory of the state connector's disk files (named by its layout fingerprint and signing key; before
    `close`)."""
    root = Path(mgr.tiers.state_connectors[0].lower[0].root)
    assert root.parent == directory
    return root


def page_hashes(mgr: PagedKVCacheManager, toks: list[int], n: int) -> list[Any]:
    """The prefix hashes of the first `n` pages of `toks`."""
    hasher = mgr._managers[0].hasher
    return hasher.extend(np.asarray(toks), 0, n, hasher.root())[0]


def key_of(mgr: PagedKVCacheManager, toks: list[int], pos: int) -> bytes:
    """The key of the checkpoint of `toks` at `pos`: its parent page's hash (the chain's root in the first
    page) and its tail tokens."""
    ps, hasher = mgr.page_size, mgr._managers[0].hasher
    pages = page_hashes(mgr, toks, pos // ps)
    parent = pages[-1] if pages else (hasher.root(),)
    return checkpoint_key(parent, np.asarray(toks[pos // ps * ps : pos], dtype=np.int32))


def checkpoint_file(mgr: PagedKVCacheManager, files: Path, toks: list[int], pos: int) -> Path:
    """The file under `files` (`state_dir`) of the checkpoint of `toks` at `pos`."""
    key = key_of(mgr, toks, pos)
    return files / f"{key[0]:02x}" / f"{key.hex()}.page"


def loaded(mgr: PagedKVCacheManager) -> dict[str, int]:
    return {name: int(s["pages_loaded"]) for name, s in mgr.tier_stats().items()}  # type: ignore[call-overload]


def serve_and_close(directory: Path, ps: int, prompt: list[int], seed: int, **config: Any) -> tuple[Held, list[int]]:
    """Manager A: serve `prompt`, release (its checkpoint at len(prompt) + NEW - 1), sync and close the tiers.
    Returns what A held at that checkpoint and every token of the request."""
    a = manager(layout(ps, "tiered", KVConnectorConfig(disk_offload_dir=str(directory), **config)))
    c = run(a, RandomModel(a, seed), "a", prompt)
    pos = len(prompt) + NEW - 1
    held = Held(a, "a", pos)
    a.release("a")
    a.sync_tiers()
    stats = a.tier_stats()
    assert stats["disk"]["pages_stored"] == pos // ps  # every full page it computed
    assert stats["disk_states"]["pages_stored"] == 2  # its prompt end and its release
    a.close()
    a.check_integrity()
    return held, c.tokens.all.tolist()
