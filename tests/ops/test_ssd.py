"""`ssd_scan` (chunked / batched recurrent) equals `ssd_reference` (per-token loop) and transformers' Mamba2
torch path (its chunk scan, its decode step, and the whole mixer); state slots hold final states, others
stay untouched."""

from __future__ import annotations

import math

import pytest
import torch

from pagedkv.ops.conv_state import causal_conv1d
from pagedkv.ops.ssd import segment_sum, ssd_reference, ssd_scan

ATOL = 1e-5
NUM_SLOTS = 12


def random_step(gen: torch.Generator, lengths: list[int], h: int, g: int, p: int, n: int) -> dict[str, torch.Tensor]:
    """Packed x [T, H, P], raw dt [T, H], A/D/dt_bias [H], B/C [T, G, N] and offsets [B + 1] for `lengths`."""
    t = sum(lengths)
    return {
        "x": torch.randn(t, h, p, generator=gen),
        "dt": torch.randn(t, h, generator=gen),
        "A": -torch.exp(torch.rand(h, generator=gen) * 2 - 1.5),  # -exp(A_log), A_log in [-1.5, 0.5)
        "B": torch.randn(t, g, n, generator=gen) * n**-0.5,
        "C": torch.randn(t, g, n, generator=gen) * n**-0.5,
        "D": torch.randn(h, generator=gen),
        "dt_bias": torch.randn(h, generator=gen) - 1,
        "input_row_offsets": torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32),
    }


def random_state(gen: torch.Generator, h: int, p: int, n: int) -> torch.Tensor:
    return torch.randn(NUM_SLOTS, h, p, n, generator=gen)


def slots_for(gen: torch.Generator, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct slots [B] and a has_state mix [B]."""
    slots = torch.randperm(NUM_SLOTS, generator=gen)[:b].to(torch.int64)
    return slots, torch.rand(b, generator=gen) < 0.5


def test_segment_sum() -> None:
    x = torch.randn(3, 5)
    seg = segment_sum(x)  # [3, 5, 5]
    for l_pos in range(5):
        for s_pos in range(5):
            want = x[:, s_pos + 1 : l_pos + 1].sum(-1) if s_pos <= l_pos else torch.full((3,), -math.inf)
            torch.testing.assert_close(seg[:, l_pos, s_pos], want)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("chunk_size", [256, 16])
def test_fast_equals_reference_on_ragged_batches(seed: int, chunk_size: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    b = int(torch.randint(1, 7, (1,), generator=gen))
    lengths = torch.randint(1, 71, (b,), generator=gen).tolist()
    lengths[0] = 1  # always a decode request beside the prefills
    if b > 2:
        lengths[1] = 70  # always a request cut into chunks (with chunk_size 16)
    g = int(torch.randint(1, 3, (1,), generator=gen))
    h = g * int(torch.randint(1, 3, (1,), generator=gen))  # heads sharing groups too; H 1..4
    p, n = (int(v) for v in torch.randint(4, 17, (2,), generator=gen))
    step = random_step(gen, lengths, h, g, p, n)
    limit = (0.0, math.inf) if seed % 2 == 0 else (0.05, 1.5)  # clamping active on odd seeds
    slots, has_state = slots_for(gen, b)
    state = random_state(gen, h, p, n)
    ref_state, fast_state = state.clone(), state.clone()
    ref = ssd_reference(**step, state=ref_state, slots=slots, has_state=has_state, time_step_limit=limit)
    fast = ssd_scan(
        **step, state=fast_state, slots=slots, has_state=has_state, time_step_limit=limit, chunk_size=chunk_size
    )
    assert fast.shape == (sum(lengths), h, p) and fast.dtype == torch.float32
    torch.testing.assert_close(fast, ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(fast_state, ref_state, atol=ATOL, rtol=0)
    untouched = [s for s in range(NUM_SLOTS) if s not in slots.tolist()]
    assert torch.equal(fast_state[untouched], state[untouched])
    assert torch.equal(ref_state[untouched], state[untouched])


def test_decode_only_and_empty_requests() -> None:
    gen = torch.Generator().manual_seed(1)
    lengths = [1, 0, 1, 1, 0]
    step = random_step(gen, lengths, 4, 2, 8, 6)
    slots, _ = slots_for(gen, len(lengths))
    has_state = torch.tensor([True, True, False, True, False])
    state = random_state(gen, 4, 8, 6)
    ref_state, fast_state = state.clone(), state.clone()
    ref = ssd_reference(**step, state=ref_state, slots=slots, has_state=has_state)
    fast = ssd_scan(**step, state=fast_state, slots=slots, has_state=has_state)
    torch.testing.assert_close(fast, ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(fast_state, ref_state, atol=ATOL, rtol=0)
    assert torch.equal(fast_state[slots[1]], state[slots[1]])  # empty with state: kept as it was
    assert torch.equal(fast_state[slots[4]], torch.zeros_like(state[0]))  # empty without state: zeros


def test_no_d_no_bias_no_softplus_and_bf16_inputs() -> None:
    gen = torch.Generator().manual_seed(2)
    step = random_step(gen, [5, 40, 1], 2, 1, 8, 8)
    step["D"] = None  # type: ignore[assignment]
    step["dt"] = torch.nn.functional.softplus(step.pop("dt_bias") + step["dt"])  # already discretised
    slots, has_state = torch.tensor([3, 7, 0]), torch.tensor([True, False, True])
    state = random_state(gen, 2, 8, 8)
    ref_state, fast_state = state.clone(), state.clone()
    ref = ssd_reference(**step, state=ref_state, slots=slots, has_state=has_state, dt_softplus=False)
    fast = ssd_scan(**step, state=fast_state, slots=slots, has_state=has_state, dt_softplus=False, chunk_size=8)
    torch.testing.assert_close(fast, ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(fast_state, ref_state, atol=ATOL, rtol=0)
    half = {name: v.to(torch.bfloat16) if v is not None and v.is_floating_point() else v for name, v in step.items()}
    out = ssd_scan(**half, state=state.clone(), slots=slots, has_state=has_state, dt_softplus=False)
    assert out.dtype == torch.bfloat16


@pytest.mark.parametrize("seed", range(4))
def test_chunked_prefill_across_calls_equals_one_call(seed: int) -> None:
    """Requests fed in pieces cut at odd places (the later calls continuing from the slot) give the
    outputs and final states of one call over the whole requests."""
    gen = torch.Generator().manual_seed(100 + seed)
    h, g, p, n = 4, 2, 8, 12
    lengths = [70, 33, 1, 65]
    whole = random_step(gen, lengths, h, g, p, n)
    params = {name: whole[name] for name in ("A", "D", "dt_bias")}
    slots, has_state = slots_for(gen, len(lengths))
    state = random_state(gen, h, p, n)
    one_state = state.clone()
    one = ssd_scan(**whole, state=one_state, slots=slots, has_state=has_state, chunk_size=16)

    cuts = [[0, 17, 18, 70], [0, 5, 5, 33], [0, 1, 1, 1], [0, 63, 64, 65]]  # per request: its pieces' bounds
    if seed % 2:
        cuts = [[0, 1, 66, 70], [0, 32, 33, 33], [0, 0, 1, 1], [0, 2, 3, 65]]
    piece_state = state.clone()
    starts = whole["input_row_offsets"].tolist()
    outputs: list[list[torch.Tensor]] = [[] for _ in lengths]
    for call in range(3):
        rows = [torch.arange(starts[b] + c[call], starts[b] + c[call + 1]) for b, c in enumerate(cuts)]
        sizes = [len(r) for r in rows]
        take = torch.cat(rows)
        piece = {name: whole[name][take] for name in ("x", "dt", "B", "C")}
        offsets = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()])
        cont = has_state if call == 0 else has_state | torch.tensor([c[call] > 0 for c in cuts])
        out = ssd_scan(
            **piece, **params, state=piece_state, slots=slots, has_state=cont, input_row_offsets=offsets, chunk_size=16
        )
        for b in range(len(lengths)):
            outputs[b].append(out[offsets[b] : offsets[b + 1]])
    joined = torch.cat([torch.cat(o) for o in outputs])
    torch.testing.assert_close(joined, one, atol=ATOL, rtol=0)
    torch.testing.assert_close(piece_state, one_state, atol=ATOL, rtol=0)


def _mamba2() -> object:
    return pytest.importorskip("transformers.models.mamba2.modeling_mamba2")


@pytest.mark.parametrize("length", [1, 7, 16, 70, 130])
@pytest.mark.parametrize("limit", [(0.0, math.inf), (0.05, 1.5)])
def test_single_request_equals_transformers_chunk_scan(length: int, limit: tuple[float, float]) -> None:
    mamba2 = _mamba2()
    gen = torch.Generator().manual_seed(length)
    h, g, p, n, chunk = 4, 2, 8, 16, 32
    step = random_step(gen, [length], h, g, p, n)
    state = random_state(gen, h, p, n)
    slot = torch.tensor([5])
    hf_out, hf_state = mamba2.mamba2_chunk_scan(  # type: ignore[attr-defined]
        step["x"][None], step["dt"][None], step["A"], step["B"][None], step["C"][None], chunk_size=chunk,
        D=step["D"], dt_bias=step["dt_bias"], initial_states=state[5:6].clone(), dt_softplus=True, dt_limit=limit,
        return_final_states=True,
    )  # fmt: skip  # [1, T, H, P], [1, H, P, N]
    for fn, kwargs in ((ssd_scan, {"chunk_size": chunk}), (ssd_scan, {}), (ssd_reference, {})):
        ours_state = state.clone()
        ours = fn(**step, state=ours_state, slots=slot, has_state=torch.tensor([True]), time_step_limit=limit, **kwargs)
        torch.testing.assert_close(ours, hf_out[0], atol=ATOL, rtol=0)
        torch.testing.assert_close(ours_state[5], hf_state[0], atol=ATOL, rtol=0)


def test_decode_equals_transformers_selective_state_update() -> None:
    """The mixer's decode call: transformers expands dt, A, D and dt_bias over P (and A over N)."""
    mamba2 = _mamba2()
    gen = torch.Generator().manual_seed(3)
    h, g, p, n = 6, 3, 4, 8
    lengths = [1, 1, 1]
    step = random_step(gen, lengths, h, g, p, n)
    state = random_state(gen, h, p, n)
    slots, has_state = torch.tensor([9, 2, 4]), torch.tensor([True, True, True])
    hf_state = state[slots].clone()  # [B, H, P, N]
    hf_out = mamba2.mamba2_selective_state_update(  # type: ignore[attr-defined]
        hf_state, step["x"], step["dt"][..., None].expand(-1, -1, p), step["A"][:, None, None].expand(-1, p, n),
        step["B"], step["C"], step["D"][:, None].expand(-1, p), z=None,
        dt_bias=step["dt_bias"][:, None].expand(-1, p), dt_softplus=True,
    )  # fmt: skip  # [B, H, P]
    for fn in (ssd_scan, ssd_reference):
        ours_state = state.clone()
        ours = fn(**step, state=ours_state, slots=slots, has_state=has_state)
        torch.testing.assert_close(ours, hf_out, atol=ATOL, rtol=0)
        torch.testing.assert_close(ours_state[slots], hf_state, atol=ATOL, rtol=0)


@pytest.mark.parametrize("length", [5, 40])
def test_mixer_forward_equals_transformers(length: int) -> None:
    """The whole Mamba2 mixer of transformers (no cache: its chunk scan from a zero state) equals its
    own projections and gated norm around `causal_conv1d` and `ssd_scan` fed the mixer's weights."""
    mamba2 = _mamba2()
    from transformers import Mamba2Config

    torch.manual_seed(length)
    config = Mamba2Config(
        hidden_size=16, num_heads=4, head_dim=8, expand=2, n_groups=2, state_size=8, conv_kernel=4, chunk_size=16,
        num_hidden_layers=1, vocab_size=32, time_step_limit=(0.0, float("inf")),
    )  # fmt: skip
    mixer = mamba2.Mamba2Mixer(config, layer_idx=0).eval()  # type: ignore[attr-defined]
    with torch.no_grad():
        mixer.A_log.copy_(torch.randn(4) * 0.5)
        mixer.D.copy_(torch.randn(4))
        hidden = torch.randn(1, length, 16)
        want = mixer(hidden)[0]  # [T, hidden]

        inter, gn, h, p = mixer.intermediate_size, config.n_groups * config.state_size, 4, 8
        gate, xbc, dt = mixer.in_proj(hidden[0]).split([inter, mixer.conv_dim, h], dim=-1)
        offsets = torch.tensor([0, length])
        conv_state = torch.zeros(1, mixer.conv_dim, config.conv_kernel - 1)
        one, no_state = torch.tensor([0]), torch.tensor([False])
        xbc = causal_conv1d(
            xbc, conv_state, mixer.conv1d.weight.squeeze(1), mixer.conv1d.bias, one, no_state, offsets, "silu"
        )
        x, b, c = xbc.split([inter, gn, gn], dim=-1)
        state = torch.randn(1, h, p, config.state_size)  # garbage: has_state False must not read it
        y = ssd_scan(
            x.view(length, h, p), dt, -torch.exp(mixer.A_log), b.view(length, 2, -1), c.view(length, 2, -1), mixer.D,
            state, one, no_state, offsets, dt_bias=mixer.dt_bias, time_step_limit=config.time_step_limit,
            chunk_size=config.chunk_size,
        )  # fmt: skip
        ours = mixer.out_proj(mixer.norm(y.reshape(1, length, inter), gate[None]))[0]
    torch.testing.assert_close(ours, want, atol=ATOL, rtol=0)


def test_bad_arguments_are_refused() -> None:
    gen = torch.Generator().manual_seed(0)
    step = random_step(gen, [3], 3, 2, 4, 4)  # H 3 is not a multiple of G 2
    with pytest.raises(ValueError, match="multiple"):
        ssd_scan(**step, state=torch.zeros(2, 3, 4, 4), slots=torch.tensor([0]), has_state=torch.tensor([True]))
    step = random_step(gen, [3], 2, 2, 4, 4)
    with pytest.raises(ValueError, match="float32"):
        ssd_scan(
            **step, state=torch.zeros(2, 2, 4, 4).double(), slots=torch.tensor([0]), has_state=torch.tensor([True])
        )
    with pytest.raises(ValueError, match="bool"):
        ssd_scan(**step, state=torch.zeros(2, 2, 4, 4), slots=torch.tensor([0]), has_state=torch.tensor([0]))
    with pytest.raises(ValueError, match="chunk_size"):
        ssd_scan(
            **step, state=torch.zeros(2, 2, 4, 4), slots=torch.tensor([0]), has_state=torch.tensor([True]), chunk_size=0
        )


def test_a_decode_step_takes_the_batched_recurrent_path() -> None:
    """Every request with one token (row b is request b): the same output and states as the reference."""
    gen = torch.Generator().manual_seed(3)
    lengths = [1, 1, 1, 1]
    step = random_step(gen, lengths, 4, 2, 8, 6)
    slots, _ = slots_for(gen, len(lengths))
    has_state = torch.tensor([True, False, True, True])
    state = random_state(gen, 4, 8, 6)
    ref_state, fast_state = state.clone(), state.clone()
    ref = ssd_reference(**step, state=ref_state, slots=slots, has_state=has_state)
    fast = ssd_scan(**step, state=fast_state, slots=slots, has_state=has_state)
    torch.testing.assert_close(fast, ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(fast_state, ref_state, atol=ATOL, rtol=0)
