"""Position-dependent models on pagedkv equal transformers' generate() per request, whatever shares the step.

Llama 4's attention temperature tuning (NoPE layers, scale from each token's position
over ``floor_scale``) and dynamic RoPE (frequencies from the sequence length) both read
more than a token's own position in transformers; the engine packs several requests into
one sequence, so each request must still get what transformers' own greedy
``generate()`` gives it alone: tokens equal, logits within 1e-4 (fp32, random weights).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from hf_models import COMMON, hf_greedy
from pagedkv.engine import LLMEngine
from pagedkv.hf.context import ForwardContext
from pagedkv.hf.positions import temperature_correction

NEW_TOKENS = 8
LLAMA4 = dict(
    head_dim=16, attention_chunk_size=8, no_rope_layer_interval=2, num_local_experts=2, intermediate_size_mlp=128,
    attn_temperature_tuning=True, attn_scale=0.5,
)  # fmt: skip


def _build(config_cls: Any, model_cls: Any, attn: str = "eager", **extra: Any) -> Any:
    config = config_cls(**{**COMMON, **extra})
    torch.manual_seed(0)
    model = model_cls._from_config(copy.deepcopy(config), attn_implementation=attn, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    return model.eval()


def llama4(attn: str = "eager", **extra: Any) -> Any:
    import transformers as tf

    return _build(tf.Llama4TextConfig, tf.Llama4ForCausalLM, attn, **{**LLAMA4, **extra})


def dynamic_llama(attn: str = "eager") -> Any:
    """Llama with dynamic NTK RoPE over a 32-token original context (factor 2)."""
    import transformers as tf

    rope = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    return _build(tf.LlamaConfig, tf.LlamaForCausalLM, attn, max_position_embeddings=32, rope_parameters=rope)


def fresh_greedy(model: Any, prompt: list[int], new_tokens: int = NEW_TOKENS) -> tuple[list[int], list[torch.Tensor]]:
    """`hf_greedy` from a fresh rotary state (transformers' dynamic RoPE keeps the last request's frequencies)."""
    for module in model.modules():
        if hasattr(module, "original_inv_freq"):
            module.inv_freq = module.original_inv_freq.clone()
            module.max_seq_len_cached = module.original_max_seq_len
    return hf_greedy(model, prompt, new_tokens)


def random_prompts(lengths: list[int], seed: int = 5) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in lengths]


def run_engine(model: Any, prompts: list[list[int]], **kwargs: Any) -> list[Any]:
    options: dict[str, Any] = dict(page_size=4, num_pages=600, max_batch_size=8, max_num_batched_tokens=48)
    options.update(kwargs)
    engine = LLMEngine.from_hf(model, record_logits=True, **options)
    requests = [engine.add_request(p, NEW_TOKENS) for p in prompts]
    engine.run()
    assert engine.summary["used_pages"] == 0
    return requests


def check(requests: list[Any], references: list[tuple[list[int], list[torch.Tensor]]]) -> float:
    """Tokens equal, logits within 1e-4; returns the worst logit difference."""
    worst = 0.0
    for i, (request, (tokens, logits)) in enumerate(zip(requests, references, strict=True)):
        assert request.output == tokens, f"prompt {i}: engine {request.output} != transformers {tokens}"
        diff = max(float((a - b).abs().max()) for a, b in zip(request.logits, logits, strict=True))
        assert diff < 1e-4, f"prompt {i}: logits differ by {diff}"
        worst = max(worst, diff)
    return worst


def test_temperature_correction_is_the_own_position_scale_over_the_packed_one() -> None:
    config = llama4(floor_scale=4).config
    positions = torch.tensor([0, 3, 4, 9, 40, 2])
    f = lambda p: torch.log1p(torch.floor((p.float() + 1.0) / 4)) * 0.5 + 1.0  # noqa: E731
    expected = f(positions) / f(torch.arange(6))
    assert torch.equal(temperature_correction(config, positions)[:, 0, 0], expected)
    assert temperature_correction(llama4(attn_temperature_tuning=False).config, positions) is None


@pytest.mark.parametrize("floor_scale", [4, 16])
def test_llama4_temperature_tuning_small_floor_scale(floor_scale: int) -> None:
    """Prompts past floor_scale, batched (packed index != position), prefill chunked at 48 tokens."""
    prompts = random_prompts([5, 19, 37, 70, 3, 26])
    reference = llama4(floor_scale=floor_scale)
    expected = [fresh_greedy(reference, p) for p in prompts]
    check(run_engine(llama4(floor_scale=floor_scale), prompts), expected)
    check(run_engine(llama4(floor_scale=floor_scale), prompts[3:4], page_size=16), expected[3:4])


def test_llama4_temperature_tuning_default_floor_scale() -> None:
    """floor_scale 8192 (the default) and a prompt past it, next to a short request, prefill in 2048-token chunks."""
    prompts = random_prompts([8200, 30], seed=9)
    reference = llama4("sdpa", max_position_embeddings=16384, num_hidden_layers=2)
    assert reference.config.floor_scale == 8192
    expected = [fresh_greedy(reference, p, 4) for p in prompts]
    model = llama4(max_position_embeddings=16384, num_hidden_layers=2)
    engine = LLMEngine.from_hf(
        model, page_size=16, num_pages=560, max_batch_size=4, max_num_batched_tokens=2048, record_logits=True
    )
    requests = [engine.add_request(p, 4) for p in prompts]
    engine.run()
    check(requests, expected)


def test_llama4_without_model_config_refuses() -> None:
    """A temperature-tuned layer without the per-token factor raises instead of using packed indices."""
    engine = LLMEngine.from_hf(llama4(floor_scale=4), page_size=4, num_pages=64)
    engine.add_request([5, 6, 7], 2)
    original = ForwardContext.build

    def without_config(*args: Any, **kwargs: Any) -> ForwardContext:
        kwargs.pop("model_config", None)
        return original(*args, **kwargs)

    ForwardContext.build = without_config  # type: ignore[method-assign]
    try:
        with pytest.raises(ValueError, match="model_config"):
            engine.step()
    finally:
        ForwardContext.build = original  # type: ignore[method-assign]


DYNAMIC_LENGTHS = [5, 20, 29, 40, 57, 12]  # original context 32: below, crossing while decoding, past it


@pytest.mark.parametrize("page_size,budget", [(4, 48), (16, 256), (1, 16)])
def test_dynamic_rope_batched_requests_of_different_lengths(page_size: int, budget: int) -> None:
    prompts = random_prompts(DYNAMIC_LENGTHS)
    reference = dynamic_llama()
    expected = [fresh_greedy(reference, p) for p in prompts]
    requests = run_engine(
        dynamic_llama(), prompts, page_size=page_size, num_pages=800, max_num_batched_tokens=budget,
        enable_prefix_caching=False,
    )  # fmt: skip
    check(requests, expected)


@pytest.mark.parametrize("length", [20, 57])
def test_dynamic_rope_alone(length: int) -> None:
    prompt = random_prompts([length], seed=3)
    reference = dynamic_llama()
    check(run_engine(dynamic_llama(), prompt), [fresh_greedy(reference, prompt[0])])


def test_dynamic_rope_module_is_transformers_own_outside_the_engine() -> None:
    """After the engine patched it, a plain forward still runs transformers' (stateful) dynamic update."""
    model = dynamic_llama()
    run_engine(model, random_prompts([40]))
    rotary = model.model.rotary_emb
    x = torch.zeros(1, 50, 4)
    cos, _ = rotary(x, torch.arange(50)[None])
    assert rotary.max_seq_len_cached == 50  # transformers' growth happened
    fresh = dynamic_llama().model.rotary_emb
    assert torch.equal(cos, fresh(x, torch.arange(50)[None])[0])
