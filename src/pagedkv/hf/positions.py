"""Position-dependent model features, computed per request from that request's own positions.

The engine packs a step's requests into one sequence (``input_ids [1, T]``,
``position_ids [1, T]``). Whatever in a transformers model reads the packed
sequence instead of each token's own position sees the batch; two such
features are handled here, each once per step (never per layer):

* Llama 4 attention temperature tuning (``attn_temperature_tuning``,
  NoPE layers). transformers 5.x scales the NoPE layers' queries by
  ``log1p(floor((p + 1) / floor_scale)) * attn_scale + 1`` with
  ``p = arange(T) + cache.get_seq_length(layer)``: the packed index, not the
  token's position (the engine runs without a transformers cache).
  `temperature_correction` is the per-token factor ``f(position) / f(arange(T))``
  that `pagedkv.hf.attention` multiplies those layers' queries by (in float32,
  then back to the query's dtype). While ``T < floor_scale`` the wrong scale is
  exactly 1, so the result is bit for bit transformers' own ``(q * f(position))``.
* length-dependent RoPE (``rope_type`` ``"dynamic"`` and its variants, and
  ``"longrope"``). transformers recomputes the rotary module's ``inv_freq`` from
  ``max(position_ids) + 1`` of the whole forward (and keeps it as module state).
  `pagedkv.hf.rope.install` replaces each such rotary module's forward: inside an engine forward
  (a `ForwardContext` passed as ``pagedkv=``) every request gets the
  frequencies transformers' ``generate()`` gives it alone, from a fresh module:
  those of its own *sequence length* (its prompt plus the tokens generated so
  far: `ForwardContext.sequence_lengths`; a prompt's chunks all use the whole
  prompt's length, as transformers' one-pass prefill does). Outside an engine
  forward the module behaves as transformers' own.

Limits: RoPE keys are computed once and cached, so a page of a request whose
length went past the original context (``max_position_embeddings``, dynamic) or
``original_max_position_embeddings`` (longrope) holds keys rotated with that
request's frequencies; prefix-cache hits across requests of different lengths
past that point see keys of other frequencies (transformers' own cache does the
same within one request). Per-layer-type rope parameters (a ``rope_type`` dict)
that are length dependent are refused (`pagedkv.hf.rope.install` raises ValueError).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["temperature_correction", "uses_temperature_tuning"]


def uses_temperature_tuning(config: Any) -> bool:
    """True when `config` is a Llama 4 text config with attention temperature tuning on NoPE layers."""
    return bool(getattr(config, "attn_temperature_tuning", False)) and hasattr(config, "floor_scale")


def _temperature(positions: torch.Tensor, floor_scale: float, attn_scale: float) -> torch.Tensor:
    """transformers' Llama 4 query scale of int positions [T]: float32 [T] (its exact expression)."""
    return torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0  # [T]


def temperature_correction(config: Any, positions: torch.Tensor) -> torch.Tensor | None:
    """The factor float32 [T, 1, 1] turning the packed-index scale into each token's own (None when off).

    `positions` int [T]: each packed token's own position. transformers applied
    ``f(arange(T))`` (no cache: the engine passes ``use_cache=False``); the queries
    need ``f(positions)``, so the factor is their ratio (``f >= 1``, never zero).
    """
    if not uses_temperature_tuning(config):
        return None
    floor_scale, attn_scale = config.floor_scale, config.attn_scale
    own = _temperature(positions, floor_scale, attn_scale)  # [T]
    packed = _temperature(torch.arange(positions.shape[0], device=positions.device), floor_scale, attn_scale)  # [T]
    return (own / packed)[:, None, None]  # [T, 1, 1]
