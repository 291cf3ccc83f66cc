"""State-layer adapters: pagedkv's forward for each transformers mixer that keeps a recurrent state.

`adapter_for(module)` is the `MixerAdapter` of a module's class (None when the
module is not a state mixer). One file per family: `gdn` (gated delta net),
`mamba2` (SSD), `mamba1` (selective scan), `short_conv` (LFM2).
"""

from __future__ import annotations

import importlib

import torch

from pagedkv.hf.mixers.base import MixerAdapter, StateBatch

__all__ = ["MixerAdapter", "StateBatch", "adapter_for", "adapters"]

_FAMILIES = ("gdn", "mamba2", "mamba1", "short_conv")
_ADAPTERS: dict[str, MixerAdapter] = {}


def adapters() -> dict[str, MixerAdapter]:
    """transformers class name -> its adapter, over every family."""
    if not _ADAPTERS:
        for family in _FAMILIES:
            _ADAPTERS.update(importlib.import_module(f"pagedkv.hf.mixers.{family}").ADAPTERS)
    return _ADAPTERS


def adapter_for(module: torch.nn.Module) -> MixerAdapter | None:
    """The adapter of `module`'s class, or None when it keeps no recurrent state."""
    return adapters().get(type(module).__name__)
