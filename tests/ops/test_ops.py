"""Paged KV ops: the vectorised torch path against the slow reference, on batches from a real manager.

Every check goes through the public `pagedkv.ops.store_kv` / `paged_attention`
with `use_backend("reference")` and `use_backend("torch")`, so the dispatcher
is exercised too. `ragged_steps` (also used by test_fp8.py) drives a
`PagedKVCacheManager` with prefix caching through a prefill, two mixed
prefill + decode steps (a prefix-cache hit and a chunked prefill) and a
decode-only step.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from helpers import ctx
from pagedkv import ops
from pagedkv.dtype import DeviceRef, DType
from pagedkv.manager.paged import PagedKVCacheManager
from pagedkv.ops import torch_decode, torch_ops, torch_padded
from pagedkv.ops.metadata import PagedMetadata
from pagedkv.ops.reference import paged_attention_reference, store_kv_reference
from pagedkv.params import KVCacheParams, KVCacheQuantizationConfig
from pagedkv.runtime.inputs import RaggedKVCacheInputs, max_lengths_table

LAYER = 1  # of 2: every check also proves layer 0 is left alone


@dataclass
class Step:
    """One forward pass: the device inputs, the batch's row offsets and its random Q/K/V."""

    inputs: RaggedKVCacheInputs
    offsets: torch.Tensor  # int64 [B + 1]
    query: torch.Tensor  # [T, H_q, D]
    key: torch.Tensor  # [T, H_kv, D]
    value: torch.Tensor | None  # [T, H_kv, D]; None for MLA
    decode: bool  # every request has one new token


def make_manager(page_size: int, n_kv_heads: int = 2, head_dim: int = 8, dtype: DType = DType.float32,
                 quant: KVCacheQuantizationConfig | None = None, is_mla: bool = False) -> PagedKVCacheManager:  # fmt: skip
    params = KVCacheParams(
        dtype=dtype, n_kv_heads=n_kv_heads, head_dim=head_dim, num_layers=2, devices=[DeviceRef.CPU()],
        page_size=page_size, enable_prefix_caching=True, kvcache_quant_config=quant, is_mla=is_mla,
        num_q_heads=n_kv_heads if is_mla else None,
    )  # fmt: skip
    return PagedKVCacheManager(params, None, 96, enable_runtime_checks=True, max_batch_size=4)


def ragged_steps(
    mgr: PagedKVCacheManager, group: int, seed: int = 0, dtype: torch.dtype = torch.float32
) -> Iterator[Step]:
    """Yield four steps; the caller stores each step's K/V before the next one is built.

    a: prefill of 2 pages + 2 tokens; then [b, c, a]: b shares a's first 2 pages
    + 1 token (prefix-cache hit on the committed pages), c is a fresh prompt
    prefilled in two chunks, a decodes; then [a, b, c] (c's second chunk);
    then [a, b, c] all decoding. No prompt length is a multiple of the page size.
    """
    ps, params = mgr.page_size, mgr.params
    assert isinstance(params, KVCacheParams)
    heads, dim = params.n_kv_heads_per_device, params.head_dim
    gen = torch.Generator().manual_seed(seed)
    prompt = list(range(100, 100 + 2 * ps + 2))
    a, b, c = ctx("a", prompt), ctx("b", [*prompt[: 2 * ps + 1], 7, 8]), ctx("c", range(500, 500 + ps + 4))
    schedule = [[a], [b, c, a], [a, b, c], [a, b, c]]
    for i, batch in enumerate(schedule):
        for r in batch:
            if not mgr.contains(r.request_id):
                mgr.claim(r.request_id)
                if r is c:
                    r.tokens.chunk(ps // 2 + 1)
            mgr.alloc(r)
        if i == 1:
            assert b.cached_prefix_length == (2 * ps + 1) // ps * ps, "b must hit the pages it shares with a"
        lengths = torch.tensor([0] + [r.tokens.active_length for r in batch])
        offsets = torch.cumsum(lengths, 0)  # [B + 1]
        inputs = mgr.runtime_inputs([batch]).inputs[0]
        assert isinstance(inputs, RaggedKVCacheInputs)
        q, k, v = (
            torch.randn(int(offsets[-1]), n, dim, generator=gen).to(dtype) for n in (heads * group, heads, heads)
        )
        yield Step(inputs, offsets, q, k, None if params.is_mla else v, decode=bool((lengths[1:] == 1).all()))
        for r in batch:
            r.update(1)
        mgr.step([batch])


def store_both(step: Step) -> None:
    """Store the step's K/V with the reference into a copy and with torch into the cache; bit-identical."""
    inputs = step.inputs
    copy = dataclasses.replace(
        inputs, blocks=inputs.blocks.clone(), kv_scales=None if inputs.kv_scales is None else inputs.kv_scales.clone()
    )
    with ops.use_backend("reference"):
        ops.store_kv(step.key, step.value, copy, step.offsets, LAYER)
    with ops.use_backend("torch"):
        ops.store_kv(step.key, step.value, inputs, step.offsets, LAYER)
    assert torch.equal(copy.blocks.view(torch.uint8), inputs.blocks.view(torch.uint8))
    if inputs.kv_scales is not None:
        assert copy.kv_scales is not None
        assert torch.equal(copy.kv_scales.view(torch.uint8), inputs.kv_scales.view(torch.uint8))


def attention(step: Step, backend: str, **kwargs: Any) -> torch.Tensor:
    with ops.use_backend(backend):
        return ops.paged_attention(step.query, step.inputs, step.offsets, LAYER, **kwargs)


NO_BATCH = {"torch_ops._DECODE_BATCHED": False}
TORCH_PATHS = {  # torch_ops knobs ("module.attr") that force each code path on these small batches
    "default": {},
    "decode batched": {"torch_ops._LOOP_MIN_KEYS": 1},
    "decode batched, one token per group": {"torch_ops._LOOP_MIN_KEYS": 1, "torch_decode._BATCH_KV_BYTES": 1},
    "decode loop": {**NO_BATCH, "torch_ops._LOOP_MIN_KEYS": 1},
    "decode loop, one page per chunk": {
        **NO_BATCH,
        "torch_ops._LOOP_MIN_KEYS": 1,
        "torch_decode._CHUNK_KV_BYTES": 1,
    },  # fmt: skip
    "decode loop, explicit chunks": {
        **NO_BATCH,
        "torch_ops._LOOP_MIN_KEYS": 1,
        "torch_decode._CHUNK_KV_BYTES": 1,
        "torch_decode._FLASH": None,
    },  # fmt: skip
    "padded, one request and query row per block": {
        **NO_BATCH,
        "torch_padded._CHUNK_BYTES": 1,
        "torch_ops._LOOP_MIN_KEYS": 10**9,
    },  # fmt: skip
}
KNOB_MODULES = {"torch_ops": torch_ops, "torch_decode": torch_decode, "torch_padded": torch_padded}


def expected_paths(step: Step, kwargs: dict[str, Any]) -> dict[str, str]:
    """The decode path each `TORCH_PATHS` setting must take: "batched" (full attention, no softcap, sinks or
    ALiBi), "loop", or "other" (the padded path: prefill steps, and the default's small decode batches)."""
    if not step.decode:
        return {}
    plain = all(kwargs.get(k) is None for k in ("softcap", "sinks", "alibi_slopes", "sliding_window", "chunk_size"))
    want = {n: "loop" for n in TORCH_PATHS if n.startswith(("decode", "default"))}
    for name in ("default", "decode batched", "decode batched, one token per group"):
        want[name] = "batched" if plain else "loop"
    if not plain and _small(step):
        del want["default"]  # few keys: the padded path
    return want


def _small(step: Step) -> bool:
    """Whether the step's longest key window is under `_LOOP_MIN_KEYS` (the default then pads)."""
    lengths = step.inputs.cache_lengths + (step.offsets[1:] - step.offsets[:-1])  # [B]
    return int(lengths.max()) < torch_ops._LOOP_MIN_KEYS


def torch_outputs(step: Step, monkeypatch: pytest.MonkeyPatch, **kwargs: Any) -> dict[str, torch.Tensor]:
    """The torch backend's output under every `TORCH_PATHS` setting (checking which decode path each took)."""
    outs, taken = {}, {}
    decode_loop, decode_batched = torch_ops._decode_loop, torch_ops._decode_batched
    for name, knobs in TORCH_PATHS.items():
        with monkeypatch.context() as m:
            for knob, value in knobs.items():
                module, attr = knob.split(".")
                m.setattr(KNOB_MODULES[module], attr, value)
            m.setattr(torch_ops, "_decode_loop", lambda *a, name=name: taken.update({name: "loop"}) or decode_loop(*a))
            m.setattr(
                torch_ops,
                "_decode_batched",
                lambda *a, name=name: taken.update({name: "batched"}) or decode_batched(*a),
            )
            outs[name] = attention(step, "torch", **kwargs)
    assert taken == expected_paths(step, kwargs)
    return outs


def check_steps(mgr: PagedKVCacheManager, group: int, monkeypatch: pytest.MonkeyPatch, atol: float, rtol: float,
                dtype: torch.dtype = torch.float32, **kwargs: Any) -> None:  # fmt: skip
    for step in ragged_steps(mgr, group, seed=mgr.page_size, dtype=dtype):
        store_both(step)
        want = attention(step, "reference", **kwargs)
        assert want.dtype == dtype and want.shape == step.query.shape
        for name, got in torch_outputs(step, monkeypatch, **kwargs).items():
            torch.testing.assert_close(got, want, atol=atol, rtol=rtol, msg=lambda m, name=name: f"{name}: {m}")
    assert not mgr.get_device_buffer().values[0][:, :, 1 - LAYER].any(), "the other layer was written"


@pytest.mark.parametrize("softcap", [None, 1.5])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_torch_matches_reference_fp32(page_size: int, group: int, softcap: float | None,
                                      monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    check_steps(make_manager(page_size), group, monkeypatch, atol=1e-5, rtol=1e-5, softcap=softcap)


@pytest.mark.parametrize("softcap", [None, 1.5])
def test_torch_matches_reference_bf16(softcap: float | None, monkeypatch: pytest.MonkeyPatch) -> None:
    # The reference rounds a float32 result to bf16 (error <= 1/2 ulp = 2^-9 relative); SDPA's bf16 path
    # also rounds the softmax weights to bf16 before P @ V. Measured max error 7.8e-3 (one bf16 ulp near 1).
    mgr = make_manager(3, dtype=DType.bfloat16)
    check_steps(mgr, 4, monkeypatch, atol=1.6e-2, rtol=1.6e-2, dtype=torch.bfloat16, softcap=softcap)


def test_mla_reads_v_from_the_k_slot(monkeypatch: pytest.MonkeyPatch) -> None:
    check_steps(make_manager(3, n_kv_heads=1, is_mla=True), 4, monkeypatch, atol=1e-5, rtol=1e-5, scale=0.3)


def test_stale_nan_in_unread_slots_never_reaches_the_output(monkeypatch: pytest.MonkeyPatch) -> None:
    mgr = make_manager(3)
    blocks = mgr.get_device_buffer().values[0]
    for step in ragged_steps(mgr, 4):
        blocks[-1] = float("nan")  # the null page pads every lookup table row
        store_both(step)
        want = attention(step, "reference")
        for got in torch_outputs(step, monkeypatch).values():
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_reference_on_a_hand_checkable_case() -> None:
    # One request, page size 2, pages in the order [2, 0], 1 KV head of dim 1, 2 query heads (GQA 2).
    # k = [0, ln 3, 5], v = [4, 8, 100]; queries at positions 1 and 2 (position 0 is cached).
    blocks = torch.zeros(4, 2, 1, 2, 1, 1)  # [P + 1, kv, L, page_size, H_kv, D]
    lut, lengths, offsets = torch.tensor([[2, 0, 3]]), torch.tensor([1]), torch.tensor([0, 2])
    blocks[2, :, 0, 0, 0, 0] = torch.tensor([0.0, 4.0])  # position 0 -> page 2, slot 0
    store_kv_reference(blocks, torch.tensor([[[math.log(3)]], [[5.0]]]), torch.tensor([[[8.0]], [[100.0]]]),
                       lut, lengths, offsets, 0)  # fmt: skip
    assert blocks[2, :, 0, 1].flatten().tolist() == pytest.approx([math.log(3), 8.0])  # position 1: page 2 slot 1
    assert blocks[0, :, 0, 0].flatten().tolist() == [5.0, 100.0]  # position 2: page 0, slot 0
    query = torch.tensor([[[1.0], [0.0]], [[0.0], [0.0]]])  # [T=2, H_q=2, D=1]
    out = paged_attention_reference(query, blocks, lut, lengths, offsets, 0, scale=1.0)
    # position 1, head 0: logits [0, ln 3] -> weights [1/4, 3/4] -> 1 + 6; head 1: logits [0, 0] -> 6
    # position 2, both heads: logits 0 -> the mean of [4, 8, 100]
    assert out.flatten().tolist() == pytest.approx([7.0, 6.0, 112 / 3, 112 / 3])
    capped = paged_attention_reference(query, blocks, lut, lengths, offsets, 0, scale=1.0, softcap=0.5)
    w = 1 / (1 + math.exp(0.5 * math.tanh(math.log(3) / 0.5)))  # weight of position 0
    assert capped[0, 0, 0].item() == pytest.approx(4 * w + 8 * (1 - w))


def test_reference_matches_softmax_over_contiguous_kv() -> None:
    gen = torch.Generator().manual_seed(1)
    page_size, heads, group, dim, length, cached = 4, 2, 3, 8, 11, 7
    k, v = torch.randn(2, length, heads, dim, generator=gen)  # [S, H_kv, D] each
    query = torch.randn(length - cached, heads * group, dim, generator=gen)  # [T, H_q, D]
    pages = torch.tensor([5, 1, 3, 6])  # scattered; page 6 is the null page
    blocks = torch.zeros(7, 2, 1, page_size, heads, dim)
    pos = torch.arange(length)
    blocks[pages[pos // page_size], 0, 0, pos % page_size] = k
    blocks[pages[pos // page_size], 1, 0, pos % page_size] = v
    out = paged_attention_reference(query, blocks, pages[None], torch.tensor([cached]), torch.tensor([0, 4]), 0)
    logits = torch.einsum("thd,shd->ths", query.view(-1, heads, group, dim).flatten(1, 2),
                          k.repeat_interleave(group, dim=1)) / math.sqrt(dim)  # fmt: skip
    causal = pos[None, :] <= (cached + torch.arange(length - cached))[:, None]  # [T, S]
    weights = torch.softmax(logits.masked_fill(~causal[:, None], float("-inf")), dim=-1)  # [T, H_q, S]
    torch.testing.assert_close(out, torch.einsum("ths,shd->thd", weights, v.repeat_interleave(group, dim=1)))


def test_dispatcher_backend_selection_and_metadata_reuse() -> None:
    with pytest.raises(ValueError, match="backend='cuda' must be one of"):
        ops.set_backend("cuda")
    with ops.use_backend("reference"):
        with pytest.raises(RuntimeError), ops.use_backend("torch"):
            assert ops._backend == "torch"
            raise RuntimeError
        assert ops._backend == "reference"
    assert ops._backend == "auto"
    steps = ragged_steps(make_manager(3), 2)
    for _ in range(2):
        step = next(steps)
        meta = PagedMetadata.build(step.inputs, step.offsets, step.key.shape[0])
        with ops.use_backend("auto"):  # CPU: auto means torch
            ops.store_kv(step.key, step.value, step.inputs, step.offsets, LAYER, metadata=meta)
            got = ops.paged_attention(step.query, step.inputs, step.offsets, LAYER, metadata=meta)
        torch.testing.assert_close(got, attention(step, "reference"), atol=1e-5, rtol=1e-5)


def test_entry_points_reject_bad_shapes_for_every_backend() -> None:
    """The checks live at the entry points (`pagedkv.ops.checks`); the torch backend does not repeat them."""
    step = next(ragged_steps(make_manager(3), 2))
    meta = PagedMetadata.build(step.inputs, step.offsets)
    blocks = step.inputs.blocks
    mla = RaggedKVCacheInputs(torch.zeros(blocks.shape[0], 1, *blocks.shape[2:]), step.inputs.cache_lengths,
                              step.inputs.lookup_table, step.inputs.max_lengths)  # fmt: skip
    for backend in ("reference", "torch"):
        with ops.use_backend(backend):
            with pytest.raises(ValueError, match=r"query shape \(8, 3, 8\) != \[T, H_q, D=8\] with H_q a multiple"):
                ops.paged_attention(step.query[:, :3], step.inputs, step.offsets, LAYER, metadata=meta)
            with pytest.raises(ValueError, match=r"query has 3 tokens but the batch's input_row_offsets end at 8"):
                ops.paged_attention(step.query[:3], step.inputs, step.offsets, LAYER, metadata=meta)
            with pytest.raises(ValueError, match=r"key shape \(8, 2, 4\) != \[T, H_kv, D\]"):
                ops.store_kv(step.key[..., :4], None, step.inputs, step.offsets, LAYER, metadata=meta)
            with pytest.raises(ValueError, match="value given for a cache with kv_dim=1"):
                ops.store_kv(step.key, step.value, mla, step.offsets, LAYER, metadata=meta)


def test_empty_batch() -> None:
    blocks = torch.zeros(3, 2, 1, 4, 2, 8)
    inputs = RaggedKVCacheInputs(blocks, torch.zeros(0, dtype=torch.int32), torch.zeros(0, 16, dtype=torch.int32),
                                 max_lengths_table(0, 0))  # fmt: skip
    offsets = torch.zeros(1, dtype=torch.int64)
    with ops.use_backend("torch"):
        ops.store_kv(torch.zeros(0, 2, 8), torch.zeros(0, 2, 8), inputs, offsets, 0)
        assert ops.paged_attention(torch.zeros(0, 4, 8), inputs, offsets, 0).shape == (0, 4, 8)


def test_attention_bench_smoke() -> None:
    from pagedkv.bench.attention_bench import format_attention_report, run_attention_bench

    result = run_attention_bench(batch=3, context=50, n_kv_heads=2, n_q_heads=4, head_dim=16, page_size=3,
                                 dtypes=("float32", "bfloat16"), repeats=1, gpu=False)  # fmt: skip
    rows = result["rows"]
    assert [(r["device"], r["dtype"]) for r in rows] == [("cpu", "float32"), ("cpu", "bfloat16")]
    assert rows[0]["max_abs_diff"] < 1e-5 and rows[1]["max_abs_diff"] < 2e-2
    assert all(r["paged_ms"] > 0 and r["ratio"] == r["paged_ms"] / r["contiguous_ms"] for r in rows)
    report = format_attention_report(result)
    assert "| cpu | float32 | torch |" in report and "GPU: skipped: gpu=False" in report
    if not torch.cuda.is_available():
        from pagedkv.bench.attention_bench import gpu_rows

        assert gpu_rows(result["config"], ("float32",), 1) == ([], "skipped: torch.cuda.is_available() is False")
