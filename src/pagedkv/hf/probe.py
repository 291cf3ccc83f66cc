"""What a transformers model's attention modules actually produce, observed in one tiny forward pass.

A config can carry attributes its model never reads (a ``num_key_value_heads``
on GPT-2, a ``sliding_window`` on OPT: real checkpoints have them), so the page
layout is not read from the config but observed (`observe`): the model runs
one 2-token forward under a recording attention implementation
(``"pagedkv_probe"``, registered with transformers' `AttentionInterface` and
`AttentionMaskInterface`). For every attention module it records the query,
key and value shapes it passes to the attention function, the
``sliding_window`` keyword it passes (the window transformers' flash kernels
apply), and which attention mask its layer was built (the window or chunk
transformers' eager and SDPA paths apply), read from the mask function itself
(`mask_window`). An MLA model (DeepSeek V2/V3) caches a latent instead of K/V:
the forward then also gets a recording cache whose ``update`` sees the latents
(`pagedkv.hf.mla.LatentProbe`).

The pass leaves the model as it was: its attention implementation is set back
(also when the forward raises), the RNG state is restored (a model in train
mode draws dropout masks) and it runs under ``torch.inference_mode``, with no
transformers cache. The attention returns zeros, so the outputs are
meaningless and discarded. `pagedkv.hf.support.check_model` decides the layout
from these observations.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["PROBE_NAME", "Observed", "mask_window", "observe"]

PROBE_NAME = "pagedkv_probe"
_NO_WINDOW = 1 << 40  # a query this far past key 0 still sees it: the mask keeps no window
_RECORDER: ContextVar[_Recorder | None] = ContextVar("pagedkv_probe_recorder", default=None)


@dataclass
class Observed:
    """One attention layer as its module ran in the probe forward.

    Attributes:
        query: (H_q, D_q) of the query it passed to the attention function.
        key: (H_kv, D) of the key (for MLA: of the latent it gave the cache, heads 1).
        value: (H_kv, D_v) of the value (for MLA: the latent again).
        window: what its attention mask keeps: ("full_attention", None), ("sliding_attention", W) or
            ("chunked_attention", C); None when the layer got no mask of transformers' mask functions.
        window_keyword: the ``sliding_window`` keyword it passed to the attention function (None when it passed
            none or None).
    """

    query: tuple[int, int]
    key: tuple[int, int]
    value: tuple[int, int]
    window: tuple[str, int | None] | None
    window_keyword: int | None


@dataclass
class _Recorder:
    masks: list[tuple[torch.Tensor, tuple[str, int | None] | None]] = field(default_factory=list)
    layers: dict[int, Observed] = field(default_factory=dict)
    latents: dict[int, tuple[int, int]] = field(default_factory=dict)  # MLA: layer -> (1, r + R)

    def window_of(self, mask: Any) -> tuple[str, int | None] | None:
        """The window of a mask this probe built (the same tensor, or a view of it), else None."""
        if not isinstance(mask, torch.Tensor):
            return None
        for marker, window in self.masks:
            if mask is marker or (mask.data_ptr() == marker.data_ptr() and mask.device == marker.device):
                return window
        return None


def _visible(mask_function: Any, q: int, kv: int) -> bool:
    idx = (torch.tensor(0), torch.tensor(0), torch.tensor(q), torch.tensor(kv))
    return bool(mask_function(*idx))


def mask_window(mask_function: Any) -> tuple[str, int | None] | None:
    """What a transformers mask function (``mask_function(batch, head, q_idx, kv_idx) -> bool``) lets a query see:
    ("full_attention", None) for every earlier key, ("sliding_attention", W) for keys ``q - W < k <= q``,
    ("chunked_attention", C) for keys of its own chunk of C; None for anything else (not causal, or a pattern
    neither of these)."""
    try:
        if not _visible(mask_function, 0, 0) or _visible(mask_function, 0, 1):
            return None  # not causal
        if _visible(mask_function, _NO_WINDOW, 0):
            return "full_attention", None
        lo, hi = 1, _NO_WINDOW  # the first query position that no longer sees key 0: the window or the chunk
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (mid + 1, hi) if _visible(mask_function, mid, 0) else (lo, mid)
        if lo == 1 or _visible(mask_function, lo, 1):
            return "sliding_attention", lo
        if _visible(mask_function, 2 * lo - 1, lo) and not _visible(mask_function, 2 * lo, lo):
            return "chunked_attention", lo
    except Exception:  # noqa: BLE001 (a mask function this probe cannot evaluate on scalars: unknown)
        return None
    return None


def _probe_mask(*args: Any, **kwargs: Any) -> torch.Tensor:
    """The probe's mask builder: a marker tensor per requested mask, remembered with its window."""
    recorder = _RECORDER.get()
    if recorder is None:
        raise ValueError(f"attn_implementation={PROBE_NAME!r} runs only inside pagedkv.hf.probe.observe")
    shape = (kwargs.get("batch_size", 1), 1, kwargs.get("q_length", 1), kwargs.get("kv_length", 1))
    marker = torch.ones(shape, dtype=torch.bool, device=kwargs.get("device", "cpu"))
    recorder.masks.append((marker, mask_window(kwargs.get("mask_function"))))
    return marker


def _probe_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    *args: Any,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Record what `module` passes (query/key/value [B, H, T, D], its mask and window keyword); return zeros
    [B, T, H_q, D_v]."""
    recorder = _RECORDER.get()
    if recorder is None:
        raise ValueError(f"attn_implementation={PROBE_NAME!r} runs only inside pagedkv.hf.probe.observe")
    idx = getattr(module, "layer_idx", None)
    keyword = kwargs.get("sliding_window")
    if isinstance(idx, int) and idx not in recorder.layers:
        recorder.layers[idx] = Observed(
            (query.shape[1], query.shape[3]), (key.shape[1], key.shape[3]), (value.shape[1], value.shape[3]),
            recorder.window_of(attention_mask), None if keyword is None else int(keyword),
        )  # fmt: skip
    out = query.new_zeros(query.shape[0], query.shape[2], query.shape[1], value.shape[3])  # [B, T, H_q, D_v]
    return out, None


def _register() -> None:
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(PROBE_NAME, _probe_attention)
    AttentionMaskInterface.register(PROBE_NAME, _probe_mask)


def observe(model: torch.nn.Module, mla: bool = False) -> dict[int, Observed]:
    """Layer index -> what its attention module passed to the attention function in one 2-token forward of
    `model` (see the module doc; the model is left as it was). `mla`: also record each layer's cached latent
    (DeepSeek V2/V3), as the key and value of its `Observed`. Exceptions of the forward propagate."""
    _register()
    config: Any = model.config
    previous = config._attn_implementation
    param = next(model.parameters())
    recorder = _Recorder()
    kwargs: dict[str, Any] = {"use_cache": False}
    if mla:
        from pagedkv.hf.mla import LatentProbe

        kwargs = {"past_key_values": LatentProbe(recorder.latents), "use_cache": True}
    reset = _RECORDER.set(recorder)
    devices = [param.device] if param.device.type == "cuda" else []
    try:
        model.set_attn_implementation(PROBE_NAME)  # type: ignore[operator]
        with torch.random.fork_rng(devices=devices), torch.inference_mode():
            token = 1 if getattr(config, "pad_token_id", None) == 0 else 0  # (a pad token draws a warning)
            ids = torch.full((1, 2), token, dtype=torch.int64, device=param.device)
            model(input_ids=ids, position_ids=torch.arange(2, device=param.device)[None], **kwargs)
    finally:
        model.set_attn_implementation(previous)  # type: ignore[operator]
        _RECORDER.reset(reset)
    for idx, latent in recorder.latents.items():
        if idx in recorder.layers:
            seen = recorder.layers[idx]
            recorder.layers[idx] = Observed(seen.query, latent, latent, seen.window, seen.window_keyword)
    return recorder.layers
