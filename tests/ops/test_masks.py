"""Masking options of `paged_attention` (sliding window, chunks, sink tokens, learned sinks, MLA value
width, cross-attention): the vectorised torch paths against the reference, on the ragged batches of a
real `PagedKVCacheManager` (test_ops.ragged_steps), plus the decode loop's promise that it never gathers
a page outside a token's visible ranges and the dispatcher's Triton guard.

Windows and chunks scale with the page size so they always cut the (2 pages + 2 token) prompts.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_ops import LAYER, Step, attention, make_manager, ragged_steps, store_both, torch_outputs

from pagedkv import ops
from pagedkv.dtype import DType
from pagedkv.ops import torch_decode
from pagedkv.ops.metadata import PagedMetadata
from pagedkv.params import KVCacheQuantizationConfig


def sinks_for(num_q_heads: int) -> torch.Tensor:
    """Learned sink logits [H_q] around the logits' scale, so the sink takes a real share."""
    return torch.linspace(-1.5, 2.5, num_q_heads)


CONFIGS: dict[str, Any] = {  # name -> page_size -> options (sinks: True = `sinks_for` H_q)
    "window": lambda ps: {"sliding_window": ps + 2},
    "chunk": lambda ps: {"chunk_size": ps + 1},
    "window+sink_tokens": lambda ps: {"sliding_window": ps + 1, "sink_tokens": 2},
    "window+chunk": lambda ps: {"sliding_window": ps + 2, "chunk_size": 2 * ps + 1},
    "sinks": lambda ps: {"sinks": True},
    "gpt-oss: window+sinks+softcap": lambda ps: {"sliding_window": ps + 2, "sinks": True, "softcap": 1.5},
    "gemma2: window+scale+softcap": lambda ps: {"sliding_window": ps + 2, "scale": 0.2, "softcap": 2.0},
    "chunk+sinks+sink_tokens": lambda ps: {"chunk_size": ps + 1, "sinks": True, "sink_tokens": 1},
}


def options_for(config: str, page_size: int, num_q_heads: int) -> dict[str, Any]:
    kwargs = dict(CONFIGS[config](page_size))
    if kwargs.get("sinks") is True:
        kwargs["sinks"] = sinks_for(num_q_heads)
    return kwargs


def check_against_reference(
    mgr: Any, group: int, monkeypatch: pytest.MonkeyPatch, kwargs: dict[str, Any], atol: float = 1e-5
) -> float:
    """Every torch path equals the reference on every step; returns max |options - plain attention|."""
    bite = 0.0
    for step in ragged_steps(mgr, group, seed=mgr.page_size):
        store_both(step)
        want = attention(step, "reference", **kwargs)
        assert want.isfinite().all()
        for name, got in torch_outputs(step, monkeypatch, **kwargs).items():
            torch.testing.assert_close(got, want, atol=atol, rtol=atol, msg=lambda m, name=name: f"{name}: {m}")
        if want.shape == step.query.shape:
            bite = max(bite, (want - attention(step, "torch")).abs().max().item())
    return bite


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_options_match_reference(page_size: int, group: int, config: str, monkeypatch: pytest.MonkeyPatch) -> None:
    mgr = make_manager(page_size)
    bite = check_against_reference(mgr, group, monkeypatch, options_for(config, page_size, 2 * group))
    assert bite > 1e-3, "the option changed nothing: the window / chunk / sink does not bite"


def test_options_in_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    kwargs = {"sliding_window": 5, "sink_tokens": 1, "sinks": sinks_for(8)}
    for step in ragged_steps(make_manager(3, dtype=DType.bfloat16), 4, dtype=torch.bfloat16):
        store_both(step)
        want = attention(step, "reference", **kwargs)
        for got in torch_outputs(step, monkeypatch, **kwargs).values():
            torch.testing.assert_close(got, want, atol=1.6e-2, rtol=1.6e-2)  # as test_torch_matches_reference_bf16


@pytest.mark.parametrize("softcap", [None, 3.0])
def test_fp8_cache_with_options(softcap: float | None, monkeypatch: pytest.MonkeyPatch) -> None:
    quant = KVCacheQuantizationConfig(DType.float32, 16)
    mgr = make_manager(3, head_dim=32, dtype=DType.float8_e4m3fn, quant=quant)
    kwargs = {"sliding_window": 4, "sink_tokens": 2, "sinks": sinks_for(8), "v_head_dim": 24, "softcap": softcap}
    assert check_against_reference(mgr, 4, monkeypatch, kwargs) == 0.0  # v_head_dim: no plain output to compare


@pytest.mark.parametrize("page_size", [1, 3])
def test_mla_values_are_the_first_v_head_dim_of_the_latent(page_size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    mgr = make_manager(page_size, n_kv_heads=1, head_dim=12, is_mla=True)
    kwargs = {"v_head_dim": 8, "sliding_window": page_size + 2, "sinks": sinks_for(4), "scale": 0.3}
    for step in ragged_steps(mgr, 4):
        store_both(step)
        want = attention(step, "reference", **kwargs)
        assert want.shape == (step.query.shape[0], 4, 8)
        for got in torch_outputs(step, monkeypatch, **kwargs).values():
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        full = attention(step, "torch", **{**kwargs, "v_head_dim": None})  # V = the whole slot
        torch.testing.assert_close(full[..., :8], want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("sinks", [False, True])
def test_cross_attention_sees_exactly_the_cache(sinks: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    kwargs: dict[str, Any] = {"causal": False, "sinks": sinks_for(8) if sinks else None, "softcap": 2.0}
    for i, step in enumerate(ragged_steps(make_manager(3), 4)):
        store_both(step)
        want = attention(step, "reference", **kwargs)
        if i == 0:  # a fresh prompt: an empty cache, nothing to attend
            assert torch.equal(want, torch.zeros_like(want))
        for got in torch_outputs(step, monkeypatch, **kwargs).values():
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        # the step's own keys (stored above) stay invisible: garbage there changes nothing
        meta = PagedMetadata.build(step.inputs, step.offsets)
        saved = step.inputs.blocks[meta.slot_page, :, LAYER, meta.slot_offset].clone()
        step.inputs.blocks[meta.slot_page, :, LAYER, meta.slot_offset] = float("nan")
        torch.testing.assert_close(attention(step, "torch", **kwargs), want, atol=1e-5, rtol=1e-5)
        step.inputs.blocks[meta.slot_page, :, LAYER, meta.slot_offset] = saved


def visible(k: int, q: int, window: int | None, chunk: int | None, sink_tokens: int) -> bool:
    """transformers' causal + sliding-window / chunked overlays, with StreamingLLM sink tokens."""
    local = (window is None or k > q - window) and (chunk is None or k // chunk == q // chunk)
    return k <= q and (local or k < sink_tokens)


def drop_unseen_pages(step: Step, kwargs: dict[str, Any]) -> set[int]:
    """Point every lookup-table entry no query of its request can see at the null page (as a windowed cache
    does for the pages it freed); returns the pages dropped."""
    ps, lut = step.inputs.blocks.shape[3], step.inputs.lookup_table
    null, dropped = step.inputs.blocks.shape[0] - 1, set()
    window, chunk, sinks = kwargs.get("sliding_window"), kwargs.get("chunk_size"), kwargs.get("sink_tokens", 0)
    for b, cached in enumerate(step.inputs.cache_lengths.tolist()):
        queries = range(cached, cached + int(step.offsets[b + 1] - step.offsets[b]))
        for p in range(queries[-1] // ps + 1):
            if not any(visible(k, q, window, chunk, sinks) for k in range(p * ps, (p + 1) * ps) for q in queries):
                dropped.add(int(lut[b, p]))
                lut[b, p] = null
    return dropped


class GatherSpy:
    """Stands in for `torch` inside `torch_decode`, recording every page row `index_select` gathers."""

    def __init__(self) -> None:
        self.rows: list[int] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    def index_select(self, source: torch.Tensor, dim: int, index: torch.Tensor, **kw: Any) -> torch.Tensor:
        self.rows.extend(index.tolist())
        return torch.index_select(source, dim, index, **kw)


NULL_PAGE_CONFIGS = {  # small windows: even page size 16 frees a page of these short requests
    "window": {"sliding_window": 3},
    "window+sink_tokens": {"sliding_window": 3, "sink_tokens": 1},
    "chunk": {"chunk_size": 5},
    "gpt-oss: window+sinks+softcap": {"sliding_window": 2, "sinks": sinks_for(8), "softcap": 1.5},
}


@pytest.mark.parametrize("config", list(NULL_PAGE_CONFIGS))
@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_pages_outside_every_window_are_never_read(page_size: int, config: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    mgr = make_manager(page_size)
    blocks = mgr.get_device_buffer().values[0]
    kwargs, dropped_any = NULL_PAGE_CONFIGS[config], False
    for step in ragged_steps(mgr, 4):
        store_both(step)
        want = attention(step, "reference", **kwargs)
        lut = step.inputs.lookup_table.clone()
        dropped = drop_unseen_pages(step, kwargs)
        dropped_any |= bool(dropped)
        blocks[-1] = float("nan")  # the null page now stands in for every freed page
        try:
            torch.testing.assert_close(attention(step, "reference", **kwargs), want, atol=0, rtol=0)
            spy = GatherSpy()
            with monkeypatch.context() as m:
                m.setattr(torch_decode, "torch", spy)
                outs = torch_outputs(step, monkeypatch, **kwargs)
            for name, got in outs.items():
                assert got.isfinite().all(), name
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
            # a dropped position now maps to the null page: never gathered means never read
            read = {row // (blocks.shape[1] * blocks.shape[2]) for row in spy.rows}
            assert blocks.shape[0] - 1 not in read, "the decode loop gathered a page outside every window"
            assert bool(spy.rows) == step.decode
        finally:
            blocks[-1] = 0.0
            step.inputs.lookup_table.copy_(lut)
    assert dropped_any, "no page fell out of the window: the test proves nothing"


def test_dispatcher_never_picks_triton_with_options(monkeypatch: pytest.MonkeyPatch) -> None:
    from pagedkv.ops import triton_decode

    step = next(ragged_steps(make_manager(3), 2))
    store_both(step)
    monkeypatch.setattr(ops, "_triton_usable", lambda query, meta: True)
    monkeypatch.setattr(triton_decode, "paged_decode", lambda *a, **k: (_ for _ in ()).throw(AssertionError("triton")))
    options: list[dict[str, Any]] = [
        {"sliding_window": 4}, {"chunk_size": 4}, {"sink_tokens": 1}, {"sinks": sinks_for(4)},
        {"v_head_dim": 4}, {"causal": False},
    ]  # fmt: skip
    for kwargs in options:
        want = attention(step, "reference", **kwargs)
        torch.testing.assert_close(attention(step, "auto", **kwargs), want, atol=1e-5, rtol=1e-5)
        name = next(iter(kwargs)) if "causal" not in kwargs else "causal=False"
        with pytest.raises(ValueError, match=f"backend='triton' does not implement {name}"):
            attention(step, "triton", **kwargs)
    with pytest.raises(AssertionError, match="triton"):
        attention(step, "auto")  # no option: the (faked) Triton path is taken


def test_invalid_options_are_rejected() -> None:
    step = next(ragged_steps(make_manager(3), 2))
    bad: list[tuple[dict[str, Any], type[Exception], str]] = [
        ({"sliding_window": 0}, ValueError, "sliding_window=0 must be at least 1"),
        ({"chunk_size": 2.0}, TypeError, "chunk_size=2.0 must be an int"),
        ({"sink_tokens": -1}, ValueError, "sink_tokens=-1 must be at least 0"),
        ({"v_head_dim": 9}, ValueError, "v_head_dim=9 must be at most head_dim=8"),
        ({"sinks": torch.zeros(3)}, ValueError, r"sinks shape \(3,\) != \[H_q=4\]"),
        ({"causal": False, "sliding_window": 2}, ValueError, "causal=False .* takes no sliding_window"),
    ]
    for backend in ("reference", "torch"):
        for kwargs, error, match in bad:
            with pytest.raises(error, match=match):
                attention(step, backend, **kwargs)
    meta = PagedMetadata.build(step.inputs, step.offsets)
    with pytest.raises(ValueError, match="causal=False but the metadata was built with causal=True"):
        ops.paged_attention(step.query, step.inputs, step.offsets, LAYER, metadata=meta, causal=False)
    cross = PagedMetadata.build(step.inputs, step.offsets, causal=False)
    assert torch.equal(cross.kv_lengths, cross.cache_lengths) and not cross.causal
    with pytest.raises(ValueError, match="store_kv needs causal metadata"):
        ops.store_kv(step.key, step.value, step.inputs, step.offsets, LAYER, metadata=cross)
