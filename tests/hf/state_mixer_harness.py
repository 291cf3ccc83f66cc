"""Replaying requests through a state-mixer adapter over several packed steps (for the mixer adapter tests).

A `Request` is one sequence of hidden states cut into chunks; `replay` runs the requests over calls in
which every started request contributes its next chunk (a prefill chunk, or one token once its prompt
is in), in a shuffled order, each request on its own slot of state tensors pre-filled with garbage
(NaN, inf and large values: a slot read without `has_state` shows up in the outputs). After every call
it asserts that the slots outside the call are bit-identical. `reference` is the module's own
cache-free forward over one whole sequence, the only valid reference for Mamba1 (transformers restarts
its SSM state at zero on a multi-token call with a cache).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedkv.hf.mixers.base import MixerAdapter, StateBatch

NUM_SLOTS = 12


@dataclass(frozen=True)
class Request:
    """Hidden states [L, D] of one sequence, fed as `chunks` (sizes summing to L) from call `start` on."""

    inputs: torch.Tensor
    chunks: list[int]
    start: int = 0


def garbage_states(adapter: MixerAdapter, module: torch.nn.Module, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    """The layer's state tensors [NUM_SLOTS, *shape] per `adapter.state_spec`, filled with garbage."""
    gen = torch.Generator().manual_seed(seed)
    shapes, dtypes = adapter.state_spec(module, dtype)
    states = []
    for shape, state_dtype in zip(shapes, dtypes, strict=True):
        state = 100 * torch.randn(NUM_SLOTS, *shape, generator=gen)  # [S, *shape]
        state[0::3] = float("nan")
        state[1::3, ..., :1] = float("inf")
        states.append(state.to(state_dtype))
    return states


def bits(t: torch.Tensor) -> torch.Tensor:
    """`t`'s raw bits (NaN == NaN), for bit-identity checks."""
    return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def reference(module: torch.nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    """The module's own cache-free forward over one whole sequence: [L, D] -> [L, D]."""
    with torch.no_grad():
        out: torch.Tensor = module(inputs[None])[0]
    return out


def replay(
    adapter: MixerAdapter,
    module: torch.nn.Module,
    requests: list[Request],
    states: list[torch.Tensor],
    slots: list[int],
    seed: int = 0,
) -> tuple[list[torch.Tensor], int]:
    """Feed `requests` (request r on slot ``slots[r]``) through `adapter.forward` over packed calls.

    Returns each request's outputs [L, D] concatenated over the calls, and the number of calls. Asserts
    after every call that the slots outside it are bit-identical to before.
    """
    gen = torch.Generator().manual_seed(seed)
    done = [0] * len(requests)  # tokens fed so far
    next_chunk = [0] * len(requests)
    outputs: list[list[torch.Tensor]] = [[] for _ in requests]
    calls = 0
    while any(n < len(r.chunks) for n, r in zip(next_chunk, requests, strict=True)):
        members = [r for r, req in enumerate(requests) if req.start <= calls and next_chunk[r] < len(req.chunks)]
        members = [members[i] for i in torch.randperm(len(members), generator=gen).tolist()]
        lengths = [requests[r].chunks[next_chunk[r]] for r in members]
        rows = [requests[r].inputs[done[r] : done[r] + n] for r, n in zip(members, lengths, strict=True)]
        batch = StateBatch.build(
            lengths, torch.tensor([slots[r] for r in members]), torch.tensor([done[r] > 0 for r in members])
        )
        others = [s for s in range(NUM_SLOTS) if s not in {slots[r] for r in members}]
        before = [bits(state[others]).clone() for state in states]
        with torch.no_grad():
            out = adapter.forward(module, torch.cat(rows)[None], batch, tuple(states))  # [1, T, D]
        assert out.shape == (1, sum(lengths), requests[0].inputs.shape[1]) and out.dtype == requests[0].inputs.dtype
        for state, old in zip(states, before, strict=True):
            assert torch.equal(bits(state[others]), old), "a slot outside the call changed"
        for r, piece in zip(members, out[0].split(lengths), strict=True):
            outputs[r].append(piece)
            done[r] += piece.shape[0]
            next_chunk[r] += 1
        calls += 1
    return [torch.cat(pieces) for pieces in outputs], calls


def chunks_then_decode(prefill: list[int], total: int) -> list[int]:
    """Prefill chunk sizes, then single-token steps up to `total` tokens."""
    assert sum(prefill) <= total
    return [*prefill, *[1] * (total - sum(prefill))]


def standard_requests(hidden: int, dtype: torch.dtype, seed: int) -> list[Request]:
    """Four requests of 60, 1, 2 and 23 tokens: chunked prefills cut at odd places, then decodes; the
    short ones start while the long one is still in prefill, so calls mix prefill chunks with decodes."""
    gen = torch.Generator().manual_seed(seed)
    plan = [
        (60, chunks_then_decode([5, 2, 27, 13], 60), 0),
        (1, [1], 2),
        (2, [1, 1], 0),
        (23, chunks_then_decode([3, 1, 9], 23), 1),
    ]
    return [Request(torch.randn(n, hidden, generator=gen).to(dtype), chunks, start) for n, chunks, start in plan]
