"""The prefill fast path (`pagedkv.ops.torch_fresh`) and the per-step plans of the torch paths.

Requests that start at cache length 0 attend over the step's own K/V (`PagedStep.attend(..., key=, value=)`)
with causal SDPA; every other request takes the general path on a subset of the metadata. Each check runs
the same step through the reference (which reads the pages), the torch backend with the fast path and the
torch backend without it, and asserts which requests took which route: never the fast path with a cached
prefix, a window, a chunk, sink tokens, learned sinks, a softcap, ALiBi, an FP8 cache or non-finite K/V.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from pagedkv import ops
from pagedkv.ops import torch_decode, torch_fresh, torch_ops
from pagedkv.ops.masks import AttentionOptions
from pagedkv.ops.metadata import PagedMetadata
from pagedkv.ops.reference import paged_attention_reference
from pagedkv.runtime.inputs import RaggedKVCacheInputs, max_lengths_table

LAYER = 1  # of 2


def make_step(
    page_size: int,
    cached: list[int],
    q_lens: list[int],
    heads: int,
    group: int,
    dim: int = 8,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> tuple[RaggedKVCacheInputs, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A batch whose request b has `cached[b]` keys in shuffled pages and `q_lens[b]` new tokens; the pages
    past each request's keys and the null page hold NaN. Returns (inputs, offsets [B + 1], query [T, H_q, D],
    key, value [T, H_kv, D]); the step's K/V are not stored yet."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-(c + q) // page_size) for c, q in zip(cached, q_lens, strict=True)]
    num_pages = sum(need)
    order = torch.randperm(num_pages, generator=gen)
    blocks = torch.full((num_pages + 1, 2, 2, page_size, heads, dim), float("nan"), dtype=dtype)
    lut = torch.full((len(cached), max(need) + 1), num_pages, dtype=torch.int32)  # null-padded
    first = 0
    for b, n in enumerate(need):
        lut[b, :n] = order[first : first + n]
        first += n
        pos = torch.arange(cached[b])
        kv = torch.randn(2, cached[b], heads, dim, generator=gen).to(dtype)  # the cached prefix of both layers
        for layer in range(2):
            blocks[lut[b, pos // page_size].long(), :, layer, pos % page_size] = kv.transpose(0, 1)
    lengths = [c + q for c, q in zip(cached, q_lens, strict=True)]
    inputs = RaggedKVCacheInputs(
        blocks, torch.tensor(cached, dtype=torch.int32), lut, max_lengths_table(max(q_lens), max(lengths))
    )
    offsets = torch.cumsum(torch.tensor([0, *q_lens]), 0)  # [B + 1]
    total = int(offsets[-1])
    query, key, value = (torch.randn(total, n, dim, generator=gen).to(dtype) for n in (heads * group, heads, heads))
    return inputs, offsets, query, key, value


class Routes:
    """Spy on the fast path: the plans it used (requests it served) and how often it ran."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.plans: list[torch_fresh.FreshPlan] = []
        real = torch_fresh.fresh_attention

        def spy(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, fresh: torch_fresh.FreshPlan,
                *args: Any) -> torch.Tensor:  # fmt: skip
            self.plans.append(fresh)
            return real(query, key, value, fresh, *args)

        monkeypatch.setattr(torch_fresh, "fresh_attention", spy)

    def fresh_tokens(self) -> set[int]:
        """Tokens the last call served through its runs."""
        first, n, length = zip(*self.plans[-1].runs, strict=True)
        return {t for f, c, q in zip(first, n, length, strict=True) for t in range(f, f + c * q)}


def run(inputs: RaggedKVCacheInputs, offsets: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
        value: torch.Tensor, *, pass_kv: bool = True, fp8: bool = False, **kwargs: Any) -> dict[str, torch.Tensor]:  # fmt: skip
    """Store the step's K/V and attend: the reference, the torch path with the step's K/V and without them."""
    sinks = kwargs.pop("sinks", None)
    softcap, scale = kwargs.pop("softcap", None), kwargs.pop("scale", None)
    step = ops.PagedStep.build(inputs, offsets, options=AttentionOptions(**kwargs))
    step.store(key, value, LAYER)
    with ops.use_backend("reference"):
        want = step.attend(query, LAYER, scale=scale, softcap=softcap, sinks=sinks)
    out = {"reference": want}
    with ops.use_backend("torch"):
        extra = {"key": key, "value": value} if pass_kv else {}
        out["fresh"] = step.attend(query, LAYER, scale=scale, softcap=softcap, sinks=sinks, **extra)
        plain = ops.PagedStep.build(inputs, offsets, options=AttentionOptions(**kwargs))  # a new step: new plans
        out["general"] = plain.attend(query, LAYER, scale=scale, softcap=softcap, sinks=sinks)
    return out


BATCHES = {  # name -> (cached lengths, new tokens)
    "all fresh, one length": ([0, 0, 0], [7, 7, 7]),
    "all fresh, ragged": ([0, 0, 0, 0], [5, 9, 9, 1]),
    "fresh runs split by a cached prefix": ([0, 0, 6, 0, 0], [4, 4, 3, 4, 2]),
    "fresh, decode and chunk": ([0, 11, 0, 8], [6, 1, 6, 5]),
    "no fresh request": ([3, 11], [4, 1]),
    "an empty request": ([0, 0, 4], [5, 0, 3]),
}


@pytest.mark.parametrize("batch", BATCHES, ids=list(BATCHES))
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_fresh_requests_match_the_reference(page_size: int, group: int, batch: str,
                                            monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    cached, q_lens = BATCHES[batch]
    routes = Routes(monkeypatch)
    inputs, offsets, query, key, value = make_step(page_size, cached, q_lens, heads=2, group=group)
    out = run(inputs, offsets, query, key, value)
    for name in ("fresh", "general"):
        torch.testing.assert_close(out[name], out["reference"], atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    fresh = {t for b, c in enumerate(cached) if c == 0 for t in range(int(offsets[b]), int(offsets[b + 1]))}
    if not fresh:
        assert not routes.plans, "no request starts at 0: the general path only"
        return
    assert len(routes.plans) == 1, "the fast path serves the call with the step's K/V, not the one without"
    assert routes.fresh_tokens() == fresh, "exactly the requests with no cached prefix take the fast path"
    rest = routes.plans[0].rest_tokens
    assert set(() if rest is None else rest.tolist()) == set(range(int(offsets[-1]))) - fresh


def test_bf16_fresh_requests_match_the_reference() -> None:
    # SDPA runs in bf16 (as transformers' does); the reference rounds a float32 result: a bf16 ulp or two apart
    inputs, offsets, query, key, value = make_step(3, [0, 5, 0], [6, 2, 4], heads=2, group=2, dtype=torch.bfloat16)
    out = run(inputs, offsets, query, key, value)
    assert out["fresh"].dtype == torch.bfloat16
    for name in ("fresh", "general"):
        torch.testing.assert_close(out[name], out["reference"], atol=1.6e-2, rtol=1.6e-2)


@pytest.mark.parametrize("enable_gqa", [True, False], ids=["enable_gqa", "repeated_heads"])
def test_fresh_path_is_causal_sdpa_over_the_step_kv(enable_gqa: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """All requests fresh and of one length: bit-identical to one batched causal SDPA (what transformers runs),
    with SDPA's own GQA (torch >= 2.5) and with the K/V heads repeated (older torch)."""
    monkeypatch.setattr(torch_fresh, "_ENABLE_GQA", enable_gqa)
    inputs, offsets, query, key, value = make_step(4, [0, 0], [6, 6], heads=2, group=3)
    got = run(inputs, offsets, query, key, value)["fresh"]
    q, k, v = (x.view(2, 6, -1, 8).transpose(1, 2) for x in (query, key, value))  # [B, H, S, D]
    k, v = (x.repeat_interleave(3, dim=1) for x in (k, v))
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, H_q, S, D]
    assert torch.equal(got, want.transpose(1, 2).reshape(12, 6, 8))


OFF_ROUTE: dict[str, dict[str, Any]] = {  # options under which no request may take the fast path
    "window": {"sliding_window": 3},
    "chunk": {"chunk_size": 4},
    "sink tokens": {"sliding_window": 3, "sink_tokens": 1},
    "learned sinks": {"sinks": torch.linspace(-1.0, 1.0, 4)},
    "softcap": {"softcap": 1.5},
    "alibi": {"alibi_slopes": torch.tensor([0.5, 0.25, 0.125, 0.0625])},
    "no step K/V": {"pass_kv": False},
}


@pytest.mark.parametrize("case", OFF_ROUTE, ids=list(OFF_ROUTE))
def test_masked_options_never_take_the_fast_path(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    routes = Routes(monkeypatch)
    inputs, offsets, query, key, value = make_step(3, [0, 4, 0], [7, 2, 5], heads=2, group=2)
    out = run(inputs, offsets, query, key, value, **OFF_ROUTE[case])
    assert not routes.plans
    torch.testing.assert_close(out["fresh"], out["reference"], atol=1e-5, rtol=1e-5)


def test_fp8_cache_never_takes_the_fast_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pages hold quantized K/V: the step's own K/V would not be what the reference reads."""
    inputs, offsets, query, key, value = make_step(3, [0, 0], [5, 5], heads=2, group=2)
    assert not torch_fresh.usable(
        query, key, value, inputs.blocks, PagedMetadata.build(inputs, offsets), None, torch.ones(1), AttentionOptions()
    )
    wide = key.to(torch.float64)  # K/V not of the cache's dtype are stored rounded: not usable either
    meta = PagedMetadata.build(inputs, offsets)
    assert not torch_fresh.usable(query, wide, value, inputs.blocks, meta, None, None, AttentionOptions())
    assert torch_fresh.usable(query, key, value, inputs.blocks, meta, None, None, AttentionOptions())


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_step_kv_takes_the_general_path(bad: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """Non-finite K/V of the step (under ``nonfinite_kv="pass"``) behave exactly as before the fast path."""
    routes = Routes(monkeypatch)
    inputs, offsets, query, key, value = make_step(3, [0, 0], [6, 6], heads=2, group=2)
    value[4] = bad  # request 0's token 4
    out = run(inputs, offsets, query, key, value)
    assert not routes.plans
    torch.testing.assert_close(out["fresh"], out["general"], equal_nan=True)
    torch.testing.assert_close(out["fresh"][6:], out["reference"][6:])  # the other request is untouched


def test_fresh_plan_is_built_once_per_step(monkeypatch: pytest.MonkeyPatch) -> None:
    built = []
    real = torch_fresh._build_plan
    monkeypatch.setattr(torch_fresh, "_build_plan", lambda meta: built.append(1) or real(meta))
    inputs, offsets, query, key, value = make_step(3, [0, 5], [6, 1], heads=2, group=2)
    step = ops.PagedStep.build(inputs, offsets)
    for layer in (0, 1):
        step.store(key, value, layer)
        with ops.use_backend("torch"):
            step.attend(query, layer, key=key, value=value)
    assert len(built) == 1


def test_subset_is_the_metadata_of_those_requests() -> None:
    inputs, offsets, *_ = make_step(3, [0, 5, 2, 0], [4, 1, 3, 2], heads=2, group=1)
    meta = PagedMetadata.build(inputs, offsets)
    keep = torch.tensor([1, 2])
    sub, tokens = meta.subset(keep)
    q_lens = offsets[1:] - offsets[:-1]
    alone = RaggedKVCacheInputs(inputs.blocks, inputs.cache_lengths[keep], inputs.lookup_table[keep],
                                inputs.max_lengths)  # fmt: skip
    want = PagedMetadata.build(alone, torch.cumsum(torch.tensor([0, *q_lens[keep].tolist()]), 0))
    assert tokens.tolist() == [4, 5, 6, 7]
    for name in ("input_row_offsets", "cache_lengths", "lookup_table", "token_request", "token_position",
                 "slot_page", "slot_offset", "kv_lengths"):  # fmt: skip
        assert torch.equal(getattr(sub, name), getattr(want, name)), name


@pytest.mark.parametrize("cached", [[20, 20, 20], [20, 5, 13, 0]], ids=["one length: no mask", "ragged"])
@pytest.mark.parametrize("group_bytes", [None, 1])
def test_decode_batched_plans_once_and_matches_the_reference(
    cached: list[int], group_bytes: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stale NaN past every request's keys never gets in, with or without the key mask; the plan (groups, page
    rows, masks, the gather buffer) is built by the first layer and reused by the second."""
    if group_bytes is not None:
        monkeypatch.setattr(torch_decode, "_BATCH_KV_BYTES", group_bytes)  # one token per group
    inputs, offsets, query, key, value = make_step(4, cached, [1] * len(cached), heads=2, group=3)
    meta = PagedMetadata.build(inputs, offsets)
    torch_ops.store_kv(inputs.blocks, key, value, meta, 0, None)
    torch_ops.store_kv(inputs.blocks, key, value, meta, 1, None)
    scale = 1 / math.sqrt(8)
    for layer in (0, 1):
        got = torch_decode.decode_batched(query, inputs.blocks, meta, layer, scale, None, AttentionOptions())
        want = paged_attention_reference(query, inputs.blocks, inputs.lookup_table, inputs.cache_lengths, offsets,
                                         layer)  # fmt: skip
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    plans = [p for k, p in meta.plans.items() if k[0] == "decode_batched"]
    assert len(plans) == 1
    masks = [g.mask is not None for g in plans[0].groups]
    assert any(masks) == (len(set(cached)) > 1 and group_bytes is None)
