"""What every state-layer adapter shares: one step's request layout, and the adapter record.

A state layer (Mamba, Mamba2, gated delta net, short convolution) keeps a
fixed-size state per request instead of per-token keys and values. pagedkv
keeps it in a *state slot*: a page id of the request's state group, whose
page holds the layer's state tensors (`MambaSpec.shapes`, one tensor each)::

    states[i]: [num_slots, *shapes[i]]   (e.g. conv [num_slots, C, K - 1], ssm [num_slots, H, P, N])

An adapter replaces a transformers mixer's forward with one that runs over the
packed ragged batch of a step: request b owns packed rows
``input_row_offsets[b]:input_row_offsets[b + 1]`` of ``hidden_states [1, T, D]``,
continues from ``states[i][slots[b]]`` when ``has_state[b]`` (else from zeros,
never reading the slot), and writes its new state back to that slot; no other
slot is read or written.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

__all__ = ["StateBatch", "MixerAdapter", "module_attr"]

_A = TypeVar("_A")


def module_attr(module: torch.nn.Module, name: str, kind: type[_A]) -> _A:
    """``module.<name>`` checked to be a `kind` (the transformers attribute an adapter's forward relies on);
    TypeError naming the class and attribute otherwise."""
    value = getattr(module, name, None)
    if not isinstance(value, kind):
        raise TypeError(f"{type(module).__name__}.{name} is {type(value).__name__}, expected {kind.__name__}")
    return value


@dataclass(frozen=True, eq=False)
class StateBatch:
    """One step's requests as the state layers see them (built once per step, shared by every layer).

    Attributes:
        input_row_offsets: int64 [B + 1] on the model's device: request b's packed rows.
        lengths: the B row counts on the host (``offsets[b + 1] - offsets[b]``).
        slots: int64 [B] on the device: each request's state slot (the page id of its state group).
        has_state: bool [B] on the device: True when the slot holds the state after the request's
            processed tokens (continue from it), False at the request's first token (start from zeros).
        host_offsets: int64 [B + 1] on the host, the same offsets: the scans read them there, so a CUDA
            step does not synchronise once per layer (None: read `input_row_offsets`).
    """

    input_row_offsets: torch.Tensor
    lengths: list[int]
    slots: torch.Tensor
    has_state: torch.Tensor
    host_offsets: torch.Tensor | None = None

    @property
    def scan_offsets(self) -> torch.Tensor:
        """The offsets the scans read on the host (`host_offsets`, else `input_row_offsets`)."""
        return self.host_offsets if self.host_offsets is not None else self.input_row_offsets

    @property
    def decode(self) -> bool:
        """True when every request has exactly one row (a decode step): the ops take their decode paths."""
        return all(n == 1 for n in self.lengths)

    @classmethod
    def build(
        cls, lengths: list[int], slots: torch.Tensor, has_state: torch.Tensor, device: torch.device | None = None
    ) -> StateBatch:
        """A batch of requests with `lengths` packed rows each, `slots` [B] and `has_state` [B]."""
        device = device or slots.device
        offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)  # [B + 1]
        offsets[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)
        slots = slots.to(device=device, dtype=torch.int64)  # [B]
        return cls(offsets.to(device), list(lengths), slots, has_state.to(device), offsets)


StateSpecFn = Callable[[torch.nn.Module, torch.dtype], tuple[tuple[tuple[int, ...], ...], tuple[torch.dtype, ...]]]
"""(module, model dtype) -> (shapes, dtypes) of one layer's state tensors (one replica's whole TP group)."""

ForwardFn = Callable[[torch.nn.Module, torch.Tensor, StateBatch, tuple[torch.Tensor, ...]], torch.Tensor]
"""(module, hidden_states [1, T, D], batch, states) -> output [1, T, D]; updates the batch's slots in place."""


@dataclass(frozen=True)
class MixerAdapter:
    """How pagedkv runs one transformers mixer class over state slots.

    Attributes:
        mamba_type: the `MambaSpec.mamba_type` of its layers ("mamba1", "mamba2", "short_conv", "gdn_attn").
        state_spec: the shapes and dtypes of one layer's state tensors, in the order `forward` reads them.
        forward: the packed ragged forward (see the module docstring).
    """

    mamba_type: str
    state_spec: StateSpecFn
    forward: ForwardFn
