"""KV events of a model with recurrent state: attention pages and state checkpoints are reported in vLLM's
wire format, with their group index and spec kind ("full_attention", "mamba")."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers import ctx
from pagedkv import DeviceRef, DType, KVCacheParams, MultiKVCacheParams, PagedKVCacheManager
from pagedkv.core import events as ev
from pagedkv.core.state.checkpoints import checkpoint_key
from pagedkv.interface import MambaSpec
from pagedkv.params.state import StateCacheParams

PS = 4


def manager() -> PagedKVCacheManager:
    devices = [DeviceRef.CPU()]
    shared = dict(page_size=PS, enable_prefix_caching=True, max_state_checkpoints=1)
    state = MambaSpec(block_size=PS, shapes=((6, 3), (2, 4, 8)), dtypes=(torch.float32, torch.float32))
    params = MultiKVCacheParams({
        "attention": KVCacheParams(dtype=DType.float32, n_kv_heads=2, head_dim=8, num_layers=1, devices=devices,
                                   **shared),
        "state": StateCacheParams.from_spec(state, 2, devices, **shared),
    })  # fmt: skip
    return PagedKVCacheManager(params, None, 16, max_batch_size=1, enable_runtime_checks=True)


def run_prompt(mgr: PagedKVCacheManager, rid: str, tokens: list[int]) -> None:
    c = ctx(rid, tokens)
    mgr.claim(rid)
    mgr.alloc(c)
    mgr.runtime_inputs([[c]])
    c.update(99)
    mgr.step([[c]])
    mgr.release(rid)


def test_checkpoints_are_stored_and_removed_with_the_mamba_kind() -> None:
    mgr = manager()
    batches: list[ev.KVEventBatch] = []
    mgr.add_kv_event_listener(batches.append)
    a, b = list(range(1, 11)), list(range(50, 56))
    run_prompt(mgr, "a", a)  # pages 0, 1 committed; the prompt's end (10) saved: parent page 1, tail 9, 10
    run_prompt(mgr, "b", b)  # page 0 committed; its prompt's end (6) takes the only checkpoint row: a's goes
    mgr.step([[]])  # (the release-time events go out with the next step)
    events = [e for batch in batches for e in batch.events]
    hasher = mgr._managers[0].hasher  # (the deployment's seed roots the chains)
    keys_a, _ = hasher.extend(np.array(a), 0, 2, hasher.root())
    keys_b, _ = hasher.extend(np.array(b), 0, 1, hasher.root())
    ckpt_a = checkpoint_key(keys_a[1], np.array(a[8:], dtype=np.int32))
    ckpt_b = checkpoint_key(keys_b[0], np.array(b[4:], dtype=np.int32))
    assert events == [
        ev.BlockStored(keys_a, None, a[:8], PS, "GPU", 0, "full_attention"),
        ev.BlockStored([ckpt_a], keys_a[1], a[8:], PS, "GPU", 1, "mamba"),
        ev.BlockStored(keys_b, None, b[:4], PS, "GPU", 0, "full_attention"),
        ev.BlockRemoved([ckpt_a], "GPU", 1),
        ev.BlockStored([ckpt_b], keys_b[0], b[4:], PS, "GPU", 1, "mamba"),
    ]
    mgr.reset_prefix_cache()
    assert batches[-1].events[-1] == ev.AllBlocksCleared()
    assert mgr.num_state_checkpoints() == 0


def test_the_wire_format_carries_the_spec_kind() -> None:
    msgspec = pytest.importorskip("msgspec")
    from pagedkv.observability import decode_batch, encode_batch

    stored = ev.BlockStored([b"\x01" * 32], b"\x02" * 32, [9, 10], PS, "GPU", 1, "mamba")
    payload = encode_batch(ev.KVEventBatch(0, 1.0, [stored]))
    raw = msgspec.msgpack.decode(payload)[1][0]
    assert raw["kv_cache_spec_kind"] == "mamba" and raw["group_idx"] == 1 and raw["token_ids"] == [9, 10]
    plain = msgspec.msgpack.decode(encode_batch(ev.KVEventBatch(0, 1.0, [ev.BlockStored([1], None, [], PS)])))
    assert "kv_cache_spec_kind" not in plain[1][0]  # omitted when unset, as vLLM's omit_defaults Struct
    back = decode_batch(payload).events[0]
    assert isinstance(back, ev.BlockStored) and back.kv_cache_spec_kind == "mamba" and back.group_idx == 1
