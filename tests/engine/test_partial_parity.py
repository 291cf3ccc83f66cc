"""Partial-page reuse inside `LLMEngine`: a prompt sharing a non-page-aligned prefix with a finished one skips
exactly the shared tokens, and still equals transformers' greedy generate() (tokens, logits within 1e-4, fp32):
on a Llama (one full-attention group) and on a Gemma 2 (full and sliding-window groups over one pool, whose
partial hits copy the page in both groups)."""

from __future__ import annotations

import functools

import pytest
import torch

from hf_models import build, hf_greedy
from pagedkv.engine import LLMEngine

NEW_TOKENS = 8
SHARED = 37  # of 45 prompt tokens: not a multiple of 16 or 4


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    shared = torch.randint(3, 256, (SHARED,), generator=g).tolist()
    tails = [torch.randint(3, 256, (8,), generator=g).tolist() for _ in range(2)]
    assert tails[0][0] != tails[1][0]
    return [shared + tails[0], shared + tails[1], shared[:30]]  # the third lies inside the first's pages


@functools.cache
def reference(name: str) -> tuple[tuple[list[int], list[torch.Tensor]], ...]:
    model = build(name)
    return tuple(hf_greedy(model, p, NEW_TOKENS) for p in prompts())


@pytest.mark.parametrize("page_size,aligned", [(16, 32), (4, 36)])
@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_partial_reuse_matches_transformers(name: str, page_size: int, aligned: int) -> None:
    engine = LLMEngine.from_hf(
        build(name), page_size=page_size, num_pages=256 // page_size, enable_prefix_caching=True,
        enable_partial_page_reuse=True, max_batch_size=4, max_num_batched_tokens=64, record_logits=True,
    )  # fmt: skip
    requests = []
    for prompt in prompts():  # one at a time: each finds the pages of the ones before committed
        requests.append(engine.add_request(prompt, NEW_TOKENS))
        engine.run()
    cached = [r.cached_tokens for r in requests]
    assert cached == [0, SHARED, 29] and aligned < SHARED  # without partial reuse: [0, aligned, 29 // ps * ps]
    for i, (request, (tokens, logits)) in enumerate(zip(requests, reference(name), strict=True)):
        assert request.output == tokens, f"prompt {i}: engine {request.output} != transformers {tokens}"
        diff = max(float((a - b).abs().max()) for a, b in zip(request.logits, logits, strict=True))
        assert diff < 1e-4, f"prompt {i}: logits differ by {diff}"
    summary = engine.summary
    assert summary["prompt_tokens_cached"] == SHARED + 29 and summary["used_pages"] == 0
    assert engine.manager.check_integrity() is None
