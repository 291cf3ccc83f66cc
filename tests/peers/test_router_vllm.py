"""The router's index against vLLM 0.33's own KV events: vLLM's real `KVCacheManager` (events on) publishes
through vLLM's own `ZmqEventPublisher` on loopback; for a scripted run of stores, evictions, salts and a
prefix-cache reset, `PrefixIndex.score` (with `VLLMHasher`, per hash algorithm) equals the hit vLLM's
manager computes for the same tokens (`get_computed_blocks`). Skips without vLLM unless
PAGEDKV_REQUIRE_PEERS=1."""

from __future__ import annotations

import socket
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "router"))
from engines import wait_for  # noqa: E402
from vllm_engine import vllm_or_skip  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"])
def test_scores_equal_vllm_computed_blocks(algo: str, monkeypatch: pytest.MonkeyPatch) -> None:
    vllm_or_skip()
    import torch
    from vllm.distributed.kv_events import KVEventBatch, ZmqEventPublisher
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.request import Request, RequestStatus

    from pagedkv.router import EngineSpec, PrefixIndex, VLLMHasher

    block = 4
    seed = "1234" if algo.startswith("xxhash") else None  # xxhash needs a shared PYTHONHASHSEED to be predictable
    if seed is not None:
        monkeypatch.setenv("PYTHONHASHSEED", seed)
    fn = get_hash_fn_by_name(algo)
    init_none_hash(fn)
    hasher = get_request_block_hasher(block, fn)
    spec = FullAttentionSpec(block_size=block, num_kv_heads=1, head_size=1, dtype=torch.float32)
    config = KVCacheConfig(num_blocks=25, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l"], spec)])
    mgr = KVCacheManager(config, max_model_len=1024, scheduler_block_size=block, hash_block_size=block,
                         enable_caching=True, enable_kv_cache_events=True)  # fmt: skip
    port, replay_port = free_port(), free_port()
    pub = ZmqEventPublisher(0, endpoint=f"tcp://*:{port}", replay_endpoint=f"tcp://*:{replay_port}", topic="kv@e")
    index = PrefixIndex([EngineSpec("vllm", f"tcp://127.0.0.1:{port}", VLLMHasher(block, algo, seed or "vllm-none-hash"),
                                    f"tcp://127.0.0.1:{replay_port}", "kv@e")])  # fmt: skip
    published = 0

    def publish() -> None:
        nonlocal published
        events = mgr.take_events()
        if events:
            pub.publish(KVEventBatch(ts=time.time(), events=events))
            published += 1
            wait_for(lambda: index.next_seq("vllm") == published, what="the batch")

    rng = np.random.default_rng(1)
    prefixes = [rng.integers(0, 900, size=int(n)).tolist() for n in (10, 18, 27, 35)]
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    hits = 0
    try:
        assert index.wait_ready()
        time.sleep(0.3)  # PUB/SUB joining: the first batch goes to the replay otherwise (also covered)
        for step in range(40):
            if step == 25:
                assert mgr.reset_prefix_cache()
                publish()
            prompt = prefixes[int(rng.integers(4))] + rng.integers(0, 900, size=int(rng.integers(0, 7))).tolist()
            salt = "tenant" if step % 6 == 5 else None
            req: Any = Request(str(step), prompt, sp, None, arrival_time=0.0, block_hasher=hasher, cache_salt=salt)
            predicted = index.score(prompt, salt)["vllm"]
            blocks, hit, _ = mgr.get_computed_blocks(req)
            assert predicted == hit, (step, predicted, hit)
            hits += hit > 0
            assert mgr.allocate_slots(req, req.num_tokens - hit, hit, blocks) is not None
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = req.num_tokens
            publish()
            mgr.free(req)
            req.status = RequestStatus.FINISHED_LENGTH_CAPPED
        stats = index.stats("vllm")
        assert hits > 5 and stats.removals > 0 and stats.clears == 1 and stats.malformed == 0
    finally:
        index.close()
        pub.shutdown()


def test_late_joiner_syncs_through_vllm_replay() -> None:
    """vLLM's replay answers ``[b"", topic, seq, payload]`` then ``[b"", b"", -1, b""]``: the index syncs
    from it when it joins late, without counting a gap or applying a batch twice."""
    vllm_or_skip()
    from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch, ZmqEventPublisher

    from pagedkv.router import EngineSpec, PrefixIndex, VLLMHasher

    hasher = VLLMHasher(4)
    prompt = list(range(100, 141))
    keys = hasher.hashes(prompt)
    port, replay_port = free_port(), free_port()
    pub = ZmqEventPublisher(0, endpoint=f"tcp://*:{port}", replay_endpoint=f"tcp://*:{replay_port}", topic="kv")

    def stored(first: int, stop: int) -> Any:
        return BlockStored(block_hashes=keys[first:stop], parent_block_hash=keys[first - 1] if first else None,
                           token_ids=prompt[first * 4 : stop * 4], block_size=4, lora_id=None, medium="GPU",
                           lora_name=None)  # fmt: skip

    pub.publish(KVEventBatch(ts=time.time(), events=[stored(0, 3)]))
    pub.publish(KVEventBatch(ts=time.time(), events=[BlockRemoved(block_hashes=keys[2:3], medium="GPU")]))
    time.sleep(0.3)  # both published before anyone subscribed
    index = PrefixIndex([EngineSpec("v", f"tcp://127.0.0.1:{port}", hasher, f"tcp://127.0.0.1:{replay_port}", "kv")])
    try:
        assert index.wait_ready()
        wait_for(lambda: index.next_seq("v") == 2)
        assert index.score(prompt)["v"] == 8
        stats = index.stats("v")
        assert (stats.replayed, stats.gaps, stats.unrecovered) == (2, 0, 0)
        time.sleep(0.3)  # the SUB has joined
        pub.publish(KVEventBatch(ts=time.time(), events=[stored(2, 6)]))
        wait_for(lambda: index.next_seq("v") == 3)
        assert index.score(prompt)["v"] == 24
    finally:
        index.close()
        pub.shutdown()
