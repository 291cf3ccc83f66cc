"""Length-dependent RoPE per request inside engine forwards (see `pagedkv.hf.positions` for the contract).

transformers' ``dynamic_rope_update`` recomputes a rotary module's ``inv_freq``
from ``max(position_ids) + 1`` of the whole (packed) forward and keeps it as
module state. `install` replaces each such module's forward: inside a forward
that carries a `ForwardContext` (``pagedkv=``), every request gets the
frequencies a fresh module gives a sequence of its own length
(`ForwardContext.sequence_lengths`), computed with transformers' own init
function and its undecorated forward, once per step; outside, the module runs
transformers' forward unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from pagedkv.hf.context import ATTENTION_NAME, ForwardContext

__all__ = ["install", "is_length_dependent"]


def is_length_dependent(rope_type: Any) -> bool:
    """True for a rope type whose frequencies transformers recomputes from the sequence length."""
    if isinstance(rope_type, dict):
        return any(is_length_dependent(t) for t in rope_type.values())
    return isinstance(rope_type, str) and ("dynamic" in rope_type or rope_type == "longrope")


@dataclass
class _State:
    """The engine forward in progress (set by the model's forward pre-hook, cleared after it)."""

    context: ForwardContext | None = None
    rotaries: list[torch.nn.Module] = field(default_factory=list)


def install(model: torch.nn.Module) -> bool:
    """Make `model`'s length-dependent rotary embeddings per request inside engine forwards (idempotent).

    Returns True when the model has such a rotary module (and is now patched).
    Raises ValueError for length-dependent per-layer-type rope parameters (not supported).
    """
    installed = getattr(model, "_pagedkv_positions", None)
    if isinstance(installed, _State):
        return bool(installed.rotaries)
    state = _State()
    for module in model.modules():
        rope_type = getattr(module, "rope_type", None)
        if not is_length_dependent(rope_type) or not hasattr(module, "original_inv_freq"):
            continue
        if not isinstance(rope_type, str):
            raise ValueError(f"{type(module).__name__}: length-dependent per-layer-type rope {rope_type!r} is not "
                             "supported by pagedkv yet")  # fmt: skip
        forward = type(module).forward
        plain = getattr(forward, "__wrapped__", None)  # transformers' forward without dynamic_rope_update
        if plain is None:
            raise ValueError(f"{type(module).__name__}.forward is not wrapped by dynamic_rope_update; cannot patch it")
        module.forward = _per_request_forward(module, forward, plain, state)  # type: ignore[method-assign]
        state.rotaries.append(module)
    model._pagedkv_positions = state  # type: ignore[assignment]
    if state.rotaries:
        model.register_forward_pre_hook(_enter(state), with_kwargs=True)
        model.register_forward_hook(_leave(state), always_call=True)
    return bool(state.rotaries)


def _enter(state: _State) -> Any:
    def hook(module: torch.nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        ctx = kwargs.get(ATTENTION_NAME)
        state.context = ctx if isinstance(ctx, ForwardContext) else None

    return hook


def _leave(state: _State) -> Any:
    def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
        state.context = None

    return hook


def _frequencies(module: Any, length: int, device: torch.device) -> tuple[torch.Tensor, float] | None:
    """(inv_freq, attention_scaling) a fresh `module` uses for a sequence of `length` tokens (None: its original)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope_type, config = module.rope_type, module.config
    if rope_type == "longrope":
        original = config.rope_parameters["original_max_position_embeddings"]
        if length <= original:
            return None
        inv_freq, _ = ROPE_INIT_FUNCTIONS[rope_type](config, device, seq_len=original + 1)
        return inv_freq, float(module.attention_scaling)  # longrope keeps its init scaling
    if length <= module.original_max_seq_len:  # dynamic: no growth past the original context
        return None
    seq_len = torch.tensor(length, dtype=torch.int64, device=device)  # a tensor, as transformers passes it
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, device, seq_len=seq_len)
    return inv_freq, float(scaling)


def _per_request_forward(module: Any, forward: Any, plain: Any, state: _State) -> Any:
    """`module`'s forward: transformers' own outside engine forwards, per request inside them."""

    def per_request(x: torch.Tensor, position_ids: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        ctx = state.context
        if ctx is None:
            return forward(module, x, position_ids, *args, **kwargs)
        original = (module.original_inv_freq.to(x.device), module.attention_scaling)
        out = _call(module, plain, original, x, position_ids)
        lengths = ctx.token_sequence_lengths  # [T] host int64
        groups: dict[int, Any] = {}
        for length in torch.unique(lengths).tolist():
            freqs = _frequencies(module, int(length), x.device)
            if freqs is not None:
                groups[int(length)] = freqs
        if not groups:
            return out
        outputs = list(out) if isinstance(out, tuple) else [out]
        for length, freqs in groups.items():
            tokens = (lengths == length).nonzero()[:, 0].to(x.device)  # [n] packed tokens of that length
            own = _call(module, plain, freqs, x, position_ids)
            for o, g in zip(outputs, own if isinstance(own, tuple) else [own], strict=True):
                o[:, tokens] = g[:, tokens]  # [1, n, ...]
        return tuple(outputs) if isinstance(out, tuple) else outputs[0]

    return per_request


def _call(module: Any, plain: Any, freqs: tuple[torch.Tensor, float], x: torch.Tensor, position_ids: Any) -> Any:
    """transformers' undecorated rotary forward with `freqs` (inv_freq, attention_scaling) in place of the module's."""
    saved = (module.inv_freq, module.attention_scaling)
    try:
        module.inv_freq, module.attention_scaling = freqs
        return plain(module, x, position_ids)
    finally:
        module.inv_freq, module.attention_scaling = saved
