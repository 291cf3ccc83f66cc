"""`Request`: one generation request as the engine tracks it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from pagedkv.core.context import TextContext
from pagedkv.engine.sampling import SamplingParams

__all__ = ["Request"]


@dataclass(eq=False)
class Request:
    """A prompt being served: its context, what it generated, and its timings.

    `ctx.tokens` always holds prompt + generated tokens; after a preemption
    the context is reset (everything becomes prompt) but `prompt_len` keeps
    the original split, so `output` is unaffected.
    """

    ctx: TextContext
    prompt_len: int
    max_new_tokens: int
    sampling: SamplingParams
    stop_token_ids: frozenset[int] = frozenset()
    generator: torch.Generator | None = None
    arrival: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    logits: list[torch.Tensor] = field(default_factory=list)
    preemptions: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache, summed over admissions
    restarted_at: int = -1  # context length at which the scheduler last restarted it, alone and stuck

    @property
    def request_id(self) -> object:
        """The context's request id."""
        return self.ctx.request_id

    @property
    def output(self) -> list[int]:
        """Generated token ids so far."""
        return self.ctx.tokens.all[self.prompt_len :].tolist()

    @property
    def finished(self) -> bool:
        """True after `max_new_tokens` tokens or a stop token."""
        generated = len(self.ctx.tokens) - self.prompt_len
        if generated >= self.max_new_tokens:
            return True
        return generated > 0 and int(self.ctx.tokens.all[-1]) in self.stop_token_ids

    @property
    def ttft(self) -> float | None:
        """Seconds from arrival to the first generated token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival
