"""State checkpoints below the device: a request that resumes from a checkpoint loaded from host rows, a disk
directory or a Redis server gives the tokens and logits of one computed from scratch (one full forward of
transformers), for a gated delta net hybrid, a Mamba2 hybrid and a short-convolution hybrid. Engines are
separate (a restart, a second machine): what one saved, the other loads, attention pages and state together."""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from state_models import build_state_model
from test_state_model_prefix_hits import MODELS, NEW, PS, serve, tokens
from test_state_models import check_parity

from pagedkv import KVConnectorConfig
from pagedkv.engine import LLMEngine

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "offload"))

from redis_server import RedisServer  # noqa: E402


def engine(model: torch.nn.Module, **kw: Any) -> LLMEngine:
    args: dict[str, Any] = dict(page_size=PS, num_pages=256, max_num_batched_tokens=64, record_logits=True)
    return LLMEngine.from_hf(model, **{**args, **kw})


def tiered(directory: Path) -> dict[str, Any]:
    config = KVConnectorConfig(model_id="state-tiers", disk_offload_dir=str(directory))
    return dict(kv_connector="tiered", host_kvcache_swap_space_gb=0.01, kv_connector_config=config)


@pytest.mark.parametrize("model_type", MODELS)
def test_a_restarted_engine_resumes_a_conversation_from_disk(model_type: str, tmp_path: Path) -> None:
    """Turn one on engine A; A exits. Engine B (empty device, empty host) serves turn two: it loads the
    attention pages and the checkpoint A's release saved (prompt + output - 1 tokens) from disk, then turn three
    resumes on B's own device; turn four runs after a preemption-sized gap on a third engine."""
    model = build_state_model(model_type, seed=31)
    ref = copy.deepcopy(model)
    a = engine(copy.deepcopy(model), **tiered(tmp_path))
    prompt, batch, requests = tokens(13, 2), [], []
    first = serve(a, prompt)
    a.manager.close()  # writes everything below, stops the tiers
    batch.append(prompt)
    requests.append(first)
    b = engine(copy.deepcopy(model), **tiered(tmp_path))
    for turn in range(2):
        prompt = prompt + requests[-1].output + tokens(3 + 2 * turn, 30 + turn)
        requests.append(serve(b, prompt))
        batch.append(prompt)
    stats = b.manager.tier_stats()
    assert stats["disk_states"]["pages_loaded"] == 1 and stats["disk_states"]["refused"] == 0
    assert stats["disk"]["pages_loaded"] == (13 + NEW - 1) // PS  # the full pages before the checkpoint
    b.manager.close()
    c = engine(copy.deepcopy(model), **tiered(tmp_path))
    prompt = prompt + requests[-1].output + tokens(4, 40)
    requests.append(serve(c, prompt))
    batch.append(prompt)
    c.manager.close()
    ends = [len(p) + NEW - 1 for p in batch]
    assert [r.cached_tokens for r in requests] == [0, *ends[:-1]]
    check_parity(model_type, ref, batch, requests)


@pytest.mark.parametrize("model_type", MODELS)
def test_a_shared_system_prompt_saved_on_one_engine_hits_on_another(model_type: str, tmp_path: Path) -> None:
    """37 system tokens: on engine A the second user ends a chunk at 36 (where the cached pages stop) and saves
    the state there; it goes down the tiers. Every user of engine B resumes at 36 from its first request on."""
    model = build_state_model(model_type, seed=32)
    ref = copy.deepcopy(model)
    system = tokens(37, 1)
    batch = [system + tokens(n, 10 + n) for n in (3, 5, 11, 2, 7)]
    a = engine(copy.deepcopy(model), **tiered(tmp_path))
    requests = [serve(a, p) for p in batch[:2]]
    a.manager.close()
    b = engine(copy.deepcopy(model), **tiered(tmp_path))
    requests += [serve(b, p) for p in batch[2:]]
    assert [r.cached_tokens for r in requests] == [0, 0, 36, 36, 36]
    check_parity(model_type, ref, batch, requests)


@pytest.mark.parametrize("model_type", ["lfm2", "qwen3_5_text"])
def test_a_checkpoint_the_device_evicted_comes_back_from_host_rows(model_type: str) -> None:
    """One batch slot and no checkpoint row: a finished conversation's state is evicted from the device by the
    next conversation, but its copy in host rows serves the conversation's next turn."""
    model = build_state_model(model_type, seed=33)
    ref = copy.deepcopy(model)
    e = engine(model, max_batch_size=1, max_state_checkpoints=0, kv_connector="local", host_kvcache_swap_space_gb=0.01)
    assert e.summary["state_rows"] == 1
    one, two = tokens(13, 3), tokens(11, 4)
    first = [serve(e, one), serve(e, two)]  # the second takes the only row: the first's checkpoint leaves the device
    assert e.manager.num_state_checkpoints() == 1
    again = one + first[0].output + tokens(3, 5)
    second = serve(e, again)
    assert [r.cached_tokens for r in (*first, second)] == [0, 0, 13 + NEW - 1]
    assert e.manager.tier_stats()["host_states"]["pages_loaded"] == 1
    check_parity(model_type, ref, [one, two, again], [*first, second])


@pytest.mark.parametrize("model_type", MODELS)
def test_engines_share_checkpoints_through_redis(model_type: str, tmp_path: Path) -> None:
    model = build_state_model(model_type, seed=34)
    ref = copy.deepcopy(model)
    with RedisServer.running(tmp_path) as server:
        config = KVConnectorConfig(model_id="state-tiers", redis_url=server.url, redis_key_prefix="t:")
        kw: dict[str, Any] = dict(kv_connector="redis", kv_connector_config=config)
        a, b = engine(copy.deepcopy(model), **kw), engine(copy.deepcopy(model), **kw)
        prompt = tokens(23, 6)
        first = serve(a, prompt)
        a.manager.sync_tiers()
        turn = prompt + first.output + tokens(6, 7)
        second = serve(b, turn)
        assert second.cached_tokens == 23 + NEW - 1
        assert b.manager.tier_stats()["redis_states"]["pages_loaded"] == 1
        server.stop()  # a dead server: misses, never an error
        third = serve(engine(copy.deepcopy(model), **kw), turn)
        assert third.cached_tokens == 0
        a.manager.close()
        b.manager.close()
    check_parity(model_type, ref, [prompt, turn, turn], [first, second, third])


@pytest.mark.parametrize("model_type", MODELS)
def test_preemption_with_tiers_resumes_at_parity(model_type: str, tmp_path: Path) -> None:
    """13 pages admit three prompts but not their growth: the newest is preempted after two decode steps and
    resumes from the checkpoint its release saved (also written below); a fresh engine then serves the same
    prompt again from disk alone, at the same position."""
    model = build_state_model(model_type, seed=35)
    ref = copy.deepcopy(model)
    batch = [tokens(n, 40 + n) for n in (7, 10, 22)]
    e = engine(copy.deepcopy(model), num_pages=13, **tiered(tmp_path))
    requests = [e.add_request(p, NEW, stop_token_ids=[]) for p in batch]
    e.run()
    assert e.summary["preemptions"] == 1 and requests[2].preemptions == 1
    assert [r.cached_tokens for r in requests] == [0, 0, 24]
    e.manager.close()
    again = batch[2] + requests[2].output + tokens(2, 9)
    fresh = engine(copy.deepcopy(model), **tiered(tmp_path))
    requests.append(serve(fresh, again))
    fresh.manager.close()
    assert requests[-1].cached_tokens == 22 + NEW - 1
    check_parity(model_type, ref, [*batch, again], requests)
