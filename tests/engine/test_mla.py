"""DeepSeek V2/V3 (MLA) on the engine: the pages hold the latent, outputs equal transformers' greedy generate().

Tiny models (transformers configs with random weights) on top of `hf_models.COMMON` (4 heads, kv_lora_rank 32,
rope 8, nope 16, v 16; V3 adds a q-LoRA of rank 32). The engine caches one
``kv_lora_rank + qk_rope_head_dim`` latent per token and layer (`pagedkv.hf.mla`);
transformers' own eager attention with its DynamicCache is the reference.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import pytest
import torch

from hf_models import COMMON, hf_greedy
from pagedkv.engine import LLMEngine
from pagedkv.runtime.buffers import KVCacheBuffer

ARCHS = ["deepseek_v2", "deepseek_v3"]
NEW_TOKENS = 12
RANK, ROPE = 32, 8
MLA = dict(
    num_key_value_heads=4, kv_lora_rank=RANK, q_lora_rank=None, qk_rope_head_dim=ROPE, qk_nope_head_dim=16,
    v_head_dim=16, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=32,
    first_k_dense_replace=1, n_group=1, topk_group=1,
)  # fmt: skip
# (page_size, num_pages, expect preemption); prefix caching is on everywhere
CONFIGS = [(16, 64, False), (1, 400, False), (16, 8, True)]


def config_for(arch: str, overrides: dict[str, Any] | None = None) -> Any:
    """The config of `arch` `build` uses (`overrides`: more keywords)."""
    import transformers as tf

    config_cls, extra = {
        "deepseek_v2": (tf.DeepseekV2Config, {}),
        "deepseek_v3": (tf.DeepseekV3Config, {"q_lora_rank": 32}),
    }[arch]
    return config_cls(**{**COMMON, **MLA, **extra, **(overrides or {})})


def build(arch: str, seed: int = 0, overrides: dict[str, Any] | None = None) -> Any:
    """A 2-layer fp32 DeepSeek model (eager attention, eos disabled); layer 0 dense, layer 1 MoE. `overrides`:
    more config keywords."""
    import transformers as tf

    model_cls = {"deepseek_v2": tf.DeepseekV2ForCausalLM, "deepseek_v3": tf.DeepseekV3ForCausalLM}[arch]
    config = config_for(arch, overrides)
    torch.manual_seed(seed)
    model = model_cls._from_config(copy.deepcopy(config), attn_implementation="eager", dtype=torch.float32)
    model.generation_config.eos_token_id = None
    return model.eval()


def prompts() -> list[list[int]]:
    """Prompts sharing a 21-token prefix (and a 10-token one), none page-aligned, plus an unrelated one."""
    g = torch.Generator().manual_seed(7)
    shared = torch.randint(3, 256, (21,), generator=g).tolist()
    tails = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (5, 11, 2, 17, 9)]
    return [shared + t for t in tails] + [shared[:10] + tails[0], torch.randint(3, 256, (30,), generator=g).tolist()]


def _pages(engine: LLMEngine) -> torch.Tensor:
    """The engine's page buffer [P + 1, kv_dim, L, page_size, H_kv, D] (one cache, one device)."""
    buffer = engine.manager.get_device_buffer()
    assert isinstance(buffer, KVCacheBuffer) and len(buffer.values) == 1
    return buffer.values[0]


@functools.cache
def reference(arch: str) -> tuple[tuple[list[int], list[torch.Tensor]], ...]:
    model = build(arch)
    return tuple(hf_greedy(model, p, NEW_TOKENS) for p in prompts())


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("page_size,num_pages,preempts", CONFIGS)
def test_mla_engine_matches_transformers(arch: str, page_size: int, num_pages: int, preempts: bool) -> None:
    engine = LLMEngine.from_hf(
        build(arch), page_size=page_size, num_pages=num_pages, enable_prefix_caching=True, max_batch_size=8,
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
    assert summary["prompt_tokens_cached"] > 0, summary  # shared prefixes were served from cached latents
    assert summary["used_pages"] == 0 and engine.manager.check_integrity() is None


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("page_size", [1, 4])
def test_pages_hold_the_latents_transformers_caches(arch: str, page_size: int) -> None:
    """After a prefill, each prompt token's slot is ``cat(kv_a_layernorm(kv_nope), rope(k_pe))``, as in DynamicCache."""
    num_pages, layers = 128 // page_size, COMMON["num_hidden_layers"]
    engine = LLMEngine.from_hf(build(arch), page_size=page_size, num_pages=num_pages, max_num_batched_tokens=64)
    buffer = _pages(engine)
    assert tuple(buffer.shape) == (num_pages + 1, 1, layers, page_size, 1, RANK + ROPE)
    batch = prompts()[:2]  # 26 and 32 tokens, sharing 21
    requests = [engine.add_request(p, 2) for p in batch]
    engine.step()  # both prefills: every prompt token is in the pages, nothing finished yet
    assert all(len(r.output) == 1 for r in requests)
    reference_model = build(arch)
    for prompt, request in zip(batch, requests, strict=True):
        with torch.inference_mode():
            cache = reference_model(torch.tensor([prompt]), use_cache=True).past_key_values
        pages = torch.tensor(engine.manager.get_req_blocks(request.request_id))  # [n_pages]
        positions = torch.arange(len(prompt))  # [S]
        for layer in range(layers):
            keys, values = cache.layers[layer].keys, cache.layers[layer].values  # [1, 1, S, r], [1, 1, S, R]
            assert keys.shape == (1, 1, len(prompt), RANK) and values.shape == (1, 1, len(prompt), ROPE)
            expected = torch.cat((keys[0, 0], values[0, 0]), dim=-1)  # [S, r + R]
            stored = buffer[pages[positions // page_size], 0, layer, positions % page_size, 0]  # [S, r + R]
            torch.testing.assert_close(stored, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_kv_bytes_per_token_are_the_latents(arch: str) -> None:
    """fp32 latent per token and layer: (kv_lora_rank + rope) * 4 bytes, not per-head K (nope + rope) and V."""
    layers, page_size = COMMON["num_hidden_layers"], 16
    latent_bytes = layers * (RANK + ROPE) * 4  # 320
    page_bytes = page_size * latent_bytes
    engine = LLMEngine.from_hf(build(arch), page_size=page_size, memory_budget=10 * page_bytes + page_bytes // 2)
    params = engine.manager.params
    assert params.bytes_per_token == latent_bytes
    assert engine.manager.total_num_blocks() == 10
    buffer = _pages(engine)
    assert buffer[0].numel() * buffer.element_size() == page_bytes  # one page, as allocated
    expanded = layers * 4 * ((16 + ROPE) + 16) * 4  # per-head K (nope + rope) and V of 4 heads: 1280
    assert params.bytes_per_token * 4 == expanded
