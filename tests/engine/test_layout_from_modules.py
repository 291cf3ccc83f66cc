"""The page layout comes from what the attention modules compute (`pagedkv.hf.support.check_model`).

Where a model's own parts contradict each other, `LLMEngine.from_hf` refuses with a ValueError naming both
values and leaves the model as it was; where only the config says otherwise, the modules win and the engine
still equals transformers. The probe forward (`pagedkv.hf.probe.observe`) leaves the model as it was, also
when the forward raises. A cache built from a config that disagrees with the model is refused at the first
step (`ops.PagedStep.store`), never filled with wrong rows.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from architectures import build as build_arch
from test_mla import build as build_mla

from hf_models import build, hf_greedy
from pagedkv.engine import LLMEngine
from pagedkv.hf.attention import register
from pagedkv.hf.config import kv_params_from_config
from pagedkv.manager.paged import PagedKVCacheManager

PROMPT = list(range(3, 20))


def refused(model: Any, match: str, runs: bool = True) -> None:
    """from_hf raises ValueError matching `match`; the model keeps its attention and (`runs`: when transformers
    can run it at all) its outputs."""
    implementation = model.config._attn_implementation
    ids = torch.tensor([PROMPT])
    with torch.inference_mode():
        before = model(ids, use_cache=False).logits if runs else None
    with pytest.raises(ValueError, match=f"cannot run on pagedkv: {match}"):
        LLMEngine.from_hf(model, page_size=4, num_pages=32)
    assert model.config._attn_implementation == implementation
    if before is not None:
        with torch.inference_mode():
            assert torch.equal(model(ids, use_cache=False).logits, before)


def test_window_keyword_that_disagrees_with_the_mask() -> None:
    """Gemma 2 attends the window its attention modules pass and its masks keep: both must agree."""
    model = build("gemma2")  # layers 0, 2 slide over 8 tokens, layers 1, 3 attend everything
    model.model.layers[0].self_attn.sliding_window = 5
    refused(model, r"model.layers.0.self_attn passes sliding_window=5 to its attention function but its layer's "
                   r"attention mask keeps a window of 8")  # fmt: skip
    model = build("gemma2")
    model.model.layers[1].self_attn.sliding_window = 4
    refused(model, r"model.layers.1.self_attn passes sliding_window=4 to its attention function but its layer's "
                   r"attention mask keeps every earlier key")  # fmt: skip


def test_a_mask_that_is_no_window_is_refused() -> None:
    """A sliding window of 0 lets a query see no key at all: no page layout holds that."""
    refused(build("mistral", overrides={"sliding_window": 0}),
            r"the attention mask model.layers.0.self_attn gets is not a causal, sliding-window or chunked mask")  # fmt: skip


def test_keys_and_values_of_different_shapes() -> None:
    model = build("llama")
    model.model.layers[0].self_attn.v_proj = torch.nn.Linear(64, 16, bias=False)  # one value head of 16
    refused(model, r"model.layers.0.self_attn passes keys of \(heads, size\)=\(2, 16\) but values of \(1, 16\)", False)


def test_query_heads_not_a_multiple_of_the_kv_heads() -> None:
    model = build("llama")
    attn = model.model.layers[1].self_attn
    attn.k_proj, attn.v_proj = torch.nn.Linear(64, 48, bias=False), torch.nn.Linear(64, 48, bias=False)
    refused(model, r"model.layers.1.self_attn passes 4 query heads, not a multiple of its 3 K/V heads", False)


def test_alibi_heads_must_be_the_configs() -> None:
    """Bloom's ALiBi slopes are built for the config's head count; its modules compute 4 heads."""
    model = build_arch("bloom")
    model.config.n_head = 2
    with pytest.raises(ValueError, match=r"layer 0 computes 4 query heads but num_attention_heads=2"):
        LLMEngine.from_hf(model, page_size=4, num_pages=32)
    assert not hasattr(model.transformer.h[0].self_attention, "_pagedkv_original")  # not wrapped


@pytest.mark.parametrize("attr,value", [("num_key_value_heads", 4), ("head_dim", 8)])
def test_config_changed_after_loading_changes_nothing(attr: str, value: int) -> None:
    """A config shape set after the modules were built (so they do not use it): the modules' layout wins (a
    window set so is refused: transformers' own cache would keep it, `test_stray_config.py`)."""
    model = build("llama")
    tokens, logits = hf_greedy(model, PROMPT, 4)
    setattr(model.config, attr, value)
    engine = LLMEngine.from_hf(model, page_size=4, num_pages=32, record_logits=True)
    params = engine.manager.params
    assert (params.n_kv_heads, params.head_dim, params.sliding_window) == (2, 16, None)
    request = engine.add_request(PROMPT, 4)
    engine.run()
    assert request.output == tokens
    assert max(float((a - b).abs().max()) for a, b in zip(request.logits, logits, strict=True)) < 1e-4


def test_mla_latent_width_comes_from_the_modules() -> None:
    """DeepSeek caches the latent its modules compute (kv_lora_rank 32 + rope 8), not a later config value."""
    model = build_mla("deepseek_v2")
    tokens, logits = hf_greedy(model, PROMPT, 4)
    model.config.kv_lora_rank = 16
    engine = LLMEngine.from_hf(model, page_size=4, num_pages=32, record_logits=True)
    assert (engine.manager.params.n_kv_heads, engine.manager.params.head_dim) == (1, 40)
    request = engine.add_request(PROMPT, 4)
    engine.run()
    assert request.output == tokens
    assert max(float((a - b).abs().max()) for a, b in zip(request.logits, logits, strict=True)) < 1e-4


def test_probe_leaves_the_model_as_it_was() -> None:
    """Train mode (dropout draws from the RNG): the RNG state, the attention implementation and the mode stay."""
    from pagedkv.hf.probe import observe

    model = build_arch("gpt2", {"resid_pdrop": 0.5, "embd_pdrop": 0.5}).train()
    state = torch.get_rng_state()
    seen = observe(model)
    assert {i: (o.query, o.key, o.window, o.window_keyword) for i, o in seen.items()} == {
        i: ((4, 16), (4, 16), ("full_attention", None), None) for i in range(2)
    }
    assert torch.equal(torch.get_rng_state(), state)
    assert model.training and model.config._attn_implementation == "eager"


def test_probe_restores_the_implementation_when_the_forward_raises() -> None:
    from pagedkv.hf.probe import observe

    model = build("llama")
    model.model.layers[0].self_attn.o_proj = torch.nn.Linear(32, 64, bias=False)  # takes 32, gets 64
    with pytest.raises(RuntimeError):
        observe(model)
    assert model.config._attn_implementation == "eager"


def test_mask_window_reads_transformers_mask_functions() -> None:
    from transformers import masking_utils as mu

    from pagedkv.hf.probe import mask_window

    assert mask_window(mu.causal_mask_function) == ("full_attention", None)
    assert mask_window(mu.sliding_window_causal_mask_function(4096)) == ("sliding_attention", 4096)
    assert mask_window(mu.sliding_window_causal_mask_function(1)) == ("sliding_attention", 1)
    assert mask_window(mu.chunked_causal_mask_function(8, torch.zeros(1, dtype=torch.long))) == ("chunked_attention", 8)
    assert mask_window(mu.bidirectional_mask_function) is None
    assert mask_window(mu.sliding_window_causal_mask_function(0)) is None  # sees nothing


def test_a_cache_of_another_layout_is_refused_at_the_first_step() -> None:
    """GPT-2 with a stray ``num_key_value_heads=2``: pages sized from the config alone hold 2 heads, its attention
    gives 4. The engine's first step refuses them before writing a row (the layout `from_hf` builds is right)."""
    model = build_arch("gpt2", {"num_key_value_heads": 2})
    params = kv_params_from_config(model.config, page_size=4)
    assert params.n_kv_heads == 2  # what the config alone says
    manager = PagedKVCacheManager(params, None, 32, max_batch_size=4)
    model.set_attn_implementation(register())
    engine = LLMEngine(model, manager)
    engine.add_request(PROMPT, 2)
    pages = [t.clone() for t in manager.get_device_buffer().values]
    with pytest.raises(ValueError, match=r"key shape \(17, 4, 16\) != the step's \[T, H_kv, D\]=\[17, 2, 16\]"):
        engine.step()
    assert all(torch.equal(a, b) for a, b in zip(pages, manager.get_device_buffer().values, strict=True))
