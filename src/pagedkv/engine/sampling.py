"""Token sampling: greedy by default, temperature / top-p with a per-request seed."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["SamplingParams", "sample"]


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token.

    Attributes:
        temperature: 0 means greedy (argmax); otherwise logits are divided by it.
        top_p: keep the smallest set of tokens whose probability reaches top_p.
        seed: seeds each request's generator (request i uses seed + i), so a
            request samples the same tokens whatever else is in its batch.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise TypeError(f"{name}={value!r} must be a number")
        if not 0 <= self.temperature < math.inf:
            raise ValueError(f"temperature={self.temperature} must be >= 0 and finite")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise TypeError(f"seed={self.seed!r} must be an int or None")

    @property
    def greedy(self) -> bool:
        """True when sampling is argmax."""
        return self.temperature == 0


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token id from logits [V] (float32)."""
    if params.greedy:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)  # [V]
    if params.top_p < 1:
        sorted_probs, order = torch.sort(probs, descending=True)  # [V]
        keep = torch.cumsum(sorted_probs, 0) - sorted_probs < params.top_p  # [V]: mass before each token
        probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_probs[keep])  # [V]
    return int(torch.multinomial(probs, 1, generator=generator))
