"""Random workloads on state models: prompt lengths, token budgets, pool sizes and preemption modes drawn
by hypothesis; every request's tokens and logits must equal one full forward of transformers.

Each example serves 2-6 prompts of 1-40 tokens (after a shared prefix of 0-23 tokens, so state checkpoints
hit) with 1-12 new tokens, a token budget of 1-24 per step, the smallest pool any one request fits plus 0-4
pages (mostly none, so requests are preempted and resume from their checkpoints), prefix caching on or off,
adding half of the requests after a few steps (continuous batching). At the end only checkpoints' tails hold
pages, and none once the prefix cache is reset. `PAGEDKV_FUZZ_EXAMPLES` sets the number of examples per model
type (default 6).
"""

from __future__ import annotations

import copy
import os
from functools import cache

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from state_models import build_state_model

from pagedkv.core.groups import manager_for, min_request_pages
from pagedkv.engine import LLMEngine
from pagedkv.hf.config import kv_layout

EXAMPLES = int(os.environ.get("PAGEDKV_FUZZ_EXAMPLES", "6"))
TOLERANCE = 1e-3


@cache
def _model(model_type: str) -> torch.nn.Module:
    return build_state_model(model_type, seed=7)


def _reference(model: torch.nn.Module, prompt: list[int], output: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt + output[:-1]]), use_cache=False).logits[0].float()  # [L, V]
    return logits[len(prompt) - 1 :]  # [N, V]


workload = st.fixed_dictionaries({
    "prompts": st.lists(st.lists(st.integers(3, 127), min_size=1, max_size=40), min_size=2, max_size=6),
    "new_tokens": st.lists(st.integers(1, 12), min_size=6, max_size=6),
    "budget": st.integers(1, 24),
    "slack": st.sampled_from([0, 0, 0, 1, 4]),
    "caching": st.booleans(),
    "shared": st.lists(st.integers(3, 127), max_size=23),
    "late": st.integers(0, 4),
})  # fmt: skip


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "bamba", "lfm2", "jamba"])
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(w=workload)
def test_random_workloads_match_one_full_forward(model_type: str, w: dict) -> None:
    ref = _model(model_type)
    model = copy.deepcopy(ref)
    prompts, new = [w["shared"] + p for p in w["prompts"]], w["new_tokens"][: len(w["prompts"])]
    leaves = kv_layout(model.config, model=model, page_size=4).params.leaves()
    groups = [manager_for(g, leaf.kv_cache_spec) for g, leaf in enumerate(leaves)]
    pages = max(
        max(min_request_pages(groups, len(p), n), min_request_pages(groups, len(p) + n - 1, 1))
        for p, n in zip(prompts, new, strict=True)
    )
    engine = LLMEngine.from_hf(model, page_size=4, num_pages=pages + w["slack"], max_num_batched_tokens=w["budget"],
                               record_logits=True, enable_prefix_caching=w["caching"])  # fmt: skip
    half = len(prompts) // 2
    requests = [engine.add_request(p, n, stop_token_ids=[]) for p, n in zip(prompts[:half], new[:half], strict=True)]
    for _ in range(w["late"]):
        engine.step()
    requests += [engine.add_request(p, n, stop_token_ids=[]) for p, n in zip(prompts[half:], new[half:], strict=True)]
    engine.run()
    for prompt, request in zip(prompts, requests, strict=True):
        expected = _reference(ref, prompt, request.output)  # [N, V]
        assert request.output == expected.argmax(-1).tolist()
        assert float((torch.stack(request.logits) - expected).abs().max()) <= TOLERANCE
    states = engine.manager._managers[0].states
    assert engine.manager._managers[0].pool.num_used == len(states.tail_refs())  # only checkpoints hold pages
    assert engine.manager.num_free_blocks() == engine.manager.total_num_pages and engine.summary["used_pages"] == 0
    engine.manager.reset_prefix_cache()
    assert engine.manager.num_free_blocks() == engine.manager.total_num_pages and len(states) == 0
