"""ALiBi position biases (`alibi_slopes`): the reference against transformers' conventions on dense
tensors, then every torch path against the reference on real ragged batches (test_ops.ragged_steps:
prefix hits, chunked prefill, mixed prefill + decode, decode), with MHA, GQA and MQA, page sizes
1, 4 and 16, and with windows, chunks, sink tokens, learned sinks and softcap.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from test_masks import sinks_for
from test_ops import LAYER, attention, make_manager, ragged_steps, store_both, torch_outputs

from pagedkv import ops
from pagedkv.ops.masks import AttentionOptions


def bloom_slopes(num_heads: int) -> torch.Tensor:
    """Bloom's slopes (transformers' `_get_alibi_slopes`), float32 [H]."""
    from transformers.models.bloom.modeling_bloom import _get_alibi_slopes

    return _get_alibi_slopes(num_heads, torch.device("cpu")).float()


def steep_slopes(num_heads: int) -> torch.Tensor:
    """Slopes large enough that the bias dominates these small random logits."""
    return torch.linspace(0.3, 1.2, num_heads)


CONFIGS: dict[str, Any] = {  # name -> page_size -> extra options
    "alibi": lambda ps: {},
    "alibi+window": lambda ps: {"sliding_window": ps + 2},
    "alibi+chunk+sink_tokens": lambda ps: {"chunk_size": ps + 1, "sink_tokens": 2},
    "alibi+window+sinks+softcap": lambda ps: {"sliding_window": ps + 2, "sinks": True, "softcap": 1.5},
    "alibi+scale": lambda ps: {"scale": 0.2},
}


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("heads", ["mha", "gqa", "mqa"])
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_alibi_matches_reference(page_size: int, heads: str, config: str, monkeypatch: pytest.MonkeyPatch) -> None:
    n_kv, group = {"mha": (2, 1), "gqa": (2, 4), "mqa": (1, 4)}[heads]
    num_q = n_kv * group
    kwargs = dict(CONFIGS[config](page_size))
    if kwargs.get("sinks") is True:
        kwargs["sinks"] = sinks_for(num_q)
    mgr = make_manager(page_size, n_kv_heads=n_kv)
    bite = 0.0
    for step in ragged_steps(mgr, group, seed=page_size):
        store_both(step)
        want = attention(step, "reference", alibi_slopes=steep_slopes(num_q), **kwargs)
        assert want.isfinite().all()
        for name, got in torch_outputs(step, monkeypatch, alibi_slopes=steep_slopes(num_q), **kwargs).items():
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
        bite = max(bite, (want - attention(step, "reference", **kwargs)).abs().max().item())
    assert bite > 1e-2, "the ALiBi bias changed nothing"


def test_reference_is_transformers_convention_on_dense_tensors() -> None:
    """One prefill: Bloom (``slope * k`` on the scaled logits), MPT (``slope * (k - (L - 1))``) and Falcon
    (``slope * k`` before scaling: pass slopes * scale) all equal ``slope * (k - q)`` of the op."""
    step = next(ragged_steps(make_manager(4), 2, seed=1))  # one request, 10 tokens, H_q 4, H_kv 2
    store_both(step)
    q, k, v = step.query.transpose(0, 1), step.key.transpose(0, 1), step.value.transpose(0, 1)  # [H, L, D]
    k, v = k.repeat_interleave(2, 0), v.repeat_interleave(2, 0)  # [H_q, L, D]
    length, scale = q.shape[1], 1 / math.sqrt(q.shape[2])
    causal = torch.ones(length, length, dtype=torch.bool).tril()  # [L, L]
    pos = torch.arange(length).float()  # [L]
    slopes = bloom_slopes(4)  # [H_q]

    def dense(scores: torch.Tensor) -> torch.Tensor:  # scores [H, L, L] -> [L, H, D]
        return (scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v).transpose(0, 1)

    logits = q @ k.transpose(1, 2)  # [H, L, L]
    bloom = dense(logits * scale + slopes[:, None, None] * pos)
    mpt = dense(logits * scale + slopes[:, None, None] * (pos - (length - 1)))
    falcon = dense((logits + slopes[:, None, None] * pos) * scale)
    torch.testing.assert_close(attention(step, "reference", alibi_slopes=slopes), bloom, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(attention(step, "reference", alibi_slopes=slopes), mpt, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(attention(step, "reference", alibi_slopes=slopes * scale), falcon, atol=1e-5, rtol=1e-5)
    assert (bloom - attention(step, "reference")).abs().max() > 1e-2


def test_alibi_cross_attention_and_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    for step in ragged_steps(make_manager(3), 4):
        store_both(step)
        kwargs: dict[str, Any] = {"causal": False, "alibi_slopes": steep_slopes(8)}
        want = attention(step, "reference", **kwargs)
        for got in torch_outputs(step, monkeypatch, **kwargs).values():
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    from pagedkv.dtype import DType

    for step in ragged_steps(make_manager(3, dtype=DType.bfloat16), 4, dtype=torch.bfloat16):
        store_both(step)
        want = attention(step, "reference", alibi_slopes=steep_slopes(8), sliding_window=5)
        for got in torch_outputs(step, monkeypatch, alibi_slopes=steep_slopes(8), sliding_window=5).values():
            torch.testing.assert_close(got, want, atol=1.6e-2, rtol=1.6e-2)


def test_paged_step_carries_alibi_in_its_options() -> None:
    """A step built once with the slopes attends every layer as paged_attention(alibi_slopes=...) does."""
    for step in ragged_steps(make_manager(4), 2):
        store_both(step)
        options = AttentionOptions(sliding_window=6, alibi_slopes=steep_slopes(4))
        paged = ops.PagedStep.build(step.inputs, step.offsets, options=options)
        want = attention(step, "reference", sliding_window=6, alibi_slopes=steep_slopes(4))
        with ops.use_backend("torch"):
            torch.testing.assert_close(paged.attend(step.query, LAYER), want, atol=1e-5, rtol=1e-5)
        with pytest.raises(ValueError, match="query has 2 heads but the step's alibi_slopes 4"):
            paged.attend(step.query[:, :2], LAYER)
    with pytest.raises(ValueError, match="alibi_slopes has 3 heads, not a multiple of H_kv=2"):
        ops.PagedStep.build(step.inputs, step.offsets, options=AttentionOptions(alibi_slopes=torch.ones(3)))


def test_alibi_is_checked_and_keeps_triton_out(monkeypatch: pytest.MonkeyPatch) -> None:
    from pagedkv.ops import triton_decode

    step = next(ragged_steps(make_manager(3), 2))
    store_both(step)
    for backend in ("reference", "torch"):
        with pytest.raises(ValueError, match=r"alibi_slopes shape \(3,\) != \[H_q=4\]"):
            attention(step, backend, alibi_slopes=torch.ones(3))
        with pytest.raises(TypeError, match="alibi_slopes must be a floating-point tensor"):
            attention(step, backend, alibi_slopes=torch.ones(4, dtype=torch.int64))
    with pytest.raises(ValueError, match="backend='triton' does not implement alibi_slopes"):
        attention(step, "triton", alibi_slopes=steep_slopes(4))
    monkeypatch.setattr(ops, "_triton_usable", lambda query, meta: True)
    monkeypatch.setattr(triton_decode, "paged_decode", lambda *a, **k: (_ for _ in ()).throw(AssertionError("triton")))
    want = attention(step, "reference", alibi_slopes=steep_slopes(4))
    torch.testing.assert_close(attention(step, "auto", alibi_slopes=steep_slopes(4)), want, atol=1e-5, rtol=1e-5)
