"""The Mamba1 adapters (`MambaMixer`, `JambaMambaMixer`) over packed ragged steps equal each module's own
cache-free forward per request; slots outside a step stay bit-identical; chunked prefill ends in the
state of one call, which is transformers' own final state of that call."""

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
from pagedkv.hf.mixers.mamba1 import ADAPTERS

ATOL = 1e-5
BF16_ATOL = 4e-2
HIDDEN = 64

# variant -> (config class, model class, config kwargs, mixer attribute of layer 0)
VARIANTS: dict[str, tuple[str, str, dict[str, Any], str]] = {
    "mamba": ("MambaConfig", "MambaModel", {"state_size": 8, "conv_kernel": 4, "expand": 2}, "mixer"),
    # another conv activation (applied after the op), no conv bias, biased in/out projections
    "mamba-gelu": (
        "MambaConfig", "MambaModel",
        {"state_size": 4, "conv_kernel": 3, "expand": 1, "hidden_act": "gelu", "use_conv_bias": False, "use_bias": True},
        "mixer",
    ),
    "jamba": (
        "JambaConfig", "JambaModel",
        {"mamba_d_state": 8, "mamba_d_conv": 4, "mamba_expand": 2, "attn_layer_period": 2, "attn_layer_offset": 1,
         "num_experts": 1, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2},
        "mamba",
    ),
}  # fmt: skip


@functools.cache
def build(variant: str) -> tuple[torch.nn.Module, Any]:
    """Layer 0's mixer of a tiny fp32 model (seeded), every parameter perturbed so that D, the biases and
    Jamba's norm weights are not at their neutral init; and the config."""
    config_cls, model_cls, kwargs, attr = VARIANTS[variant]
    config = getattr(tf, config_cls)(vocab_size=32, hidden_size=HIDDEN, num_hidden_layers=2, **kwargs)
    torch.manual_seed(0)
    model = getattr(tf, model_cls)._from_config(config, attn_implementation="eager").eval()
    mixer: torch.nn.Module = getattr(model.layers[0], attr)
    with torch.no_grad():
        for p in mixer.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return mixer, config


def adapter_of(module: torch.nn.Module) -> Any:
    adapter = ADAPTERS[type(module).__name__]
    assert adapter.mamba_type == "mamba1"
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


def hf_final_states(module: torch.nn.Module, config: Any, inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' conv window [I, K] and SSM state [I, N] after one call from an empty cache."""
    cache = DynamicCache(config=config)
    with torch.no_grad():
        module(inputs[None], cache=cache)
    return cache.get_conv_state(0, state_idx=0)[0], cache.get_recurrent_state(0, state_idx=0)[0]


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
        finals.append([state[7].clone() for state in states])
    for conv, ssm in finals[1:]:
        torch.testing.assert_close(conv, finals[0][0], atol=ATOL, rtol=0)
        torch.testing.assert_close(ssm, finals[0][1], atol=ATOL, rtol=0)
    hf_conv, hf_ssm = hf_final_states(module, config, inputs)  # [I, K], [I, N]
    torch.testing.assert_close(finals[0][0], hf_conv[:, 1:], atol=ATOL, rtol=0)  # the last K - 1 of K columns
    torch.testing.assert_close(finals[0][1], hf_ssm, atol=ATOL, rtol=0)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_spec(variant: str, dtype: torch.dtype) -> None:
    module, config = build(variant)
    shapes, dtypes = adapter_of(module).state_spec(module, dtype)
    inner, n, k = module.intermediate_size, module.ssm_state_size, module.conv_kernel_size
    assert shapes == ((inner, k - 1), (inner, n)) and dtypes == (dtype, torch.float32)
    # the tensors transformers' own cache keeps for the layer: conv [1, I, K] (K columns), ssm [1, I, N]
    hf_conv, hf_ssm = hf_final_states(module, config, torch.randn(3, HIDDEN))
    assert hf_conv.shape == (inner, k) and hf_ssm.shape == shapes[1] and hf_ssm.dtype == torch.float32


def test_bf16_model_tracks_fp32_reference() -> None:
    """A bf16 mixer (bf16 conv state, float32 SSM state) over the same steps stays within a few 1e-2 of
    the fp32 module's full forward; the state tensors keep their dtypes."""
    worst = {}
    for variant in ("mamba", "jamba"):
        module32, _ = build(variant)
        module = copy.deepcopy(module32).to(torch.bfloat16)
        adapter = adapter_of(module)
        requests = standard_requests(HIDDEN, torch.float32, seed=1)
        states = garbage_states(adapter, module, torch.bfloat16, seed=2)
        assert [s.dtype for s in states] == [torch.bfloat16, torch.float32]
        bf16_requests = [Request(r.inputs.to(torch.bfloat16), r.chunks, r.start) for r in requests]
        outputs, _ = replay(adapter, module, bf16_requests, states, [4, 9, 0, 11])
        assert [s.dtype for s in states] == [torch.bfloat16, torch.float32]
        worst[variant] = max(
            float((out.float() - reference(module32, req.inputs)).abs().max())
            for req, out in zip(requests, outputs, strict=True)
        )
    assert max(worst.values()) <= BF16_ATOL, worst
    print(f"bf16 vs fp32 reference: {worst}")


def test_forward_rejects_a_batch_of_other_rows() -> None:
    module, _ = build("mamba")
    adapter = adapter_of(module)
    states = tuple(garbage_states(adapter, module, torch.float32, seed=0))
    batch = StateBatch.build([2, 3], torch.tensor([0, 1]), torch.tensor([False, False]))
    before = [bits(s).clone() for s in states]
    with pytest.raises(ValueError, match="5 rows"):
        adapter.forward(module, torch.randn(1, 4, HIDDEN), batch, states)
    with pytest.raises(ValueError, match=r"\[1, T, D\]"):
        adapter.forward(module, torch.randn(2, 5, HIDDEN), batch, states)
    assert all(torch.equal(bits(s), b) for s, b in zip(states, before, strict=True))
