"""Preemption by swap of a hybrid model (gemma2: full and sliding-window groups over one pool): a swapped
request comes back with its tables rebuilt entry for entry, the committed prefix pages every group still
caches on device reused and the rest copied back, and generates what transformers' greedy generate() does."""

from __future__ import annotations

import torch

from hf_models import build, hf_greedy
from pagedkv.engine import LLMEngine

NEW_TOKENS = 24


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(3, 256, (20,), generator=g).tolist()
    return [shared + torch.randint(3, 256, (int(n),), generator=g).tolist() for n in (14, 30, 9, 22, 17, 26)]


def test_hybrid_swap_resumes_as_transformers_generates() -> None:
    reference = [hf_greedy(build("gemma2"), p, NEW_TOKENS) for p in prompts()]
    engine = LLMEngine.from_hf(
        build("gemma2"), page_size=8, num_pages=24, enable_prefix_caching=True, kv_connector="local",
        host_kvcache_swap_space_gb=0.01, total_num_host_pages=64, max_batch_size=6, max_num_batched_tokens=128,
        record_logits=True,
    )  # fmt: skip
    assert engine.preemption_mode == "swap"
    requests = [engine.add_request(p, NEW_TOKENS) for p in prompts()]
    engine.run()
    summary, host = engine.summary, engine.manager.tier_stats()["host"]
    assert summary["swaps"] > 0 and summary["swaps"] == summary["preemptions"]
    assert 0 < host["pages_swapped_in"] < host["pages_swapped_out"]  # some swapped pages were reused on device
    assert engine.manager.tiers.swap_spaces[0].rows_lent == 0
    for i, (request, (tokens, logits)) in enumerate(zip(requests, reference, strict=True)):
        assert request.output == tokens, f"prompt {i}: engine {request.output} != transformers {tokens}"
        diff = max(float((a - b).abs().max()) for a, b in zip(request.logits, logits, strict=True))
        assert diff < 1e-4, f"prompt {i}: logits differ by {diff}"
    assert engine.manager.check_integrity() is None and engine.summary["used_pages"] == 0
