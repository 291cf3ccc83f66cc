"""LLMEngine behaviour beyond parity: sampling, scheduling, errors, statistics."""

from __future__ import annotations

import pytest
import torch

from hf_models import build
from pagedkv.core.errors import InsufficientBlocksError
from pagedkv.engine import LLMEngine, SamplingParams
from pagedkv.hf import ForwardContext, kv_params_from_config


def engine(**kwargs) -> LLMEngine:
    kwargs.setdefault("num_pages", 64)
    return LLMEngine.from_hf(build("llama"), page_size=4, **kwargs)


PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [5, 6, 7, 8, 20], [30, 31]]


def test_seeded_sampling_is_reproducible_and_batch_independent() -> None:
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=123)
    together = engine().generate(PROMPTS, 10, sampling=params)
    again = engine().generate(PROMPTS, 10, sampling=params)
    alone = engine().generate(PROMPTS[:1], 10, sampling=params)
    assert together == again and together[0] == alone[0]
    assert together != engine().generate(PROMPTS, 10, sampling=SamplingParams(temperature=0.8, seed=124))
    assert together != engine().generate(PROMPTS, 10)  # not greedy


def test_top_p_tiny_is_greedy() -> None:
    greedy = engine().generate(PROMPTS, 8)
    nucleus = engine().generate(PROMPTS, 8, sampling=SamplingParams(temperature=1.0, top_p=1e-6, seed=0))
    assert nucleus == greedy


def test_stop_tokens_end_a_request_and_are_kept() -> None:
    free = engine().generate(PROMPTS[:1], 10)[0]
    stop = free[3]
    out = engine().generate(PROMPTS[:1], 10, stop_token_ids=[stop])[0]
    assert out == free[: free.index(stop) + 1]


def test_chunked_prefill_with_a_tiny_budget_gives_the_same_tokens() -> None:
    wide = engine(max_num_batched_tokens=512).generate(PROMPTS, 6)
    narrow = engine(max_num_batched_tokens=3).generate(PROMPTS, 6)
    assert narrow == wide


def test_errors() -> None:
    with pytest.raises(ValueError, match="give exactly one of num_pages or memory_budget"):
        LLMEngine.from_hf(build("llama"), num_pages=8, memory_budget=10**6)
    import transformers

    config = transformers.FalconMambaConfig(num_hidden_layers=1, hidden_size=32, vocab_size=64, state_size=4)
    with pytest.raises(ValueError, match="model_type='falcon_mamba' cannot run on pagedkv: it has neither attention"):
        LLMEngine.from_hf(transformers.FalconMambaForCausalLM(config), num_pages=8)  # a mixer no adapter serves
    eng = engine(num_pages=2)
    with pytest.raises(ValueError, match="max_new_tokens=0 must be at least 1"):
        eng.add_request([1, 2], 0)
    with pytest.raises(InsufficientBlocksError, match="the whole cache holds 8"):
        eng.add_request(list(range(3, 20)), 4)  # 17 tokens never fit in 2 pages of 4: refused, not queued
    assert not eng.has_unfinished()


def test_model_refuses_a_plain_forward_once_switched() -> None:
    eng = engine()
    with pytest.raises(ValueError, match=r"needs model\(..., pagedkv=ForwardContext"):
        eng.model(torch.tensor([[1, 2, 3]]))
    assert ForwardContext.__name__ == "ForwardContext"


def test_memory_budget_and_params_from_config() -> None:
    model = build("qwen3")
    params = kv_params_from_config(model.config, page_size=8)
    assert (params.n_kv_heads, params.head_dim, params.num_layers, params.num_q_heads) == (2, 16, 2, 4)
    eng = LLMEngine.from_hf(model, page_size=8, memory_budget=params.bytes_per_block * 10 + 3)
    assert eng.manager.total_num_blocks() == 10


def test_statistics_count_cached_prompt_tokens() -> None:
    eng = engine()
    eng.generate([list(range(3, 23))], 2)  # 20 prompt tokens: pages 0-4 committed after the prefill
    eng.generate([list(range(3, 23)) + [99]], 2)
    s = eng.summary
    assert s["prompt_tokens"] == 41 and s["prompt_tokens_cached"] == 20 and s["prefill_tokens_computed"] == 21
    assert s["used_pages"] == 0 and s["generated_tokens"] == 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sample_batch_draws_what_sample_draws_row_by_row(dtype: torch.dtype) -> None:
    """Greedy rows take one argmax over the batch (ties: the first maximum, as `sample`), seeded rows draw
    what `sample` draws with the same generator state, inactive rows give None."""
    from pagedkv.engine.sampling import sample, sample_batch

    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0)).to(dtype)  # [B, V]
    logits[1, 7] = logits[1, 31] = logits[1].max() + 1  # a tie: the first index wins
    logits[5, 3] = logits[5, 9] = float("nan")  # NaN counts as the maximum, the first one wins (as argmax)
    greedy, hot = SamplingParams(), SamplingParams(temperature=0.9, top_k=5, seed=4)
    params = [greedy, greedy, hot, greedy, hot, greedy]
    active = [True, True, True, False, True, True]
    got = sample_batch(logits, params, [torch.Generator().manual_seed(i) for i in range(6)], active)
    want = [sample(logits[i].float(), p, torch.Generator().manual_seed(i)) if on else None
            for i, (p, on) in enumerate(zip(params, active, strict=True))]  # fmt: skip
    assert got == want and got[1] == 7 and got[3] is None and got[5] == 3
    assert sample_batch(logits, [greedy] * 6, [None] * 6, [True] * 6) == logits.float().argmax(-1).tolist()
