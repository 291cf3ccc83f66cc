"""`LLMEngine.update_weights` (an RL loop pushing new weights) and per-tenant `cache_salt`, with a disk tier.

After an update no page computed with the old weights is served, from the device or the tier, and
no `reset_prefix_cache` is called: every output equals transformers' own greedy decode with the new
weights. Requests caught running by the update are recomputed with the new weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from hf_models import build, hf_greedy
from pagedkv.engine import LLMEngine
from pagedkv.params.connector import KVConnectorConfig

PROMPTS = [list(range(3, 40)), list(range(3, 33)) + [50, 51, 52], [60, 61, 62, 63, 64, 65, 66, 67, 68, 69]]
NEW = 5


def _engine(tmp_path: Path, **kwargs: Any) -> LLMEngine:
    config = KVConnectorConfig(disk_offload_dir=str(tmp_path / "disk"))
    return LLMEngine.from_hf(build("llama", seed=0), page_size=4, num_pages=64, kv_connector="tiered",
                             kv_connector_config=config, host_kvcache_swap_space_gb=0.001, **kwargs)  # fmt: skip


def _reference(seed: int) -> list[list[int]]:
    model = build("llama", seed=seed)
    return [hf_greedy(model, p, NEW)[0] for p in PROMPTS]


def _forget_device(engine: LLMEngine) -> None:
    for bm in engine.manager._managers:
        bm.reset_prefix_cache()  # the device forgets: a hit could only come from the host or disk tier


def test_after_an_update_outputs_are_the_new_weights_and_no_old_page_is_served(tmp_path: Path) -> None:
    engine = _engine(tmp_path)
    old, new = _reference(0), _reference(1)
    assert old != new
    assert engine.generate(PROMPTS, NEW) == old
    engine.manager.sync_tiers()
    assert engine.generate(PROMPTS, NEW) == old and engine.summary["prompt_tokens_cached"] > 0  # warm, as usual
    assert engine.update_weights(build("llama", seed=1).state_dict(), "step-1") == 0  # nothing was running
    cached, loaded = engine.summary["prompt_tokens_cached"], engine.manager.tier_stats()["host"]["pages_loaded"]
    assert engine.generate(PROMPTS, NEW) == new
    fresh = _engine(tmp_path / "fresh")  # the hits the new weights' own pages give within one run (same step)
    fresh.update_weights(build("llama", seed=1).state_dict(), "step-1")
    assert fresh.generate(PROMPTS, NEW) == new
    same_run = fresh.summary["prompt_tokens_cached"]
    fresh.manager.close()
    assert engine.summary["prompt_tokens_cached"] == cached + same_run  # not one hit on the old weights' pages
    assert engine.manager.tier_stats()["host"]["pages_loaded"] == loaded
    engine.manager.sync_tiers()
    _forget_device(engine)
    assert engine.generate(PROMPTS, NEW) == new and engine.summary["prompt_tokens_cached"] > cached  # new pages hit
    assert engine.manager.get_num_used_pages() == 0
    engine.manager.check_integrity()
    engine.manager.close()


def test_requests_running_at_the_update_are_recomputed(tmp_path: Path) -> None:
    engine = _engine(tmp_path)
    requests = [engine.add_request(p, NEW) for p in PROMPTS]
    engine.step()
    engine.step()  # every prompt is being prefilled or decoded with the old weights
    running = len(engine.scheduler.running)
    assert running == 3
    sampled = [list(r.output) for r in requests]  # tokens sampled under the old weights
    assert [len(x) for x in sampled] == [2, 2, 2]
    assert engine.update_weights(build("llama", seed=1).state_dict(), "step-1") == running
    assert engine.manager.get_num_used_pages() == 0  # their old-weights pages were all released
    engine.run()
    model = build("llama", seed=1)
    for r, before, prompt in zip(requests, sampled, PROMPTS, strict=True):
        # the old tokens stay (as prompt); everything after them is the new weights' greedy continuation
        assert r.output[:2] == before
        assert r.output[2:] == hf_greedy(model, prompt + before, NEW - 2)[0]
    engine.manager.close()


def test_a_mismatched_state_dict_changes_nothing(tmp_path: Path) -> None:
    engine = _engine(tmp_path, weights_version="v0")
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    weights = build("llama", seed=1).state_dict()
    missing = dict(weights)
    missing.pop(next(iter(missing)))
    wrong = dict(weights)
    name = next(k for k in wrong if k.endswith("q_proj.weight"))
    wrong[name] = torch.zeros(3, 3)
    for bad, match in [(missing, "missing"), ({**weights, "extra.weight": torch.zeros(1)}, "unexpected"),
                       (wrong, "wrong shape")]:  # fmt: skip
        with pytest.raises(ValueError, match=f"weights do not match the model: .*{match}"):
            engine.update_weights(bad, "v1")
    for bad_version, err in [("", ValueError), (3, TypeError)]:
        with pytest.raises(err, match="version"):
            engine.update_weights(weights, bad_version)  # type: ignore[arg-type]
    assert engine.manager.weights_version == "v0"
    assert all(torch.equal(before[k], v) for k, v in engine.model.state_dict().items())
    engine.manager.close()


def test_cache_salt_separates_tenants_in_the_engine(tmp_path: Path) -> None:
    engine = _engine(tmp_path)
    ref = _reference(0)
    assert engine.generate(PROMPTS[:1], NEW, cache_salt="tenant-a") == ref[:1]
    engine.manager.sync_tiers()
    _forget_device(engine)
    cached = engine.summary["prompt_tokens_cached"]
    assert engine.generate(PROMPTS[:1], NEW, cache_salt="tenant-b") == ref[:1]
    assert engine.summary["prompt_tokens_cached"] == cached  # B: no hit, on device or tier
    engine.manager.sync_tiers()
    _forget_device(engine)
    assert engine.generate(PROMPTS[:1], NEW, cache_salt="tenant-a") == ref[:1]
    assert engine.summary["prompt_tokens_cached"] == cached + 36  # A: its 9 full pages, from the tier
    engine.manager.close()
