"""Token sampling: greedy by default; temperature, min-p, top-k and top-p with a per-request seed (vLLM's)."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["MIN_TEMPERATURE", "SamplingParams", "sample", "sample_batch"]

log = logging.getLogger(__name__)

MIN_TEMPERATURE = 1e-2
"""The smallest temperature sampled with (vLLM's rule): a smaller positive one is raised to it, with a warning.
Logits divided by a tiny temperature overflow to inf and the probabilities become NaN; 0 is greedy."""


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token (vLLM's `SamplingParams` semantics for these fields).

    Attributes:
        temperature: 0 means greedy (argmax; every other field is then ignored); otherwise logits
            are divided by it. A positive temperature below `MIN_TEMPERATURE` (0.01) is raised to it
            with a logged warning, as vLLM does (``SamplingParams(temperature=1e-40).temperature == 0.01``).
        top_p: keep the smallest set of most likely tokens whose probability reaches top_p, in (0, 1].
        top_k: keep the k most likely tokens; 0 or -1 (vLLM's two spellings) keep all of them.
        min_p: keep the tokens whose probability is at least min_p times the most likely one's, in
            [0, 1]; 0 keeps all of them.
        seed: seeds a generator of the request's own (as vLLM): the same prompt with the same seed
            samples the same tokens whatever its index, its batch or the requests before it, and
            two equal prompts with one seed sample equal tokens. None: torch's global generator.

    The filters apply in vLLM's order: temperature, then min-p, then top-k, then top-p (each on
    what the previous one kept), then one multinomial draw.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p", "min_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise TypeError(f"{name}={value!r} must be a number")
        if not 0 <= self.temperature < math.inf:
            raise ValueError(f"temperature={self.temperature} must be >= 0 and finite")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p={self.min_p} must be in [0, 1]")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool):
            raise TypeError(f"top_k={self.top_k!r} must be an int")
        if self.top_k < -1:
            raise ValueError(f"top_k={self.top_k} must be 0 or -1 (all tokens) or at least 1")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise TypeError(f"seed={self.seed!r} must be an int or None")
        if self.seed is not None and not -(1 << 63) <= self.seed < 1 << 64:
            raise ValueError(f"seed={self.seed} must fit in 64 bits")
        if 0 < self.temperature < MIN_TEMPERATURE:
            log.warning("temperature=%r is below %r, where logits / temperature overflow to inf; raised to %r",
                        self.temperature, MIN_TEMPERATURE, MIN_TEMPERATURE)  # fmt: skip
            object.__setattr__(self, "temperature", MIN_TEMPERATURE)  # (frozen: set once, here)

    @property
    def greedy(self) -> bool:
        """True when sampling is argmax."""
        return self.temperature == 0


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token id from logits [V] (float32). With a `generator`, the draw runs on its device.

    Raises RuntimeError (torch's multinomial check) when the probabilities are not finite (NaN or inf
    logits), and whatever the generator raises."""
    if params.greedy:
        return int(torch.argmax(logits))
    if generator is not None and logits.device != generator.device:
        logits = logits.to(generator.device)  # a seeded draw is the same on every device
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)  # [V]
    if params.min_p > 0:
        probs = torch.where(probs >= params.min_p * probs.max(), probs, 0.0)  # [V]
    if 0 < params.top_k < probs.numel():
        kth = torch.topk(probs, params.top_k).values[-1]
        probs = torch.where(probs >= kth, probs, 0.0)  # [V] (ties at the k-th value are kept)
    if params.top_p < 1:
        probs = probs / probs.sum()
        sorted_probs, order = torch.sort(probs, descending=True)  # [V]
        keep = torch.cumsum(sorted_probs, 0) - sorted_probs < params.top_p  # [V]: mass before each token
        probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_probs[keep])  # [V]
    return int(torch.multinomial(probs, 1, generator=generator))


def sample_batch(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    active: Sequence[bool],
    errors: dict[int, Exception] | None = None,
) -> list[int | None]:
    """One token per row of logits [B, V] whose `active` entry is True (None for the others), as `sample`
    draws it from that row in float32: the greedy rows with one reduction over them all in float32 (one
    host read for the batch; `torch.max`'s index is the first maximum, as `torch.argmax`'s, and on CPU
    several times cheaper), the others one by one.

    `errors`: when given, a row whose draw raises (`sample`: non-finite probabilities, a generator that
    fails) gets None and its exception under its index, and the other rows are drawn as usual; without
    it the first such exception propagates."""
    out: list[int | None] = [None] * len(params)
    greedy = [i for i, (p, on) in enumerate(zip(params, active, strict=True)) if on and p.greedy]
    if greedy:
        rows = logits if len(greedy) == logits.shape[0] else logits[greedy]  # [G, V]
        for i, token in zip(greedy, torch.max(rows.float(), dim=-1).indices.tolist(), strict=True):
            out[i] = token
    for i, (p, generator, on) in enumerate(zip(params, generators, active, strict=True)):
        if on and not p.greedy:
            if errors is None:
                out[i] = sample(logits[i].float(), p, generator)
                continue
            try:
                out[i] = sample(logits[i].float(), p, generator)
            except Exception as exc:  # this row's request fails alone (`LLMEngine.step`)
                errors[i] = exc
    return out
