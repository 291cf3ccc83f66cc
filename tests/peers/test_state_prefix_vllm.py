"""`python -m benchmarks.compare.state_prefix` with vLLM's hybrid peer: same model, same bytes (runs in `.venv-peers`).

Skips where vLLM does not import, fails instead under PAGEDKV_REQUIRE_PEERS=1 (as the other peer tests)."""

from __future__ import annotations

import os

import pytest

from benchmarks.compare.pagedkv_hybrid import gdn_spec, hybrid_params
from benchmarks.compare.peer_vllm_hybrid import VllmHybridAdapter
from benchmarks.compare.peers import PeerUnavailable
from benchmarks.compare.state_prefix import format_markdown, run_state_prefix
from pagedkv.core.memory import state_row_bytes

BLOCK_BYTES = 8 * 528 * 4096  # vLLM's block: the 528-token unified page x 8 layers per group slot


def _require_vllm() -> None:
    try:
        VllmHybridAdapter.bytes_per_block()
    except PeerUnavailable as exc:
        if os.environ.get("PAGEDKV_REQUIRE_PEERS") == "1":
            pytest.fail(f"{exc}, and PAGEDKV_REQUIRE_PEERS=1")
        pytest.skip(str(exc))


def test_pagedkv_states_are_vllms_states() -> None:
    """pagedkv's GDN layer state is vLLM's (conv + recurrent, 2,146,304 B); a row holds 24 of them, as vLLM's 3
    state blocks per request do (each 8 layers, padded to the 528-token page)."""
    _require_vllm()
    plan = VllmHybridAdapter.from_bytes(10 * BLOCK_BYTES).plan
    assert gdn_spec().page_size_bytes == plan.mamba_state_bytes == 2_146_304
    assert state_row_bytes(hybrid_params()) == 24 * plan.mamba_state_bytes
    assert 3 * plan.bytes_per_block == 3 * BLOCK_BYTES > state_row_bytes(hybrid_params())


def test_the_sweep_runs_vllm_at_the_same_bytes() -> None:
    _require_vllm()
    result = run_state_prefix(["docqa"], 16, fractions=[1.0], checkpoint_multiples=[2], max_num_seqs=4)
    assert not result["skipped"] and result["bytes"]["vllm_block"] == BLOCK_BYTES
    (peer,) = [r for r in result["rows"] if r["manager"] == "vllm-hybrid"]
    assert peer["pages"] == peer["budget_bytes"] // BLOCK_BYTES - 1 and peer["block_tokens"] == 528
    (ceiling,) = [r for r in result["rows"] if r["manager"] == "ceiling"]
    assert 0 < peer["hit_rate"] <= ceiling["hit_rate"]  # 528-token blocks never beat 16-token pages here
    assert "vllm-hybrid" in format_markdown(result) and "Above vLLM in every cell" in format_markdown(result)
