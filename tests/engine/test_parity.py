"""Engine outputs equal transformers' own greedy generate(), token for token, logits within 1e-4 (fp32).

Prompts share prefixes (so cached pages are reused) and are not page-aligned;
the engine runs with prefix caching on and off, page sizes 1 and 16, and in
one configuration a pool small enough to force preemption.
"""

from __future__ import annotations

import functools

import pytest
import torch

from hf_models import build, hf_greedy
from pagedkv.engine import LLMEngine

NEW_TOKENS = 12
# (page_size, num_pages, prefix caching, expect preemption)
CONFIGS = [
    (16, 64, True, False),
    (16, 64, False, False),
    (1, 400, True, False),
    (16, 8, True, True),
    (1, 90, False, True),
]


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    shared = torch.randint(3, 256, (21,), generator=g).tolist()
    tails = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (5, 11, 2, 17, 9)]
    return [shared + t for t in tails] + [shared[:10] + tails[0], torch.randint(3, 256, (30,), generator=g).tolist()]


@functools.cache
def reference(arch: str) -> tuple[tuple[list[int], list[torch.Tensor]], ...]:
    model = build(arch)
    return tuple(hf_greedy(model, p, NEW_TOKENS) for p in prompts())


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("page_size,num_pages,caching,preempts", CONFIGS)
def test_engine_matches_transformers(arch: str, page_size: int, num_pages: int, caching: bool, preempts: bool) -> None:
    engine = LLMEngine.from_hf(
        build(arch), page_size=page_size, num_pages=num_pages, enable_prefix_caching=caching, max_batch_size=8,
        max_num_batched_tokens=48, record_logits=True,
    )  # fmt: skip
    requests = [engine.add_request(p, NEW_TOKENS) for p in prompts()]
    engine.run()
    for i, (request, (tokens, logits)) in enumerate(zip(requests, reference(arch), strict=True)):
        assert request.output == tokens, f"prompt {i}: engine {request.output} != transformers {tokens}"
        diff = max(float((a - b).abs().max()) for a, b in zip(request.logits, logits, strict=True))
        assert diff < 1e-4, f"prompt {i}: logits differ by {diff}"
    summary = engine.summary
    assert (summary["preemptions"] > 0) == preempts, summary
    assert (summary["prompt_tokens_cached"] > 0) == caching, summary  # shared prefixes really were reused
    assert summary["used_pages"] == 0 and engine.manager.check_integrity() is None
