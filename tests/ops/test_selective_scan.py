"""`selective_scan` (batched steps over requests) equals `selective_scan_reference` (per-token loop) and
transformers' Mamba torch scan; state slots hold final states, others stay untouched."""

from __future__ import annotations

import pytest
import torch

from pagedkv.ops.conv_state import causal_conv1d
from pagedkv.ops.selective_scan import selective_scan, selective_scan_reference

ATOL = 1e-5
NUM_SLOTS = 12


def _offsets(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)  # [B + 1]


def random_step(gen: torch.Generator, lengths: list[int], d_inner: int, n: int) -> dict[str, torch.Tensor]:
    """Packed x/dt/z [T, D_inner], b/c [T, N], a [D_inner, N], d/delta_bias [D_inner] and offsets [B + 1]."""
    t = sum(lengths)
    a_log = torch.log(torch.arange(1, n + 1, dtype=torch.float32)).expand(d_inner, n)  # S4D-real init
    return {
        "x": torch.randn(t, d_inner, generator=gen),
        "dt": torch.randn(t, d_inner, generator=gen) - 2.0,  # pre-softplus, as dt_proj gives it
        "a": -torch.exp(a_log + 0.1 * torch.randn(d_inner, n, generator=gen)),
        "b": torch.randn(t, n, generator=gen),
        "c": torch.randn(t, n, generator=gen),
        "input_row_offsets": _offsets(lengths),
    }


def options(gen: torch.Generator, step: dict[str, torch.Tensor], full: bool) -> dict[str, torch.Tensor | bool]:
    """The Mamba mixer's options (D skip, z gate, dt bias + softplus), or none (dt taken as given)."""
    if not full:
        return {"dt": torch.nn.functional.softplus(step["dt"])}  # overrides step's raw dt
    d_inner = step["x"].shape[1]
    return {
        "d": torch.randn(d_inner, generator=gen),
        "z": torch.randn(step["x"].shape, generator=gen),
        "delta_bias": 0.5 * torch.randn(d_inner, generator=gen),
        "delta_softplus": True,
    }


def random_state(gen: torch.Generator, d_inner: int, n: int) -> torch.Tensor:
    return torch.randn(NUM_SLOTS, d_inner, n, generator=gen)


def slots_for(gen: torch.Generator, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct slots [B] and a has_state mix [B]."""
    slots = torch.randperm(NUM_SLOTS, generator=gen)[:batch].to(torch.int64)
    return slots, torch.rand(batch, generator=gen) < 0.5


@pytest.mark.parametrize("seed", range(10))
def test_fast_equals_reference_on_ragged_batches(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    batch = int(torch.randint(1, 8, (1,), generator=gen))
    lengths = torch.randint(1, 61, (batch,), generator=gen).tolist()
    lengths[0] = 1  # always a decode request beside the prefills
    if batch > 2:
        lengths[1] = 60
    d_inner, n = int(torch.randint(1, 25, (1,), generator=gen)), int(torch.randint(1, 17, (1,), generator=gen))
    step = random_step(gen, lengths, d_inner, n)
    step.update(options(gen, step, full=seed % 2 == 0))
    slots, has_state = slots_for(gen, batch)
    state = random_state(gen, d_inner, n)
    ref_state, fast_state = state.clone(), state.clone()
    ref = selective_scan_reference(**step, state=ref_state, slots=slots, has_state=has_state)  # type: ignore[arg-type]
    fast = selective_scan(**step, state=fast_state, slots=slots, has_state=has_state)  # type: ignore[arg-type]
    assert fast.shape == (sum(lengths), d_inner) and fast.dtype == torch.float32
    torch.testing.assert_close(fast, ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(fast_state, ref_state, atol=ATOL, rtol=0)
    untouched = [s for s in range(NUM_SLOTS) if s not in slots.tolist()]
    assert torch.equal(fast_state[untouched], state[untouched])
    assert torch.equal(ref_state[untouched], state[untouched])


def test_decode_only_and_empty_requests() -> None:
    gen = torch.Generator().manual_seed(1)
    lengths = [1, 0, 1, 1, 0]
    step = random_step(gen, lengths, 6, 4)
    step.update(options(gen, step, full=True))
    slots, _ = slots_for(gen, len(lengths))
    has_state = torch.tensor([True, True, False, True, False])
    state = random_state(gen, 6, 4)
    ref_state, fast_state = state.clone(), state.clone()
    ref = selective_scan_reference(**step, state=ref_state, slots=slots, has_state=has_state)  # type: ignore[arg-type]
    fast = selective_scan(**step, state=fast_state, slots=slots, has_state=has_state)  # type: ignore[arg-type]
    torch.testing.assert_close(fast, ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(fast_state, ref_state, atol=ATOL, rtol=0)
    assert torch.equal(fast_state[slots[1]], state[slots[1]])  # empty with state: kept as it was
    assert torch.equal(fast_state[slots[4]], torch.zeros_like(state[0]))  # empty without state: zeros
    untouched = [s for s in range(NUM_SLOTS) if s not in slots.tolist()]
    assert torch.equal(fast_state[untouched], state[untouched])
    empty = random_step(gen, [], 6, 4)
    none = (torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.bool))
    s = state.clone()
    assert selective_scan(**empty, state=s, slots=none[0], has_state=none[1]).shape == (0, 6)
    assert torch.equal(s, state)


def test_no_state_ignores_nonfinite_garbage() -> None:
    """A fresh request never reads its slot, even if the slot holds NaN/inf."""
    gen = torch.Generator().manual_seed(4)
    step = random_step(gen, [5, 1], 4, 3)
    state = torch.full((3, 4, 3), float("nan"))
    args = {"slots": torch.tensor([2, 0]), "has_state": torch.tensor([False, False])}
    for fn in (selective_scan, selective_scan_reference):
        s = state.clone()
        out = fn(**step, state=s, **args, delta_softplus=True)
        assert torch.isfinite(out).all() and torch.isfinite(s[[0, 2]]).all()
        assert s[1].isnan().all()


def test_bf16_inputs() -> None:
    gen = torch.Generator().manual_seed(2)
    step = random_step(gen, [5, 40], 8, 4)
    step.update(options(gen, step, full=True))
    slots, has_state = torch.tensor([3, 7]), torch.tensor([True, False])
    state = random_state(gen, 8, 4)
    half = {
        k: v.to(torch.bfloat16) if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in step.items()
    }
    ref_state, fast_state = state.clone(), state.clone()
    ref = selective_scan_reference(**half, state=ref_state, slots=slots, has_state=has_state)  # type: ignore[arg-type]
    fast = selective_scan(**half, state=fast_state, slots=slots, has_state=has_state)  # type: ignore[arg-type]
    assert fast.dtype == torch.bfloat16 and fast_state.dtype == torch.float32
    torch.testing.assert_close(fast.float(), ref.float(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(fast_state, ref_state, atol=ATOL, rtol=0)


@pytest.mark.parametrize("seed", range(4))
def test_chunked_prefill_across_calls_equals_one_call(seed: int) -> None:
    """Requests fed in pieces cut at odd places (the later calls continuing from the slot) give the
    outputs and final states of one call over the whole requests."""
    gen = torch.Generator().manual_seed(100 + seed)
    d_inner, n = 8, 6
    lengths = [60, 33, 1, 45]
    whole = random_step(gen, lengths, d_inner, n)
    opts = options(gen, whole, full=True)
    slots, has_state = slots_for(gen, len(lengths))
    state = random_state(gen, d_inner, n)
    one_state = state.clone()
    one = selective_scan(**whole, **opts, state=one_state, slots=slots, has_state=has_state)  # type: ignore[arg-type]

    cuts = [[0, 17, 18, 60], [0, 5, 5, 33], [0, 1, 1, 1], [0, 43, 44, 45]]  # per request: its pieces' bounds
    if seed % 2:
        cuts = [[0, 1, 56, 60], [0, 32, 33, 33], [0, 0, 1, 1], [0, 2, 3, 45]]
    fn = selective_scan if seed < 2 else selective_scan_reference
    piece_state = state.clone()
    starts = whole["input_row_offsets"].tolist()
    outputs: list[list[torch.Tensor]] = [[] for _ in lengths]
    for call in range(3):
        rows = [torch.arange(starts[r] + cut[call], starts[r] + cut[call + 1]) for r, cut in enumerate(cuts)]
        take = torch.cat(rows)
        piece = {name: whole[name][take] for name in ("x", "dt", "b", "c")}
        offsets = _offsets([len(rr) for rr in rows])
        cont = has_state if call == 0 else has_state | torch.tensor([cut[call] > 0 for cut in cuts])
        out = fn(
            **piece,
            a=whole["a"],
            d=opts["d"],  # type: ignore[arg-type]
            z=opts["z"][take],  # type: ignore[index]
            delta_bias=opts["delta_bias"],  # type: ignore[arg-type]
            delta_softplus=True,
            state=piece_state,
            slots=slots,
            has_state=cont,
            input_row_offsets=offsets,
        )
        for r in range(len(lengths)):
            outputs[r].append(out[offsets[r] : offsets[r + 1]])
    joined = torch.cat([torch.cat(o) for o in outputs])
    torch.testing.assert_close(joined, one, atol=ATOL, rtol=0)
    torch.testing.assert_close(piece_state, one_state, atol=ATOL, rtol=0)


@pytest.mark.parametrize("length", [1, 7, 33])
def test_single_request_equals_transformers_functions(length: int) -> None:
    """transformers' torch ``mamba_selective_scan`` (zero initial state, [B, D, L] layout) for a prefill,
    then its ``mamba_selective_state_update`` for decode tokens continuing from the state."""
    mamba = pytest.importorskip("transformers.models.mamba.modeling_mamba")
    gen = torch.Generator().manual_seed(length)
    d_inner, n, decode = 8, 4, 3
    step = random_step(gen, [length + decode], d_inner, n)
    opts = options(gen, step, full=True)
    d, z, bias = opts["d"], opts["z"], opts["delta_bias"]
    assert isinstance(d, torch.Tensor) and isinstance(z, torch.Tensor) and isinstance(bias, torch.Tensor)
    x, dt, a, b, c = step["x"], step["dt"], step["a"], step["b"], step["c"]
    hf_out, hf_state = mamba.mamba_selective_scan(
        x[:length].T[None], dt[:length].T[None], a, b[:length].T[None], c[:length].T[None],
        D=d, z=z[:length].T[None], delta_bias=bias, delta_softplus=True, return_last_state=True,
    )  # fmt: skip  # [1, D_inner, L], [1, D_inner, N]
    hf_outs = [hf_out[0].T]
    for t in range(length, length + decode):
        hf_outs.append(
            mamba.mamba_selective_state_update(
                hf_state,
                x[t][None],
                dt[t][None],
                a,
                b[t][None],
                c[t][None],
                d,
                dt_bias=bias,
                dt_softplus=True,
                z=z[t][None],
            )  # fmt: skip  # [1, D_inner]; updates hf_state in place
        )
    expected = torch.cat(hf_outs)  # [L + decode, D_inner]

    for fn in (selective_scan, selective_scan_reference):
        state = random_state(gen, d_inner, n)
        slot = torch.tensor([5])
        kw = {"d": d, "delta_bias": bias, "delta_softplus": True, "state": state, "slots": slot}
        prefill = fn(
            x[:length], dt[:length], a, b[:length], c[:length], z=z[:length], has_state=torch.tensor([False]),
            input_row_offsets=_offsets([length]), **kw,
        )  # fmt: skip
        outs = [prefill]
        for t in range(length, length + decode):
            outs.append(
                fn(
                    x[t : t + 1],
                    dt[t : t + 1],
                    a,
                    b[t : t + 1],
                    c[t : t + 1],
                    z=z[t : t + 1],
                    has_state=torch.tensor([True]),
                    input_row_offsets=_offsets([1]),
                    **kw,
                )  # fmt: skip
            )
        torch.testing.assert_close(torch.cat(outs), expected, atol=ATOL, rtol=0)
        torch.testing.assert_close(state[5], hf_state[0], atol=ATOL, rtol=0)


@pytest.mark.parametrize("lengths", [[9], [1, 23, 6]])
def test_mixer_end_to_end_equals_transformers(lengths: list[int]) -> None:
    """transformers' MambaMixer (eval, no cache: its torch conv and scan) on each request alone equals
    in_proj -> `causal_conv1d` -> x_proj / dt_proj -> `selective_scan` (bias, softplus, D, z) -> out_proj
    over the ragged batch."""
    mamba = pytest.importorskip("transformers.models.mamba.modeling_mamba")
    from transformers import MambaConfig

    config = MambaConfig(
        hidden_size=16, state_size=4, intermediate_size=32, conv_kernel=4, time_step_rank=4, num_hidden_layers=1
    )
    torch.manual_seed(0)
    mixer = mamba.MambaMixer(config, layer_idx=0).eval()
    gen = torch.Generator().manual_seed(sum(lengths))
    hidden = torch.randn(sum(lengths), config.hidden_size, generator=gen)  # [T, H]
    offsets = _offsets(lengths)
    batch = len(lengths)
    slots, no_state = torch.arange(batch) + 2, torch.zeros(batch, dtype=torch.bool)
    with torch.no_grad():
        bounds = offsets.tolist()
        expected = torch.cat([mixer(hidden[None, bounds[r] : bounds[r + 1]])[0] for r in range(batch)])

        xs, gate = mixer.in_proj(hidden).chunk(2, dim=-1)  # [T, D_inner] each
        conv_state = torch.zeros(NUM_SLOTS, config.intermediate_size, config.conv_kernel - 1)
        xs = causal_conv1d(
            xs, conv_state, mixer.conv1d.weight.squeeze(1), mixer.conv1d.bias, slots, no_state, offsets, "silu"
        )  # [T, D_inner]
        time_step, b, c = torch.split(
            mixer.x_proj(xs), [config.time_step_rank, config.state_size, config.state_size], -1
        )
        dt = time_step @ mixer.dt_proj.weight.T  # [T, D_inner], bias left to the scan
        state = torch.zeros(NUM_SLOTS, config.intermediate_size, config.state_size)
        y = selective_scan(
            xs, dt, -torch.exp(mixer.A_log.float()), b, c, state, slots, no_state, offsets,
            d=mixer.D, z=gate, delta_bias=mixer.dt_proj.bias, delta_softplus=True,
        )  # fmt: skip
        ours = mixer.out_proj(y)  # [T, H]
    torch.testing.assert_close(ours, expected, atol=ATOL, rtol=0)
    assert state[2 : 2 + batch].abs().sum() > 0 and not state[:2].any() and not state[2 + batch :].any()


def test_bad_arguments_are_refused() -> None:
    gen = torch.Generator().manual_seed(0)
    step = random_step(gen, [3], 4, 2)
    args = {"slots": torch.tensor([0]), "has_state": torch.tensor([True])}
    with pytest.raises(ValueError, match="float32"):
        selective_scan(**step, state=torch.zeros(2, 4, 2).double(), **args)
    with pytest.raises(ValueError, match="state"):
        selective_scan(**step, state=torch.zeros(2, 4, 3), **args)
    with pytest.raises(ValueError, match="b/c"):
        selective_scan(**{**step, "b": torch.zeros(3, 3)}, state=torch.zeros(2, 4, 2), **args)
    with pytest.raises(ValueError, match="z"):
        selective_scan(**step, state=torch.zeros(2, 4, 2), **args, z=torch.zeros(3, 5))
    with pytest.raises(ValueError, match="has_state"):
        selective_scan(**step, state=torch.zeros(2, 4, 2), slots=torch.tensor([0]), has_state=torch.tensor([1]))
