"""`commit_on_alloc` inside `LLMEngine`: requests admitted in the same step share the pages the first one
is still prefilling (vLLM's schedule-time caching), and still equal transformers' greedy generate()."""

from __future__ import annotations

import functools

import pytest
import torch

from hf_models import build, hf_greedy
from pagedkv.engine import LLMEngine

NEW_TOKENS = 6
SHARED = 37


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(3, 256, (SHARED,), generator=g).tolist()
    return [shared + torch.randint(3, 256, (8,), generator=g).tolist() for _ in range(3)]


@functools.cache
def reference(name: str) -> tuple[tuple[list[int], list[torch.Tensor]], ...]:
    model = build(name)
    return tuple(hf_greedy(model, p, NEW_TOKENS) for p in prompts())


@pytest.mark.parametrize(("commit_on_alloc", "budget", "cached"), [
    (True, 256, [0, 32, 32]),  # all three admitted in step 1: the 2 full shared pages are hit at once
    (True, 64, [0, 32, 32]),  # the second gets a 19-token chunk in step 1, the third is admitted in step 2
    (False, 256, [0, 0, 0]),  # pages become hittable only at step: nothing is shared in step 1
    (False, 64, [0, 0, 32]),  # ... so only the request admitted in step 2 hits
])  # fmt: skip
@pytest.mark.parametrize("name", ["llama", "gemma2"])  # gemma2: full and sliding-window groups over one pool
def test_same_step_sharing_matches_transformers(
    name: str, commit_on_alloc: bool, budget: int, cached: list[int]
) -> None:
    engine = LLMEngine.from_hf(
        build(name), page_size=16, num_pages=32, enable_prefix_caching=True, commit_on_alloc=commit_on_alloc,
        max_batch_size=4, max_num_batched_tokens=budget, record_logits=True,
    )  # fmt: skip
    requests = [engine.add_request(p, NEW_TOKENS) for p in prompts()]
    engine.run()
    assert [r.cached_tokens for r in requests] == cached
    for i, (request, (tokens, logits)) in enumerate(zip(requests, reference(name), strict=True)):
        assert request.output == tokens, f"prompt {i}: engine {request.output} != transformers {tokens}"
        diff = max(float((a - b).abs().max()) for a, b in zip(request.logits, logits, strict=True))
        assert diff < 1e-4, f"prompt {i}: logits differ by {diff}"
    assert engine.manager.check_integrity() is None and engine.summary["used_pages"] == 0
