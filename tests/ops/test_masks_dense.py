"""The reference's masking options against dense attention written here with transformers' formulas, and
the absorbed-MLA identity through the paged op.

`dense_hf` is eager attention on contiguous K/V: ``logits = q @ k^T * scale``, soft-capped, plus an
additive mask (``finfo.min`` where hidden, as transformers' eager masks), then either a softmax or
gpt-oss' sink handling (concatenate the sink logit, subtract the row max, softmax, drop the sink).
`test_dense_hf_is_transformers` checks it against transformers' own mask overlays and eager
attention functions, so the chain reference == dense == transformers holds.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from pagedkv import ops
from pagedkv.ops.reference import paged_attention_reference
from pagedkv.runtime.inputs import RaggedKVCacheInputs, max_lengths_table


def hf_mask(q_pos: torch.Tensor, num_keys: int, window: int | None = None, chunk: int | None = None,
            sink_tokens: int = 0, causal: bool = True) -> torch.Tensor:  # fmt: skip
    """bool [Q, S]: causal ``k <= q``, sliding ``k > q - W``, chunked ``k // C == q // C``; sink tokens ``k < S``."""
    q, k = q_pos[:, None], torch.arange(num_keys)[None, :]
    if not causal:
        return torch.ones(q.shape[0], num_keys, dtype=torch.bool)
    local = torch.ones_like(k <= q)
    if window is not None:
        local &= k > q - window
    if chunk is not None:
        local &= k // chunk == q // chunk
    return (k <= q) & (local | (k < sink_tokens))


def dense_hf(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
             softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """q [Q, H_q, D], k [S, H_kv, D], v [S, H_kv, Dv], mask bool [Q, S] -> [Q, H_q, Dv] (float32)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # transformers' repeat_kv
    logits = torch.einsum("qhd,shd->hqs", q, k) * scale  # [H_q, Q, S]
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    logits = logits + torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    if sinks is None:
        probs = torch.softmax(logits, dim=-1)
    else:
        combined = torch.cat([logits, sinks.reshape(-1, 1, 1).expand(-1, q.shape[0], 1)], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        probs = torch.softmax(combined, dim=-1)[..., :-1]
    return torch.einsum("hqs,shd->qhd", probs, v)


def test_dense_hf_is_transformers() -> None:
    from transformers import masking_utils as mu
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward as gemma2_eager
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward as gpt_oss_eager

    gen = torch.Generator().manual_seed(5)
    q, (k, v) = torch.randn(9, 4, 8, generator=gen), torch.randn(2, 20, 2, 8, generator=gen)
    q_pos, kv = torch.arange(11, 20), torch.arange(20)
    b, h = torch.tensor(0), torch.tensor(0)
    sliding = mu.sliding_window_causal_mask_function(5)(b, h, q_pos[:, None], kv[None])
    chunked = mu.chunked_causal_mask_function(6, torch.zeros(1, dtype=torch.int64))(b, h, q_pos[:, None], kv[None])
    assert torch.equal(sliding, hf_mask(q_pos, 20, window=5)) and torch.equal(chunked, hf_mask(q_pos, 20, chunk=6))
    additive = torch.zeros(sliding.shape).masked_fill(~sliding, torch.finfo(torch.float32).min)[None, None]
    module = SimpleNamespace(num_key_value_groups=2, head_dim=8, training=False, sinks=torch.randn(4, generator=gen))
    hf_in = (q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], additive)
    want, _ = gpt_oss_eager(module, *hf_in, scaling=0.4)  # [1, Q, H_q, D]
    torch.testing.assert_close(dense_hf(q, k, v, sliding, 0.4, sinks=module.sinks), want[0])
    want, _ = gemma2_eager(module, *hf_in, scaling=0.4, softcap=1.5)
    torch.testing.assert_close(dense_hf(q, k, v, sliding, 0.4, softcap=1.5), want[0])


def paged_batch(page_size: int, lengths: list[int], q_lens: list[int], heads: int, dim: int, kv_dim: int = 2,
                seed: int = 0) -> tuple[RaggedKVCacheInputs, torch.Tensor, list[torch.Tensor]]:  # fmt: skip
    """Requests with `lengths` keys in shuffled pages (one layer); the last `q_lens` of each are new this step.

    Returns (inputs, offsets, per-request K/V [kv_dim, S, H, D]).
    """
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // page_size) for n in lengths]
    order = torch.randperm(sum(need), generator=gen)
    blocks = torch.zeros(sum(need) + 1, kv_dim, 1, page_size, heads, dim)
    lut = torch.full((len(lengths), max(need) + 2), sum(need), dtype=torch.int32)  # null-padded
    kvs, first = [], 0
    for b, n in enumerate(lengths):
        lut[b, : need[b]] = order[first : first + need[b]]
        first += need[b]
        kv = torch.randn(kv_dim, n, heads, dim, generator=gen)
        pos = torch.arange(n)
        blocks[lut[b, pos // page_size].long(), :, 0, pos % page_size] = kv.transpose(0, 1)
        kvs.append(kv)
    cache = torch.tensor([n - t for n, t in zip(lengths, q_lens, strict=True)], dtype=torch.int32)
    offsets = torch.cumsum(torch.tensor([0, *q_lens]), 0)
    inputs = RaggedKVCacheInputs(blocks, cache, lut, max_lengths_table(max(q_lens), max(lengths)))
    return inputs, offsets, kvs


CASES: list[dict[str, Any]] = [
    {"sliding_window": 4},
    {"chunk_size": 5},
    {"sliding_window": 3, "sink_tokens": 2},
    {"sliding_window": 6, "chunk_size": 4},
    {"sinks": True},
    {"sliding_window": 4, "sinks": True, "softcap": 1.2},
    {"sliding_window": 5, "scale": 0.15, "softcap": 2.0},
    {"chunk_size": 4, "sinks": True, "sink_tokens": 1, "v_head_dim": 5},
    {"causal": False},
    {"causal": False, "sinks": True, "softcap": 1.0},
]


@pytest.mark.parametrize("case", CASES, ids=[",".join(sorted(c)) for c in CASES])
def test_reference_matches_dense_hf(case: dict[str, Any]) -> None:
    heads, group, dim, page_size = 2, 3, 8, 3
    lengths, q_lens = [17, 12, 9], [6, 1, 9]  # a prefill chunk, a decode, a whole prompt
    inputs, offsets, kvs = paged_batch(page_size, lengths, q_lens, heads, dim)
    gen = torch.Generator().manual_seed(7)
    query = torch.randn(int(offsets[-1]), heads * group, dim, generator=gen)
    kwargs = dict(case, sinks=torch.randn(heads * group, generator=gen)) if case.get("sinks") else dict(case)
    scale, softcap, sinks = kwargs.pop("scale", 1 / math.sqrt(dim)), kwargs.pop("softcap", None), kwargs.get("sinks")
    out = paged_attention_reference(query, inputs.blocks, inputs.lookup_table, inputs.cache_lengths, offsets, 0,
                                    scale, softcap, **kwargs)  # fmt: skip
    with ops.use_backend("torch"):
        got = ops.paged_attention(query, inputs, offsets, 0, scale=scale, softcap=softcap, **kwargs)
    v_dim = kwargs.get("v_head_dim") or dim
    for b, (kv, n) in enumerate(zip(kvs, lengths, strict=True)):
        cached, rows = n - q_lens[b], slice(int(offsets[b]), int(offsets[b + 1]))
        causal = kwargs.get("causal", True)
        num_keys = n if causal else cached
        mask = hf_mask(torch.arange(cached, n), num_keys, kwargs.get("sliding_window"), kwargs.get("chunk_size"),
                       kwargs.get("sink_tokens", 0), causal)  # fmt: skip
        want = dense_hf(query[rows], kv[0, :num_keys], kv[1, :num_keys, :, :v_dim], mask, scale, softcap, sinks)
        torch.testing.assert_close(out[rows], want, msg=lambda m, b=b: f"request {b}: {m}")
        torch.testing.assert_close(got[rows], want, msg=lambda m, b=b: f"torch, request {b}: {m}")


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_absorbed_mla_equals_expanded_attention(backend: str) -> None:
    # latent c [S, Dc] and shared rope key r [S, Dr] are cached as one slot [c, r]; per head h the expanded
    # attention has k_h = [c @ W_uk[h]^T, r] and v_h = c @ W_uv[h]^T. Absorbed: q = [q_nope @ W_uk[h], q_rope],
    # values = c (the first Dc elements of the slot), output @ W_uv[h]^T.
    latent, rope, nope, v_dim, heads, page_size = 8, 4, 6, 5, 4, 3
    lengths, q_lens = [13, 7], [5, 1]
    inputs, offsets, kvs = paged_batch(page_size, lengths, q_lens, 1, latent + rope, kv_dim=1, seed=3)
    gen = torch.Generator().manual_seed(11)
    w_uk, w_uv = torch.randn(heads, nope, latent, generator=gen), torch.randn(heads, v_dim, latent, generator=gen)
    q_nope, q_rope = torch.randn(6, heads, nope, generator=gen), torch.randn(6, heads, rope, generator=gen)
    scale = 1 / math.sqrt(nope + rope)
    absorbed_q = torch.cat([torch.einsum("thn,hnc->thc", q_nope, w_uk), q_rope], dim=-1)  # [T, H, Dc + Dr]
    with ops.use_backend(backend):
        out = ops.paged_attention(absorbed_q, inputs, offsets, 0, scale=scale, v_head_dim=latent)  # [T, H, Dc]
    out = torch.einsum("thc,hvc->thv", out, w_uv)  # [T, H, Dv]
    for b, (kv, n) in enumerate(zip(kvs, lengths, strict=True)):
        c, r = kv[0, :, 0, :latent], kv[0, :, 0, latent:]  # [S, Dc], [S, Dr]
        k = torch.cat([torch.einsum("sc,hnc->shn", c, w_uk), r[:, None].expand(-1, heads, -1)], dim=-1)  # [S, H, D]
        v = torch.einsum("sc,hvc->shv", c, w_uv)  # [S, H, Dv]
        rows = slice(int(offsets[b]), int(offsets[b + 1]))
        q = torch.cat([q_nope[rows], q_rope[rows]], dim=-1)
        want = dense_hf(q, k, v, hf_mask(torch.arange(n - q_lens[b], n), n), scale)
        torch.testing.assert_close(out[rows], want, atol=1e-4, rtol=1e-4)


def test_store_kv_without_value_on_a_kv_cache_is_refused() -> None:
    """K+V pages need both: a missing V would leave stale values for `paged_attention` to read."""
    inputs, offsets, _ = paged_batch(3, [5, 4], [5, 4], 2, 8)
    before = inputs.blocks.clone()
    key = torch.randn(9, 2, 8)
    for backend in ("reference", "torch"):
        with ops.use_backend(backend), pytest.raises(ValueError, match=r"value is None but the cache stores K and V"):
            ops.store_kv(key, None, inputs, offsets, 0)
        assert torch.equal(inputs.blocks, before), backend


@pytest.mark.parametrize("kwargs", [{"sliding_window": 8, "sink_tokens": 3}, {"chunk_size": 8, "sinks": True}])
def test_padded_path_gathers_only_the_window(kwargs: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    # Long contexts, a small window, a prefill chunk and a decode: every page no query sees points at the
    # null page (NaN); the general path gathers a sink page plus ceil((4 + 8 - 2) / 4) + 1 = 4 window pages.
    from pagedkv.ops import torch_ops, torch_padded

    page_size, lengths, q_lens = 4, [203, 150], [4, 1]
    inputs, offsets, _ = paged_batch(page_size, lengths, q_lens, 2, 8, seed=9)
    query = torch.randn(5, 4, 8, generator=torch.Generator().manual_seed(2))
    kwargs = dict(kwargs, sinks=torch.linspace(-1, 1, 4)) if kwargs.get("sinks") else kwargs
    with ops.use_backend("reference"):
        want = ops.paged_attention(query, inputs, offsets, 0, **kwargs)
    null, window, sink_tokens = inputs.blocks.shape[0] - 1, kwargs.get("sliding_window"), kwargs.get("sink_tokens", 0)
    for b, n in enumerate(lengths):
        mask = hf_mask(torch.arange(n - q_lens[b], n), n, window, kwargs.get("chunk_size"), sink_tokens)
        seen = mask.any(dim=0)  # [S]: seen by some query of the request
        for p in range(-(-n // page_size)):
            if not seen[p * page_size : (p + 1) * page_size].any():
                inputs.lookup_table[b, p] = null
    inputs.blocks[null] = float("nan")
    gathered: list[int] = []
    read_pages = torch_padded.read_pages
    monkeypatch.setattr(torch_padded, "read_pages", lambda *a: gathered.append(a[1].shape[1]) or read_pages(*a))
    monkeypatch.setattr(torch_ops, "_LOOP_MIN_KEYS", 10**9)  # the decode request too
    with ops.use_backend("torch"):
        got = ops.paged_attention(query, inputs, offsets, 0, **kwargs)
    torch.testing.assert_close(got, want)
    assert got.isfinite().all() and set(gathered) == {(1 if sink_tokens else 0) + 4}
