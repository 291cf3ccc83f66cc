"""The Mamba2 (SSD) mixer adapters against transformers' own mixers.

For each model type a tiny random model is built from its transformers config, and one of its Mamba2
mixers runs (a) by itself over each request's whole sequence (batch 1, no cache: the ground truth) and
(b) through `pagedkv.hf.mixers.mamba2.ADAPTERS` over packed ragged batches: chunked prefill cut off the
chunk grid, single-token decodes, calls mixing one request's prefill chunk with others' decodes, state
slots a random subset of a larger, garbage-filled state tensor.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch

from pagedkv.hf.mixers.base import MixerAdapter, StateBatch
from pagedkv.hf.mixers.mamba2 import ADAPTERS

transformers = pytest.importorskip("transformers")

HIDDEN = 64
NUM_SLOTS = 12
ATOL = 1e-5
COMMON = dict(
    hidden_size=HIDDEN, num_hidden_layers=2, vocab_size=64, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=64, initializer_range=0.2,
)  # fmt: skip
# Falcon-H1's muP multipliers, all different from 1 so that a missing or misplaced one shows.
FALCON = dict(
    COMMON, head_dim=16, mamba_d_ssm=96, mamba_n_heads=6, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=16,
    mamba_d_conv=4, mamba_chunk_size=8, ssm_in_multiplier=0.5, ssm_multipliers=[0.7, 1.3, 0.9, 1.1, 0.6],
)  # fmt: skip

# model type -> (config class, model class, config fields, mixer class). Sizes vary between cases
# (H 4-8, P 8-16, G 1-4, K 2-4, chunk 8-16) and two of them make the time-step limit bite.
CASES: dict[str, Callable[[], tuple[Any, Any, dict[str, Any], str]]] = {
    "mamba2": lambda: (transformers.Mamba2Config, transformers.Mamba2Model, dict(
        hidden_size=HIDDEN, num_hidden_layers=2, vocab_size=64, num_heads=8, head_dim=16, expand=2, n_groups=2,
        state_size=16, conv_kernel=4, chunk_size=8, initializer_range=0.2), "Mamba2Mixer"),
    # an activation `causal_conv1d` does not fuse, and the smallest kernel (a one-column conv window)
    "mamba2_gelu_k2": lambda: (transformers.Mamba2Config, transformers.Mamba2Model, dict(
        hidden_size=HIDDEN, num_hidden_layers=2, vocab_size=64, num_heads=4, head_dim=16, expand=1, n_groups=1,
        state_size=8, conv_kernel=2, chunk_size=16, hidden_act="gelu", initializer_range=0.2), "Mamba2Mixer"),
    "bamba": lambda: (transformers.BambaConfig, transformers.BambaModel, dict(
        COMMON, attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=16,
        mamba_d_conv=4, mamba_expand=1, mamba_chunk_size=16, time_step_limit=(0.0, 1.0)), "BambaMixer"),
    "nemotron_h": lambda: (transformers.NemotronHConfig, transformers.NemotronHModel, dict(
        COMMON, head_dim=16, layers_block_type=["mamba", "attention"], mamba_num_heads=8, mamba_head_dim=8,
        n_groups=2, ssm_state_size=16, conv_kernel=3, chunk_size=8, time_step_min=0.5), "NemotronHMamba2Mixer"),
    "granitemoehybrid": lambda: (transformers.GraniteMoeHybridConfig, transformers.GraniteMoeHybridModel, dict(
        COMMON, layer_types=["mamba", "attention"], mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=4,
        mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8, num_local_experts=2,
        num_experts_per_tok=1, shared_intermediate_size=64), "GraniteMoeHybridMambaLayer"),
    "falcon_h1": lambda: (transformers.FalconH1Config, transformers.FalconH1Model, dict(FALCON), "FalconH1Mixer"),
    "falcon_h1_norm": lambda: (transformers.FalconH1Config, transformers.FalconH1Model, dict(
        FALCON, mamba_rms_norm=True, mamba_norm_before_gate=True), "FalconH1Mixer"),
    "falcon_h1_norm_gate_first": lambda: (transformers.FalconH1Config, transformers.FalconH1Model, dict(
        FALCON, mamba_rms_norm=True, mamba_norm_before_gate=False), "FalconH1Mixer"),
}  # fmt: skip

# Requests: lengths 57, 23, 2, 1, 6 (2 and 1 below K - 1), each a plan of per-call chunks starting at a
# given call. Prefill chunks 13/19/11/5/7/3 are off the 8- and 16-token chunk grids; 1s are decodes.
PLANS = [[13, 19, 11] + [1] * 14, [5, 7] + [1] * 11, [1, 1], [1], [2, 3, 1]]
STARTS = [0, 1, 2, 4, 3]


def build_mixer(case: str, dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    """(model, its first Mamba2 mixer), seeded; A_log, D, dt_bias, the conv bias and the norm weight are
    randomised too (transformers initialises them to constants that would hide mix-ups)."""
    config_cls, model_cls, fields, mixer_name = CASES[case]()
    torch.manual_seed(0)
    model = model_cls._from_config(config_cls(**fields), attn_implementation="eager", dtype=dtype).eval()
    mixer = next(m for m in model.modules() if type(m).__name__ == mixer_name)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        h = mixer.num_heads
        mixer.A_log.copy_(torch.randn(h, generator=gen) * 0.5)
        mixer.D.copy_(torch.randn(h, generator=gen))
        mixer.dt_bias.copy_(torch.randn(h, generator=gen))
        mixer.conv1d.bias.copy_(torch.randn(mixer.conv_dim, generator=gen) * 0.1)
        weight = getattr(mixer.norm, "weight", None)
        if weight is not None:
            weight.copy_(1 + 0.3 * torch.randn(weight.shape, generator=gen))
    return model, mixer


def inputs(seed: int = 2) -> list[torch.Tensor]:
    """One [n, D] float32 input per request of `PLANS`."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(sum(plan), HIDDEN, generator=gen) for plan in PLANS]


def new_states(adapter: MixerAdapter, mixer: Any, dtype: torch.dtype, seed: int = 3) -> tuple[torch.Tensor, ...]:
    """The layer's state tensors from its `state_spec`, with NUM_SLOTS slots of random garbage."""
    gen = torch.Generator().manual_seed(seed)
    shapes, dtypes = adapter.state_spec(mixer, dtype)
    return tuple(torch.randn(NUM_SLOTS, *s, generator=gen).to(d) for s, d in zip(shapes, dtypes, strict=True))


def request_slots(seed: int = 4) -> list[int]:
    """A random subset of the slots, one per request."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randperm(NUM_SLOTS, generator=gen)[: len(PLANS)].tolist()


def run_schedule(
    adapter: MixerAdapter, mixer: Any, xs: list[torch.Tensor], states: tuple[torch.Tensor, ...], slots: list[int]
) -> list[torch.Tensor]:
    """Feed every request's plan over successive calls (the requests of a call in a shuffled order);
    after each call, assert every slot outside the call is bit-identical. Returns each request's
    outputs [n, D] concatenated over its calls."""
    gen = torch.Generator().manual_seed(5)
    done = [0] * len(PLANS)  # chunks fed
    pos = [0] * len(PLANS)  # tokens fed
    outs: list[list[torch.Tensor]] = [[] for _ in PLANS]
    call = 0
    while any(done[r] < len(PLANS[r]) for r in range(len(PLANS))):
        members = [r for r in range(len(PLANS)) if STARTS[r] <= call and done[r] < len(PLANS[r])]
        members = [members[i] for i in torch.randperm(len(members), generator=gen).tolist()]
        lengths = [PLANS[r][done[r]] for r in members]
        hidden = torch.cat([xs[r][pos[r] : pos[r] + n] for r, n in zip(members, lengths, strict=True)])[None]
        batch = StateBatch.build(
            lengths, torch.tensor([slots[r] for r in members]), torch.tensor([pos[r] > 0 for r in members])
        )
        before = [s.clone() for s in states]
        with torch.no_grad():
            out = adapter.forward(mixer, hidden.to(mixer.in_proj.weight.dtype), batch, states)
        assert out.shape == hidden.shape and out.dtype == mixer.in_proj.weight.dtype
        others = [s for s in range(NUM_SLOTS) if s not in {slots[r] for r in members}]
        for state, old in zip(states, before, strict=True):
            assert torch.equal(state[others], old[others])
        for r, piece in zip(members, out[0].split(lengths), strict=True):
            outs[r].append(piece)
            pos[r] += piece.shape[0]
            done[r] += 1
        call += 1
    return [torch.cat(o) for o in outs]


def reference(mixer: Any, xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """transformers' mixer over each request's whole sequence alone (batch 1, no cache)."""
    with torch.no_grad():
        return [mixer(x[None].to(mixer.in_proj.weight.dtype))[0] for x in xs]


@pytest.mark.parametrize("case", list(CASES))
def test_ragged_calls_equal_transformers_full_forward(case: str) -> None:
    """Chunked prefill + decode over mixed ragged calls equals the full forward per request; other slots
    never change; the final states equal those of one call over the whole sequences, and transformers'
    own cache after a full forward (its conv window keeps K columns, ours the last K - 1)."""
    model, mixer = build_mixer(case)
    adapter = ADAPTERS[type(mixer).__name__]
    xs, slots = inputs(), request_slots()
    want = reference(mixer, xs)

    states = new_states(adapter, mixer, torch.float32)
    got = run_schedule(adapter, mixer, xs, states, slots)
    for r, (ours, ref) in enumerate(zip(got, want, strict=True)):
        assert ours.shape == ref.shape
        err = (ours - ref).abs().max().item()
        assert err <= ATOL, f"{case} request {r} (length {ref.shape[0]}): max abs diff {err:.2e}"
    assert max(ref.abs().max().item() for ref in want) > 0.1  # the comparison is not between near-zeros

    one_call = new_states(adapter, mixer, torch.float32, seed=6)  # other garbage: has_state=False ignores it
    batch = StateBatch.build([x.shape[0] for x in xs], torch.tensor(slots), torch.zeros(len(xs), dtype=torch.bool))
    with torch.no_grad():
        out = adapter.forward(mixer, torch.cat(xs)[None], batch, one_call)
    torch.testing.assert_close(out[0], torch.cat(want), atol=ATOL, rtol=0)
    for chunked, whole in zip(states, one_call, strict=True):
        torch.testing.assert_close(chunked[slots], whole[slots], atol=ATOL, rtol=0)

    kernel = mixer.conv_kernel_size
    for r, x in enumerate(xs):
        cache = transformers.DynamicCache(config=model.config)
        with torch.no_grad():
            mixer(x[None], cache=cache)
        hf_conv = cache.get_conv_state(mixer.layer_idx, state_idx=0)[0]  # [C, K]
        hf_ssm = cache.get_recurrent_state(mixer.layer_idx, state_idx=0)[0]  # [H, P, N]
        torch.testing.assert_close(states[0][slots[r]], hf_conv[:, 1:], atol=ATOL, rtol=0)
        assert hf_conv.shape[1] == kernel
        torch.testing.assert_close(states[1][slots[r]], hf_ssm, atol=ATOL, rtol=0)


@pytest.mark.parametrize("case", list(CASES))
def test_state_spec(case: str) -> None:
    """conv (I + 2GN, K - 1) in the model dtype and SSD (H, P, N) in float32, from the config's numbers;
    the forward runs on exactly these tensors (and refuses a conv window narrower than K - 1)."""
    model, mixer = build_mixer(case)
    adapter = ADAPTERS[type(mixer).__name__]
    assert adapter.mamba_type == "mamba2"
    c = model.config
    if case.startswith("mamba2"):
        h, p, g, n, k = c.num_heads, c.head_dim, c.n_groups, c.state_size, c.conv_kernel
    elif case == "nemotron_h":
        h, p, g, n, k = c.mamba_num_heads, c.mamba_head_dim, c.n_groups, c.ssm_state_size, c.conv_kernel
    else:
        h, p, g, n, k = c.mamba_n_heads, c.mamba_d_head, c.mamba_n_groups, c.mamba_d_state, c.mamba_d_conv
    for dtype in (torch.float32, torch.bfloat16):
        shapes, dtypes = adapter.state_spec(mixer, dtype)
        assert shapes == ((h * p + 2 * g * n, k - 1), (h, p, n))
        assert dtypes == (dtype, torch.float32)
    states = new_states(adapter, mixer, torch.float32)
    batch = StateBatch.build([5], torch.tensor([3]), torch.tensor([False]))
    with torch.no_grad():
        assert adapter.forward(mixer, torch.randn(1, 5, HIDDEN), batch, states).shape == (1, 5, HIDDEN)
        narrow = (states[0][..., 1:], states[1])
        with pytest.raises(ValueError, match="width"):
            adapter.forward(mixer, torch.randn(1, 5, HIDDEN), batch, narrow)


@pytest.mark.parametrize("case", ["bamba", "nemotron_h", "falcon_h1_norm"])
def test_bfloat16(case: str) -> None:
    """A bf16 model over the same ragged calls: bf16 outputs and conv state, float32 SSD state, outputs
    within 3e-2 of the float32 full forward relative to the output's scale (measured: 1.1e-2 to 1.4e-2),
    and no further from it than transformers' own bf16 forward is, give or take 1e-2 of the scale."""
    _, mixer = build_mixer(case)
    mixer16 = copy.deepcopy(mixer).to(torch.bfloat16)
    adapter = ADAPTERS[type(mixer).__name__]
    xs, slots = inputs(), request_slots()
    want = reference(mixer, xs)
    hf16 = reference(mixer16, xs)

    states = new_states(adapter, mixer16, torch.bfloat16)
    assert [s.dtype for s in states] == [torch.bfloat16, torch.float32]
    got = run_schedule(adapter, mixer16, xs, states, slots)
    for ours, ref, theirs in zip(got, want, hf16, strict=True):
        assert ours.dtype == torch.bfloat16
        scale = ref.abs().max().item()
        err = (ours.float() - ref).abs().max().item() / scale
        hf_err = (theirs.float() - ref).abs().max().item() / scale
        assert err <= 3e-2 and err <= hf_err + 1e-2, f"{case}: {err:.2e} (transformers bf16: {hf_err:.2e})"


def test_falcon_mixer_without_mup_vector_is_refused() -> None:
    """A FalconH1Mixer built on its own has no mup_vector (FalconH1Model registers it): refused, not ignored."""
    config_cls, _, fields, _ = CASES["falcon_h1"]()
    mixer = transformers.models.falcon_h1.modeling_falcon_h1.FalconH1Mixer(config_cls(**fields), layer_idx=0).eval()
    adapter = ADAPTERS["FalconH1Mixer"]
    states = new_states(adapter, mixer, torch.float32)
    batch = StateBatch.build([3], torch.tensor([0]), torch.tensor([False]))
    with pytest.raises(ValueError, match="mup_vector"), torch.no_grad():
        adapter.forward(mixer, torch.randn(1, 3, HIDDEN), batch, states)
