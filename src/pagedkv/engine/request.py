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

    A request ends in one of four ways (`finish_reason`, vLLM's names): ``"length"`` (`max_new_tokens`
    generated), ``"stop"`` (a stop token, kept in `output`), ``"abort"`` (`LLMEngine.abort_request`) or
    ``"error"`` (its own sampling raised, e.g. non-finite probabilities: `error` holds the exception; the
    other requests of its step got their tokens). An aborted or failed request holds no page any more and
    `output` keeps what it generated before.
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
    ended: str | None = None  # "abort" or "error" once it was ended early (see `finish_reason`)
    error: Exception | None = None  # why it failed ("error"), else None

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
        """True after `max_new_tokens` tokens or a stop token, or once aborted or failed."""
        if self.ended is not None:
            return True
        generated = len(self.ctx.tokens) - self.prompt_len
        if generated >= self.max_new_tokens:
            return True
        return generated > 0 and int(self.ctx.tokens.all[-1]) in self.stop_token_ids

    @property
    def finish_reason(self) -> str | None:
        """``"length"``, ``"stop"``, ``"abort"`` or ``"error"`` once finished (see the class docstring); None before."""
        if self.ended is not None:
            return self.ended
        generated = len(self.ctx.tokens) - self.prompt_len
        if generated >= self.max_new_tokens:
            return "length"
        return "stop" if generated > 0 and int(self.ctx.tokens.all[-1]) in self.stop_token_ids else None

    @property
    def ttft(self) -> float | None:
        """Seconds from arrival to the first generated token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival
