"""`causal_conv1d` (vectorised) against `causal_conv1d_reference` (loops) and transformers' torch fallback."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from pagedkv.ops.conv_state import causal_conv1d, causal_conv1d_reference

NUM_SLOTS = 12


def _offsets(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)  # [B + 1]


def _random_case(
    gen: torch.Generator, kernel_size: int, dtype: torch.dtype, width: int | None = None
) -> tuple[torch.Tensor, ...]:
    channels = int(torch.randint(1, 17, (1,), generator=gen))
    batch = int(torch.randint(1, 7, (1,), generator=gen))
    lengths = torch.randint(1, 41, (batch,), generator=gen).tolist()
    width = kernel_size - 1 if width is None else width
    x = torch.randn(sum(lengths), channels, generator=gen).to(dtype)  # [T, C]
    conv_state = torch.randn(NUM_SLOTS, channels, width, generator=gen).to(dtype)  # [S, C, W]
    weight = torch.randn(channels, kernel_size, generator=gen).to(dtype)  # [C, K]
    bias = torch.randn(channels, generator=gen).to(dtype)  # [C]
    slots = torch.randperm(NUM_SLOTS, generator=gen)[:batch].to(torch.int32)  # [B]
    has_state = torch.rand(batch, generator=gen) < 0.5  # [B]
    return x, conv_state, weight, bias, slots, has_state, _offsets(lengths)


@pytest.mark.parametrize("kernel_size", [2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", [None, "silu"])
@pytest.mark.parametrize("seed", range(4))
def test_vectorised_matches_reference(kernel_size: int, dtype: torch.dtype, activation: str | None, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed * 100 + kernel_size)
    x, state, weight, bias, slots, has_state, offsets = _random_case(gen, kernel_size, dtype)
    use_bias = bias if seed % 2 == 0 else None
    state_ref, state_vec = state.clone(), state.clone()
    out_ref = causal_conv1d_reference(x, state_ref, weight, use_bias, slots, has_state, offsets, activation)
    out_vec = causal_conv1d(x, state_vec, weight, use_bias, slots, has_state, offsets, activation)
    assert out_vec.dtype == dtype and out_vec.shape == x.shape
    tol = 1e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out_vec, out_ref, atol=tol, rtol=tol)
    assert torch.equal(state_vec, state_ref)  # stored inputs are copies: exact
    untouched = torch.ones(NUM_SLOTS, dtype=torch.bool)
    untouched[slots.long()] = False
    assert torch.equal(state_vec[untouched], state[untouched])
    assert torch.equal(state_ref[untouched], state[untouched])


@pytest.mark.parametrize("width_extra", [0, 1, 3])
def test_wider_state_matches_reference(width_extra: int) -> None:
    """W >= K - 1 (transformers allocates W = K): the slot keeps the last W inputs."""
    gen = torch.Generator().manual_seed(7 + width_extra)
    x, state, weight, bias, slots, has_state, offsets = _random_case(gen, 4, torch.float32, width=3 + width_extra)
    state_ref, state_vec = state.clone(), state.clone()
    out_ref = causal_conv1d_reference(x, state_ref, weight, bias, slots, has_state, offsets, "silu")
    out_vec = causal_conv1d(x, state_vec, weight, bias, slots, has_state, offsets, "silu")
    torch.testing.assert_close(out_vec, out_ref, atol=1e-6, rtol=1e-6)
    assert torch.equal(state_vec, state_ref)


def test_short_chunk_keeps_carried_state() -> None:
    """A chunk shorter than K - 1 shifts the old state left and appends its inputs."""
    state = torch.arange(1.0, 4.0).view(1, 1, 3).repeat(2, 1, 1)  # [2, 1, 3]: slot 0 and 1 = [1, 2, 3]
    x = torch.tensor([[10.0]])  # [1, 1]
    weight = torch.ones(1, 4)
    for fn in (causal_conv1d, causal_conv1d_reference):
        s = state.clone()
        out = fn(x, s, weight, None, torch.tensor([1]), torch.tensor([True]), _offsets([1]))
        assert out.item() == 16.0
        assert s[1, 0].tolist() == [2.0, 3.0, 10.0]
        assert s[0, 0].tolist() == [1.0, 2.0, 3.0]
        s = state.clone()
        out = fn(x, s, weight, None, torch.tensor([1]), torch.tensor([False]), _offsets([1]))
        assert out.item() == 10.0 and s[1, 0].tolist() == [0.0, 0.0, 10.0]


def test_no_state_ignores_nonfinite_garbage() -> None:
    """A fresh request never reads its slot, even if the slot holds NaN/inf."""
    state = torch.full((3, 2, 2), float("nan"))  # [S, C, W]
    x = torch.randn(5, 2)
    weight, bias = torch.randn(2, 3), torch.randn(2)
    s_vec, s_ref = state.clone(), state.clone()
    args = (torch.tensor([2]), torch.tensor([False]), _offsets([5]))
    out_vec = causal_conv1d(x, s_vec, weight, bias, *args)
    out_ref = causal_conv1d_reference(x, s_ref, weight, bias, *args)
    assert torch.isfinite(out_vec).all()
    torch.testing.assert_close(out_vec, out_ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(s_vec, s_ref, equal_nan=True)


@pytest.mark.parametrize("kernel_size", [2, 3, 4])
@pytest.mark.parametrize("fn", [causal_conv1d, causal_conv1d_reference])
def test_chunked_prefill_equals_one_call(kernel_size: int, fn: Callable[..., torch.Tensor]) -> None:
    """The key property: several requests' prompts split into chunks over several calls (chunks of
    1..7 tokens, shorter and longer than K - 1, each request on its own schedule, some requests
    absent from some calls) give the outputs and final state of one call over the whole prompts."""
    gen = torch.Generator().manual_seed(kernel_size)
    channels, lengths = 5, [1, 2, 9, 23, 40]
    prompts = [torch.randn(n, channels, generator=gen) for n in lengths]
    weight, bias = torch.randn(channels, kernel_size, generator=gen), torch.randn(channels, generator=gen)
    slots = [7, 0, 3, 11, 5]

    whole_state = torch.randn(NUM_SLOTS, channels, kernel_size - 1, generator=gen)  # [S, C, K - 1]
    chunked_state = whole_state.clone()
    whole_out = fn(
        torch.cat(prompts), whole_state, weight, bias, torch.tensor(slots),
        torch.zeros(len(slots), dtype=torch.bool), _offsets(lengths), "silu",
    )  # fmt: skip

    done = [0] * len(prompts)
    pieces: list[list[torch.Tensor]] = [[] for _ in prompts]
    while any(d < n for d, n in zip(done, lengths, strict=True)):
        batch = [b for b in range(len(prompts)) if done[b] < lengths[b] and torch.rand(1, generator=gen) < 0.8]
        if not batch:
            continue
        take = [min(int(torch.randint(1, 8, (1,), generator=gen)), lengths[b] - done[b]) for b in batch]
        x = torch.cat([prompts[b][done[b] : done[b] + n] for b, n in zip(batch, take, strict=True)])  # [T, C]
        out = fn(
            x, chunked_state, weight, bias, torch.tensor([slots[b] for b in batch]),
            torch.tensor([done[b] > 0 for b in batch]), _offsets(take), "silu",
        )  # fmt: skip
        for (b, n), piece in zip(zip(batch, take, strict=True), out.split(take), strict=True):
            pieces[b].append(piece)
            done[b] += n
    torch.testing.assert_close(torch.cat([torch.cat(p) for p in pieces]), whole_out, atol=1e-6, rtol=1e-6)
    assert torch.equal(chunked_state, whole_state)


def _transformers_conv() -> tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor]]:
    pytest.importorskip("transformers")
    from transformers.models.qwen3_next import modeling_qwen3_next as qwen3_next

    update, full = qwen3_next.causal_conv1d_update, qwen3_next.causal_conv1d_fn
    if not (update.__module__.startswith("transformers") and full.__module__.startswith("transformers")):
        pytest.skip("transformers resolved causal_conv1d to an external kernel, not its torch fallback")
    return update, full


@pytest.mark.parametrize("kernel_size", [2, 3, 4])
@pytest.mark.parametrize("state_width", ["K-1", "K"])
def test_matches_transformers_qwen3_next_prefill_then_decode(kernel_size: int, state_width: str) -> None:
    """One request through Qwen3-Next's torch conv path: prefill with `causal_conv1d_fn` (state =
    last K inputs of the zero-left-padded prompt, as `update_conv_state` stores it), then decode
    steps with `causal_conv1d_update`. Outputs and the rolling state agree with ours."""
    update, full = _transformers_conv()
    gen = torch.Generator().manual_seed(kernel_size)
    channels, prompt_len, steps = 6, 2, 6  # prompt shorter than K - 1 for K = 4: exercises the padding
    weight, bias = torch.randn(channels, kernel_size, generator=gen), torch.randn(channels, generator=gen)
    prompt = torch.randn(1, channels, prompt_len, generator=gen)  # [1, C, n]
    hf_out = full(prompt, weight, bias, activation="silu")  # [1, C, n]
    hf_state = torch.nn.functional.pad(prompt, (max(kernel_size - prompt_len, 0), 0))[..., -kernel_size:]  # [1, C, K]

    width = kernel_size - 1 if state_width == "K-1" else kernel_size
    state = torch.randn(3, channels, width, generator=gen)  # [S, C, W]
    slot = torch.tensor([2])
    out = causal_conv1d(prompt[0].T, state, weight, bias, slot, torch.tensor([False]), _offsets([prompt_len]), "silu")
    torch.testing.assert_close(out, hf_out[0].T, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(state[2], hf_state[0, :, kernel_size - width :], atol=0, rtol=0)

    for _ in range(steps):
        token = torch.randn(1, channels, 1, generator=gen)  # [1, C, 1]
        hf_step = update(token, hf_state, weight, bias, activation="silu")  # mutates hf_state
        out = causal_conv1d(token[0].T, state, weight, bias, slot, torch.tensor([True]), _offsets([1]), "silu")
        torch.testing.assert_close(out, hf_step[0].T, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(state[2], hf_state[0, :, kernel_size - width :], atol=0, rtol=0)


def test_decode_batch_matches_transformers_update() -> None:
    """A batch of decode tokens (1 per request, scattered slots) == transformers' batched
    `causal_conv1d_update` on the gathered states (W = K, its layout)."""
    update, _ = _transformers_conv()
    gen = torch.Generator().manual_seed(0)
    channels, kernel_size, batch = 8, 4, 5
    weight, bias = torch.randn(channels, kernel_size, generator=gen), torch.randn(channels, generator=gen)
    state = torch.randn(NUM_SLOTS, channels, kernel_size, generator=gen)  # [S, C, K]
    before = state.clone()
    slots = torch.tensor([9, 1, 4, 0, 6])
    x = torch.randn(batch, channels, generator=gen)  # [B, C]
    hf_state = state[slots].clone()  # [B, C, K]
    hf_out = update(x[:, :, None], hf_state, weight, bias, activation="silu")  # [B, C, 1]
    out = causal_conv1d(
        x, state, weight, bias, slots, torch.ones(batch, dtype=torch.bool), _offsets([1] * batch), "silu"
    )
    torch.testing.assert_close(out, hf_out[:, :, 0], atol=1e-6, rtol=1e-6)
    assert torch.equal(state[slots], hf_state)
    others = torch.ones(NUM_SLOTS, dtype=torch.bool)
    others[slots] = False
    assert torch.equal(state[others], before[others])


def test_bad_arguments() -> None:
    x, state, weight = torch.randn(3, 2), torch.zeros(2, 2, 1), torch.randn(2, 3)
    args = (torch.tensor([0]), torch.tensor([False]), _offsets([3]))
    with pytest.raises(ValueError, match="width"):
        causal_conv1d(x, state, weight, None, *args)
    with pytest.raises(ValueError, match="activation"):
        causal_conv1d(x, torch.zeros(2, 2, 2), weight, None, *args, activation="gelu")
    with pytest.raises(ValueError, match="distinct"):
        causal_conv1d_reference(
            torch.randn(2, 2), torch.zeros(2, 2, 2), weight, None,
            torch.tensor([1, 1]), torch.tensor([False, False]), _offsets([1, 1]),
        )  # fmt: skip


def test_empty_requests_and_empty_batch() -> None:
    """A request with no tokens this step still gets its slot set (prior kept, or zeros without
    state); an empty batch changes nothing."""
    gen = torch.Generator().manual_seed(3)
    weight, bias = torch.randn(4, 3, generator=gen), torch.randn(4, generator=gen)
    state = torch.randn(NUM_SLOTS, 4, 2, generator=gen)
    x = torch.randn(6, 4, generator=gen)
    args = (torch.tensor([3, 8, 1, 10]), torch.tensor([True, False, True, False]), _offsets([0, 0, 6, 0]))
    s_vec, s_ref = state.clone(), state.clone()
    out_vec = causal_conv1d(x, s_vec, weight, bias, *args)
    out_ref = causal_conv1d_reference(x, s_ref, weight, bias, *args)
    torch.testing.assert_close(out_vec, out_ref, atol=1e-6, rtol=1e-6)
    assert torch.equal(s_vec, s_ref)
    assert torch.equal(s_vec[3], state[3]) and not s_vec[8].any() and not s_vec[10].any()
    s = state.clone()
    empty = (torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.bool), _offsets([]))
    assert causal_conv1d(torch.zeros(0, 4), s, weight, bias, *empty).shape == (0, 4)
    assert torch.equal(s, state)


@pytest.mark.parametrize("kernel_size", [1, 2, 4])
@pytest.mark.parametrize("width_extra", [0, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_path_matches_reference(kernel_size: int, width_extra: int, dtype: torch.dtype) -> None:
    """``decode=True`` (one token per request, as a decode step promises) equals the reference bit for bit
    in the state and to rounding in the output; other slots are untouched."""
    gen = torch.Generator().manual_seed(kernel_size * 10 + width_extra)
    batch, channels = 5, 6
    width = max(kernel_size - 1, 0) + width_extra
    x = torch.randn(batch, channels, generator=gen).to(dtype)  # [B, C]
    state = torch.randn(NUM_SLOTS, channels, width, generator=gen).to(dtype)  # [S, C, W]
    weight = torch.randn(channels, kernel_size, generator=gen).to(dtype)  # [C, K]
    bias = torch.randn(channels, generator=gen).to(dtype)  # [C]
    slots = torch.randperm(NUM_SLOTS, generator=gen)[:batch].to(torch.int32)  # [B]
    has_state = torch.tensor([True, False, True, True, False])  # [B]
    offsets = _offsets([1] * batch)
    state_ref, state_dec = state.clone(), state.clone()
    out_ref = causal_conv1d_reference(x, state_ref, weight, bias, slots, has_state, offsets, "silu")
    out_dec = causal_conv1d(x, state_dec, weight, bias, slots, has_state, offsets, "silu", decode=True)
    tol = 1e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out_dec, out_ref, atol=tol, rtol=tol)
    assert torch.equal(state_dec, state_ref)
    with pytest.raises(ValueError, match="decode=True needs one token per request"):
        causal_conv1d(x[:3], state_dec, weight, bias, slots, has_state, offsets, decode=True)
