"""Switch a model's recurrent mixers to pagedkv's state slots (the state-layer twin of `set_attn_implementation`).

`install(model)` replaces the ``forward`` of every mixer `pagedkv.hf.mixers` has an
adapter for (Mamba, Mamba2, gated delta net, short conv) with one that, inside
an engine step (`pagedkv.hf.context.active`), runs the adapter over the step's
packed ragged batch, reading and writing the request's state slots of the
layer's state group; outside a step it calls the module's own forward, so the
model still runs as transformers wrote it (e.g. its own ``generate``).
"""

from __future__ import annotations

import types
from typing import Any

import torch

from pagedkv.hf.context import current
from pagedkv.hf.mixers import adapter_for

__all__ = ["install", "installed"]


def _state_forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """A wrapped mixer's forward (bound to the module, so a copy of the model calls its own mixers)."""
    ctx = current()
    if ctx is None or ctx.states is None:
        return type(self).forward(self, *args, **kwargs)
    adapter = adapter_for(self)
    assert adapter is not None
    hidden = kwargs.pop("hidden_states") if "hidden_states" in kwargs else args[0]  # [1, T, D]
    batch, states = ctx.states.locate(int(self.layer_idx))  # type: ignore[arg-type]
    return adapter.forward(self, hidden, batch, states)


def installed(module: torch.nn.Module) -> bool:
    """True when `module`'s forward is pagedkv's (see `install`)."""
    return getattr(module.forward, "__func__", None) is _state_forward


def install(model: torch.nn.Module) -> int:
    """Wrap every recurrent mixer of `model` (once; a second call changes nothing). Returns how many
    mixers use pagedkv's state slots."""
    count = 0
    for module in model.modules():
        adapter = adapter_for(module)
        if adapter is None:
            continue
        if not installed(module):
            module.forward = types.MethodType(_state_forward, module)  # type: ignore[method-assign]
        count += 1
    return count
