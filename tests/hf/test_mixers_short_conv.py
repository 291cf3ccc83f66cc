"""The short-conv adapter (`Lfm2ShortConv`, `Lfm2MoeShortConv`, `Lfm3ShortConv`) over packed ragged steps
equals each module's own cache-free forward per request; slots outside a step stay bit-identical;
chunked prefill ends in the conv window of one call, which is transformers' own after that call."""

from __future__ import annotations

import copy
import functools
from typing import Any

import pytest
import torch
import transformers as tf
from state_mixer_harness import (
    NUM_SLOTS,
    Request,
    bits,
    garbage_states,
    reference,
    replay,
    standard_requests,
)
from transformers.cache_utils import DynamicCache

from pagedkv.hf.mixers.base import StateBatch
from pagedkv.hf.mixers.short_conv import ADAPTERS

ATOL = 1e-5
BF16_ATOL = 4e-2
HIDDEN = 64
COMMON = dict(
    vocab_size=32, hidden_size=HIDDEN, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
    num_key_value_heads=2, layer_types=["conv", "full_attention"], pad_token_id=0, bos_token_id=None,
    eos_token_id=None,
)  # fmt: skip

# variant -> (config class, model class, config kwargs); the mixer is layer 0's `conv`
VARIANTS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "lfm2": ("Lfm2Config", "Lfm2Model", {"conv_L_cache": 4, "conv_bias": True}),
    "lfm2_moe": (
        "Lfm2MoeConfig", "Lfm2MoeModel",
        {"conv_L_cache": 3, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
         "num_dense_layers": 1},
    ),
    "lfm3": ("Lfm3Config", "Lfm3Model", {"conv_L_cache": 5, "head_dim": 16}),
}  # fmt: skip


@functools.cache
def build(variant: str) -> tuple[torch.nn.Module, Any]:
    """Layer 0's short conv of a tiny fp32 model (seeded), every parameter perturbed; and the config."""
    config_cls, model_cls, kwargs = VARIANTS[variant]
    config = getattr(tf, config_cls)(**COMMON, **kwargs)
    torch.manual_seed(0)
    model = getattr(tf, model_cls)._from_config(config, attn_implementation="eager").eval()
    mixer: torch.nn.Module = model.layers[0].conv
    with torch.no_grad():
        for p in mixer.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return mixer, config


def adapter_of(module: torch.nn.Module) -> Any:
    adapter = ADAPTERS[type(module).__name__]
    assert adapter.mamba_type == "short_conv"
    return adapter


@pytest.mark.parametrize("variant", VARIANTS)
def test_ragged_steps_equal_full_forward(variant: str) -> None:
    module, _ = build(variant)
    adapter = adapter_of(module)
    requests = standard_requests(HIDDEN, torch.float32, seed=1)
    states = garbage_states(adapter, module, torch.float32, seed=2)
    slots = torch.randperm(NUM_SLOTS, generator=torch.Generator().manual_seed(3))[: len(requests)].tolist()
    outputs, calls = replay(adapter, module, requests, states, slots)
    assert calls == 17  # the long request: 4 prefill chunks (47 tokens), then 13 decode steps
    worst = 0.0
    for req, out in zip(requests, outputs, strict=True):
        expected = reference(module, req.inputs)  # [L, D]
        assert out.shape == expected.shape
        worst = max(worst, float((out - expected).abs().max()))
    assert worst <= ATOL, f"{variant}: max abs diff {worst:.2e}"
    print(f"{variant}: worst max abs diff {worst:.2e}")


def hf_conv_state(module: torch.nn.Module, config: Any, inputs: torch.Tensor) -> torch.Tensor:
    """transformers' conv window [D, K] after one call from an empty cache."""
    cache = DynamicCache(config=config)
    with torch.no_grad():
        module(inputs[None], cache=cache)
    state: torch.Tensor = cache.get_conv_state(0, state_idx=0)[0]
    return state


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("length", [2, 41])
def test_chunked_prefill_state_equals_one_call(variant: str, length: int) -> None:
    module, config = build(variant)
    adapter = adapter_of(module)
    inputs = torch.randn(length, HIDDEN, generator=torch.Generator().manual_seed(length))  # [L, D]
    chunked = [[1, 1], [1, 1]] if length == 2 else [[1, 2, 17, 5, 16], [13, 1, 1, 26]]
    finals = []
    for chunks in [[length], *chunked]:
        states = garbage_states(adapter, module, torch.float32, seed=5)
        replay(adapter, module, [Request(inputs, chunks)], states, [7])
        finals.append(states[0][7].clone())  # [D, K - 1]
    for conv in finals[1:]:
        torch.testing.assert_close(conv, finals[0], atol=ATOL, rtol=0)
    hf_conv = hf_conv_state(module, config, inputs)  # [D, K]
    torch.testing.assert_close(finals[0], hf_conv[:, 1:], atol=ATOL, rtol=0)  # the last K - 1 of K columns


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_spec(variant: str, dtype: torch.dtype) -> None:
    module, config = build(variant)
    shapes, dtypes = adapter_of(module).state_spec(module, dtype)
    k = config.conv_L_cache
    assert shapes == ((HIDDEN, k - 1),) and dtypes == (dtype,)
    assert hf_conv_state(module, config, torch.randn(3, HIDDEN)).shape == (HIDDEN, k)  # transformers keeps K columns


def test_bf16_model_tracks_fp32_reference() -> None:
    """A bf16 short conv (bf16 conv state) over the same steps stays within a few 1e-2 of the fp32
    module's full forward; the state keeps its dtype."""
    worst = {}
    for variant in ("lfm2", "lfm2_moe"):
        module32, _ = build(variant)
        module = copy.deepcopy(module32).to(torch.bfloat16)
        adapter = adapter_of(module)
        requests = standard_requests(HIDDEN, torch.float32, seed=1)
        states = garbage_states(adapter, module, torch.bfloat16, seed=2)
        bf16_requests = [Request(r.inputs.to(torch.bfloat16), r.chunks, r.start) for r in requests]
        outputs, _ = replay(adapter, module, bf16_requests, states, [4, 9, 0, 11])
        assert states[0].dtype == torch.bfloat16
        worst[variant] = max(
            float((out.float() - reference(module32, req.inputs)).abs().max())
            for req, out in zip(requests, outputs, strict=True)
        )
    assert max(worst.values()) <= BF16_ATOL, worst
    print(f"bf16 vs fp32 reference: {worst}")


def test_forward_rejects_a_batch_of_other_rows() -> None:
    module, _ = build("lfm2")
    adapter = adapter_of(module)
    states = tuple(garbage_states(adapter, module, torch.float32, seed=0))
    batch = StateBatch.build([2, 3], torch.tensor([0, 1]), torch.tensor([False, False]))
    before = [bits(s).clone() for s in states]
    with pytest.raises(ValueError, match="5 rows"):
        adapter.forward(module, torch.randn(1, 4, HIDDEN), batch, states)
    with pytest.raises(ValueError, match="1 state tensor"):
        adapter.forward(module, torch.randn(1, 5, HIDDEN), batch, (*states, states[0]))
    assert all(torch.equal(bits(s), b) for s, b in zip(states, before, strict=True))
