"""`gated_delta_rule` (chunked / batched recurrent) equals `gated_delta_reference` (per-token loop) and
transformers' Qwen3-Next torch gated delta rule; state slots hold final states, others stay untouched."""

from __future__ import annotations

import pytest
import torch

from pagedkv.ops.gated_delta import gated_delta_reference, gated_delta_rule

ATOL = 1e-5
NUM_SLOTS = 12


def random_step(
    gen: torch.Generator, lengths: list[int], h_k: int, h_v: int, d_k: int, d_v: int, normalise_keys: bool
) -> dict[str, torch.Tensor]:
    """Packed q/k [T, H_k, Dk], v [T, H_v, Dv], g/beta [T, H_v] and offsets [B + 1] for `lengths`."""
    t = sum(lengths)
    query = torch.randn(t, h_k, d_k, generator=gen)
    key = torch.randn(t, h_k, d_k, generator=gen)
    if not normalise_keys:  # the rule is stable for beta * |k|^2 <= 2: give unit keys ourselves
        key = key / key.norm(dim=-1, keepdim=True)
    return {
        "query": query,
        "key": key,
        "value": torch.randn(t, h_v, d_v, generator=gen),
        "g": -torch.nn.functional.softplus(torch.randn(t, h_v, generator=gen)),  # log decay <= 0
        "beta": torch.rand(t, h_v, generator=gen),
        "input_row_offsets": torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32),
    }


def random_state(gen: torch.Generator, h_v: int, d_k: int, d_v: int) -> torch.Tensor:
    return torch.randn(NUM_SLOTS, h_v, d_k, d_v, generator=gen)


def slots_for(gen: torch.Generator, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct slots [B] and a has_state mix [B]."""
    slots = torch.randperm(NUM_SLOTS, generator=gen)[:b].to(torch.int64)
    return slots, torch.rand(b, generator=gen) < 0.5


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("chunk_size", [64, 16])
def test_fast_equals_reference_on_ragged_batches(seed: int, chunk_size: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    b = int(torch.randint(1, 7, (1,), generator=gen))
    lengths = torch.randint(1, 71, (b,), generator=gen).tolist()
    lengths[0] = 1  # always a decode request beside the prefills
    if b > 2:
        lengths[1] = 70  # always a request cut into chunks
    h_k = int(torch.randint(1, 3, (1,), generator=gen))
    h_v = h_k * int(torch.randint(1, 3, (1,), generator=gen))  # grouped value heads too; H 1..4
    d_k, d_v = (int(x) for x in torch.randint(4, 17, (2,), generator=gen))
    l2 = seed % 2 == 0
    step = random_step(gen, lengths, h_k, h_v, d_k, d_v, normalise_keys=l2)
    slots, has_state = slots_for(gen, b)
    state = random_state(gen, h_v, d_k, d_v)
    ref_state, fast_state = state.clone(), state.clone()
    ref = gated_delta_reference(**step, state=ref_state, slots=slots, has_state=has_state, use_qk_l2norm_in_kernel=l2)
    fast = gated_delta_rule(
        **step, state=fast_state, slots=slots, has_state=has_state, use_qk_l2norm_in_kernel=l2, chunk_size=chunk_size
    )
    assert fast.shape == (sum(lengths), h_v, d_v) and fast.dtype == torch.float32
    torch.testing.assert_close(fast, ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(fast_state, ref_state, atol=ATOL, rtol=0)
    untouched = [s for s in range(NUM_SLOTS) if s not in slots.tolist()]
    assert torch.equal(fast_state[untouched], state[untouched])
    assert torch.equal(ref_state[untouched], state[untouched])


def test_decode_only_and_empty_requests() -> None:
    gen = torch.Generator().manual_seed(1)
    lengths = [1, 0, 1, 1, 0]
    step = random_step(gen, lengths, 2, 4, 8, 6, normalise_keys=True)
    slots, _ = slots_for(gen, len(lengths))
    has_state = torch.tensor([True, True, False, True, False])
    state = random_state(gen, 4, 8, 6)
    ref_state, fast_state = state.clone(), state.clone()
    ref = gated_delta_reference(**step, state=ref_state, slots=slots, has_state=has_state, use_qk_l2norm_in_kernel=True)
    fast = gated_delta_rule(**step, state=fast_state, slots=slots, has_state=has_state, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(fast, ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(fast_state, ref_state, atol=ATOL, rtol=0)
    assert torch.equal(fast_state[slots[1]], state[slots[1]])  # empty with state: kept as it was
    assert torch.equal(fast_state[slots[4]], torch.zeros_like(state[0]))  # empty without state: zeros


def test_scale_and_bf16_inputs() -> None:
    gen = torch.Generator().manual_seed(2)
    step = random_step(gen, [5, 40], 2, 2, 8, 8, normalise_keys=True)
    slots, has_state = torch.tensor([3, 7]), torch.tensor([True, False])
    state = random_state(gen, 2, 8, 8)
    ref_state, fast_state = state.clone(), state.clone()
    ref = gated_delta_reference(**step, state=ref_state, slots=slots, has_state=has_state, scale=0.3)
    fast = gated_delta_rule(**step, state=fast_state, slots=slots, has_state=has_state, scale=0.3)
    torch.testing.assert_close(fast, ref, atol=ATOL, rtol=0)
    half = {name: x.to(torch.bfloat16) if x.is_floating_point() else x for name, x in step.items()}
    out = gated_delta_rule(**half, state=state.clone(), slots=slots, has_state=has_state)
    assert out.dtype == torch.bfloat16


@pytest.mark.parametrize("seed", range(4))
def test_chunked_prefill_across_calls_equals_one_call(seed: int) -> None:
    """Requests fed in pieces cut at odd places (the later calls continuing from the slot) give the
    outputs and final states of one call over the whole requests."""
    gen = torch.Generator().manual_seed(100 + seed)
    h_k, h_v, d_k, d_v = 2, 4, 12, 8
    lengths = [70, 33, 1, 65]
    whole = random_step(gen, lengths, h_k, h_v, d_k, d_v, normalise_keys=True)
    slots, has_state = slots_for(gen, len(lengths))
    state = random_state(gen, h_v, d_k, d_v)
    one_state = state.clone()
    one = gated_delta_rule(**whole, state=one_state, slots=slots, has_state=has_state, use_qk_l2norm_in_kernel=True)

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
        piece = {name: whole[name][take] for name in ("query", "key", "value", "g", "beta")}
        offsets = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()])
        cont = has_state if call == 0 else has_state | torch.tensor([c[call] > 0 for c in cuts])
        out = gated_delta_rule(
            **piece,
            state=piece_state,
            slots=slots,
            has_state=cont,
            input_row_offsets=offsets,
            use_qk_l2norm_in_kernel=True,
        )
        for b in range(len(lengths)):
            outputs[b].append(out[offsets[b] : offsets[b + 1]])
    joined = torch.cat([torch.cat(o) for o in outputs])
    torch.testing.assert_close(joined, one, atol=ATOL, rtol=0)
    torch.testing.assert_close(piece_state, one_state, atol=ATOL, rtol=0)


@pytest.mark.parametrize("length", [1, 7, 64, 70, 130])
@pytest.mark.parametrize("l2", [True, False])
def test_single_request_equals_transformers(length: int, l2: bool) -> None:
    qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    gen = torch.Generator().manual_seed(length)
    h_k, h_v, d_k, d_v = 2, 4, 16, 8
    step = random_step(gen, [length], h_k, h_v, d_k, d_v, normalise_keys=l2)
    state = random_state(gen, h_v, d_k, d_v)
    slot = torch.tensor([5])
    initial = state[5:6].clone()  # [1, H_v, Dk, Dv]
    hf_args = {name: step[name].unsqueeze(0) for name in ("query", "key", "value", "g", "beta")}  # [1, T, ...]
    kwargs = {"initial_state": initial, "output_final_state": True, "use_qk_l2norm_in_kernel": l2}
    hf_chunk, hf_chunk_state = qwen3_next.torch_chunk_gated_delta_rule(**hf_args, chunk_size=64, **kwargs)
    hf_rec, hf_rec_state = qwen3_next.torch_recurrent_gated_delta_rule(**hf_args, **kwargs)
    for fn in (gated_delta_rule, gated_delta_reference):
        ours_state = state.clone()
        ours = fn(**step, state=ours_state, slots=slot, has_state=torch.tensor([True]), use_qk_l2norm_in_kernel=l2)
        for hf_out, hf_state in ((hf_chunk, hf_chunk_state), (hf_rec, hf_rec_state)):
            torch.testing.assert_close(ours, hf_out[0], atol=ATOL, rtol=0)
            torch.testing.assert_close(ours_state[5], hf_state[0], atol=ATOL, rtol=0)


def test_bad_arguments_are_refused() -> None:
    gen = torch.Generator().manual_seed(0)
    step = random_step(gen, [3], 2, 3, 4, 4, normalise_keys=True)  # H_v 3 is not a multiple of H_k 2
    with pytest.raises(ValueError, match="multiple"):
        gated_delta_rule(**step, state=torch.zeros(2, 3, 4, 4), slots=torch.tensor([0]), has_state=torch.tensor([0]))
    step = random_step(gen, [3], 2, 2, 4, 4, normalise_keys=True)
    with pytest.raises(ValueError, match="float32"):
        gated_delta_rule(
            **step, state=torch.zeros(2, 2, 4, 4).double(), slots=torch.tensor([0]), has_state=torch.tensor([True])
        )


def test_a_decode_step_takes_the_batched_recurrent_path() -> None:
    """Every request with one token (row b is request b): the same output and states as the reference."""
    gen = torch.Generator().manual_seed(3)
    lengths = [1, 1, 1, 1]
    step = random_step(gen, lengths, 2, 4, 8, 6, normalise_keys=True)
    slots, _ = slots_for(gen, len(lengths))
    has_state = torch.tensor([True, False, True, True])
    state = random_state(gen, 4, 8, 6)
    ref_state, fast_state = state.clone(), state.clone()
    ref = gated_delta_reference(**step, state=ref_state, slots=slots, has_state=has_state, use_qk_l2norm_in_kernel=True)
    fast = gated_delta_rule(**step, state=fast_state, slots=slots, has_state=has_state, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(fast, ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(fast_state, ref_state, atol=ATOL, rtol=0)
