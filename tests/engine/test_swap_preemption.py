"""Preemption by swap: the engine parks a preempted request's pages in the host tier and resumes it
where it stopped, with the KV bytes it had, and computes no token twice.

(Logits are compared to a run that never preempted with a tolerance: that run batches requests
differently, and CPU matmuls round differently for different batch shapes, in either mode.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedkv.engine import LLMEngine
from pagedkv.testing import build_demo_model

HOST = dict(kv_connector="local", host_kvcache_swap_space_gb=0.01, total_num_host_pages=64)


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(3, 500, size=int(rng.integers(20, 60))).tolist() for _ in range(8)]


def kv_bytes(engine: LLMEngine, request_id: object) -> list[bytes]:
    """The bytes of the request's pages in every unit, in logical order."""
    units = engine.manager.tiers.connectors[0].mover.units
    return [u.buffer[p].numpy().tobytes() for p in engine.manager.get_req_blocks(request_id) for u in units]


def spy_on_swaps(engine: LLMEngine) -> list[tuple[object, bool]]:
    """Record, per swap-in, whether the request's KV equals its KV at swap-out (wraps the manager)."""
    manager, parked, seen = engine.manager, {}, []
    swap_out, swap_in = manager.swap_out, manager.swap_in

    def out(request_id: object, replica_idx: int = 0) -> bool:
        before = kv_bytes(engine, request_id)
        done = swap_out(request_id, replica_idx)
        if done:
            parked[request_id] = before
        return done

    def back(ctx, replica_idx: int = 0) -> None:
        swap_in(ctx, replica_idx)
        seen.append((ctx.request_id, kv_bytes(engine, ctx.request_id) == parked.pop(ctx.request_id)))

    manager.swap_out, manager.swap_in = out, back  # type: ignore[method-assign]
    return seen


def serve(num_pages: int, spy: list | None = None, **kwargs: object) -> tuple[LLMEngine, list]:
    engine = LLMEngine.from_hf(build_demo_model(), page_size=8, num_pages=num_pages, record_logits=True,
                               max_num_batched_tokens=128, **kwargs)  # fmt: skip
    if spy is not None:
        spy.append(spy_on_swaps(engine))
    requests = [engine.add_request(p, 40) for p in prompts()]
    engine.run()
    engine.manager.check_integrity()
    return engine, requests


def test_swap_resumes_bit_exactly_without_recomputing() -> None:
    _, reference = serve(256)  # room for everything: no preemption
    spy: list = []
    engine, swapped = serve(40, spy, **HOST)  # 8 requests of up to 99 tokens in 40 pages of 8
    [resumed] = spy
    assert len(resumed) >= engine.summary["swaps"] and all(same for _, same in resumed)
    summary = engine.summary
    assert engine.preemption_mode == "swap"
    assert summary["swaps"] == summary["preemptions"] > 0
    assert summary["prefill_tokens_computed"] == sum(len(p) for p in prompts())  # nothing computed twice
    host = engine.manager.tier_stats()["host"]
    assert host["pages_swapped_out"] > 0 and host["pages_swapped_in"] <= host["pages_swapped_out"]
    assert engine.manager.tiers.swap_spaces[0].rows_lent == 0
    for ref, got in zip(reference, swapped, strict=True):
        assert got.output == ref.output
        torch.testing.assert_close(torch.stack(got.logits), torch.stack(ref.logits), rtol=0, atol=1e-4)


def test_recompute_mode_and_validation() -> None:
    engine, requests = serve(40, preemption_mode="recompute", **HOST)
    assert engine.summary["swaps"] == 0 and engine.summary["preemptions"] > 0
    _, reference = serve(256)
    assert [r.output for r in requests] == [r.output for r in reference]
    with pytest.raises(ValueError, match="preemption_mode='swap' needs a host tier"):
        LLMEngine.from_hf(build_demo_model(), page_size=8, num_pages=16, preemption_mode="swap")
    with pytest.raises(ValueError, match="preemption_mode='later' must be 'swap' or 'recompute'"):
        LLMEngine.from_hf(build_demo_model(), page_size=8, num_pages=16, preemption_mode="later")
