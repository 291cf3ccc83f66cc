"""`AttentionOptions`: what `paged_attention` attends beyond plain causal attention (Hugging Face semantics).

Positions are absolute: query token i of request b sits at ``q = cache_lengths[b] + i``
and key k at its own position. With ``causal=True`` (default) key k is visible to q iff
``k <= q`` and

* ``sliding_window=W``: ``k > q - W`` (W keys including q itself; transformers'
  ``sliding_window`` overlay, as in Mistral, Gemma and gpt-oss);
* ``chunk_size=C``: ``k // C == q // C`` (Llama 4 chunked local attention);
* both: both conditions;
* ``sink_tokens=S``: keys ``k < S`` are visible whatever the window or chunk says
  (StreamingLLM attention sinks; a no-op without a window or chunk).

So the visible keys are at most two ranges, ``[0, min(S, lo))`` and ``[lo, q]`` with
``lo = max(0, q - W + 1, q // C * C)``: the fast paths gather exactly those.
``causal=False`` (cross-attention): every query of request b sees keys
``0..cache_lengths[b] - 1`` and nothing else (no window, chunk or sink tokens).

``sinks [H_q]`` are learned per-head sink logits (gpt-oss ``s_aux``): the softmax runs
over ``[logits..., sink]`` (the sink neither scaled nor soft-capped) and the sink's
probability is dropped, so it adds no value. ``v_head_dim=Dv`` reads values as the first
Dv elements of the V slot (MLA's single slot: values are the first Dv elements of the
key) and the output is ``[T, H_q, Dv]``. A query with no visible key (cross-attention
over an empty cache) outputs zeros.

``alibi_slopes [H_q]`` (ALiBi): query head h adds ``alibi_slopes[h] * (k - q)`` (key
position minus query position, float32) to each visible key's logit, after the scale and
the softcap and before the softmax (and the learned sink, which gets no bias). Softmax is
shift invariant per query, so this equals transformers' Bloom (``slope * k`` added to the
scaled logits) and MPT (``slope * (k - (max_seq_len - 1))``) with their slopes as given;
Falcon adds ``slope * k`` *before* scaling, so pass Falcon's slopes times the scale.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedkv.params.validation import check_int

__all__ = ["AttentionOptions"]


@dataclass(frozen=True, eq=False)
class AttentionOptions:
    """The keyword options of `paged_attention` (see module docstring); all off by default."""

    sliding_window: int | None = None
    chunk_size: int | None = None
    sink_tokens: int = 0
    sinks: torch.Tensor | None = None
    v_head_dim: int | None = None
    causal: bool = True
    alibi_slopes: torch.Tensor | None = None

    def check(self, num_q_heads: int, head_dim: int) -> None:
        """Raise TypeError / ValueError on an invalid or contradictory option."""
        if self.sliding_window is not None:
            check_int("sliding_window", self.sliding_window, 1)
        if self.chunk_size is not None:
            check_int("chunk_size", self.chunk_size, 1)
        check_int("sink_tokens", self.sink_tokens, 0)
        if self.v_head_dim is not None:
            check_int("v_head_dim", self.v_head_dim, 1)
            if self.v_head_dim > head_dim:
                raise ValueError(f"v_head_dim={self.v_head_dim} must be at most head_dim={head_dim}")
        if self.sinks is not None and tuple(self.sinks.shape) != (num_q_heads,):
            raise ValueError(f"sinks shape {tuple(self.sinks.shape)} != [H_q={num_q_heads}]")
        if self.alibi_slopes is not None:
            if not isinstance(self.alibi_slopes, torch.Tensor) or not self.alibi_slopes.is_floating_point():
                raise TypeError(f"alibi_slopes must be a floating-point tensor [H_q], got {self.alibi_slopes!r}")
            if tuple(self.alibi_slopes.shape) != (num_q_heads,):
                raise ValueError(f"alibi_slopes shape {tuple(self.alibi_slopes.shape)} != [H_q={num_q_heads}]")
        if not isinstance(self.causal, bool):
            raise TypeError(f"causal={self.causal!r} must be a bool")
        if not self.causal and (self.local or self.sink_tokens):
            raise ValueError("causal=False (cross-attention) takes no sliding_window, chunk_size or sink_tokens")

    @property
    def local(self) -> bool:
        """A sliding window or a chunk limits how far back a query sees."""
        return self.sliding_window is not None or self.chunk_size is not None

    @property
    def enabled(self) -> tuple[str, ...]:
        """Names of the options that are on (what the Triton decode kernel does not implement)."""
        names = []
        for name in ("sliding_window", "chunk_size", "sinks", "v_head_dim", "alibi_slopes"):
            if getattr(self, name) is not None:
                names.append(name)
        if self.sink_tokens:
            names.append("sink_tokens")
        if not self.causal:
            names.append("causal=False")
        return tuple(names)

    def window_start(self, q_pos: torch.Tensor) -> torch.Tensor:
        """``lo`` of the module docstring: the first key the window / chunk lets q_pos (int64 [...]) see."""
        lo = torch.zeros_like(q_pos)
        if self.sliding_window is not None:
            lo = torch.maximum(lo, q_pos - (self.sliding_window - 1))
        if self.chunk_size is not None:
            lo = torch.maximum(lo, q_pos - q_pos % self.chunk_size)
        return lo

    def key_ranges(self, q_pos: torch.Tensor, kv_len: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(sink_end, lo, hi), each int64 like q_pos: q_pos sees keys ``[0, sink_end)`` and ``[lo, hi)``.

        `kv_len` (broadcastable) is the request's key count: its cache length when not causal.
        The ranges never overlap (``sink_end <= lo``); empty ones have ``end <= start``.
        """
        if not self.causal:
            hi = torch.broadcast_to(kv_len, q_pos.shape).to(torch.int64)
            return torch.zeros_like(hi), torch.zeros_like(hi), hi
        lo = self.window_start(q_pos)
        return torch.clamp(lo, max=self.sink_tokens), lo, q_pos + 1

    def sink_logits(self, device: torch.device) -> torch.Tensor | None:
        """The learned sinks as float32 [H_q] on `device` (None when off)."""
        return None if self.sinks is None else self.sinks.to(device=device, dtype=torch.float32)

    def alibi(self, device: torch.device) -> torch.Tensor | None:
        """The ALiBi slopes as float32 [H_q] on `device` (None when off)."""
        return None if self.alibi_slopes is None else self.alibi_slopes.to(device=device, dtype=torch.float32)
