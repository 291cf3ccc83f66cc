"""Mixed-attention models on pagedkv equal transformers' own generate(): tokens, and logits within 1e-4.

Windows and chunks are 8 tokens and prompts are 20-40 tokens, so every layer
type drops pages during the run; prompts share a prefix (prefix caching has
to find a hit valid for every group), and the tight pool evicts and preempts.
"""

from __future__ import annotations

import functools

import pytest
import torch

from hf_models import build, hf_greedy
from pagedkv.engine import LLMEngine

NEW_TOKENS = 10
ARCHS = ["mistral", "gemma2", "gemma3", "gpt_oss", "llama4"]
# (page_size, num_pages, expect preemption)
CONFIGS = [(4, 120, False), (1, 400, False), (4, 16, True)]


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    shared = torch.randint(3, 256, (19,), generator=g).tolist()
    tails = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (4, 13, 1, 21)]
    return [shared + t for t in tails] + [torch.randint(3, 256, (26,), generator=g).tolist()]


@functools.cache
def reference(arch: str) -> tuple[tuple[list[int], list[torch.Tensor]], ...]:
    model = build(arch)
    return tuple(hf_greedy(model, p, NEW_TOKENS) for p in prompts())


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("page_size,num_pages,preempts", CONFIGS)
def test_hybrid_engine_matches_transformers(arch: str, page_size: int, num_pages: int, preempts: bool) -> None:
    engine = LLMEngine.from_hf(
        build(arch), page_size=page_size, num_pages=num_pages, max_batch_size=8, max_num_batched_tokens=32,
        record_logits=True,
    )  # fmt: skip
    requests = [engine.add_request(p, NEW_TOKENS) for p in prompts()]
    engine.run()
    for i, (request, (tokens, logits)) in enumerate(zip(requests, reference(arch), strict=True)):
        assert request.output == tokens, f"{arch} prompt {i}: engine {request.output} != transformers {tokens}"
        diff = max(float((a - b).abs().max()) for a, b in zip(request.logits, logits, strict=True))
        assert diff < 1e-4, f"{arch} prompt {i}: logits differ by {diff}"
    summary = engine.summary
    assert (summary["preemptions"] > 0) == preempts, summary
    assert summary["prompt_tokens_cached"] > 0, summary
    assert summary["used_pages"] == 0
    engine.manager.check_integrity()


def test_windowed_groups_hold_fewer_pages() -> None:
    """Mid-run, a request's sliding group holds only its window's pages; the full group holds all."""
    engine = LLMEngine.from_hf(build("gemma2"), page_size=4, num_pages=120)
    request = engine.add_request(list(range(3, 43)), 8)  # 40 tokens, window 8
    while len(request.output) < 4:
        engine.step()
    kinds = [leaf.attention_kind for leaf in engine.manager.params.leaves()]
    tables = [engine.manager.get_req_blocks(request.request_id, group=g) for g in range(len(kinds))]
    null = engine.manager.total_num_blocks()
    held = {kind: sum(p != null for p in table) for kind, table in zip(kinds, tables, strict=True)}
    assert held["full"] == 11 and held["sliding"] <= 3, held  # 43 tokens: 11 pages vs. the 8-token window
