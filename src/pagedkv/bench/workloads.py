"""Seeded synthetic request traces.

`shared_prefix_trace`: chat requests in groups that share a system prompt,
each with a unique user suffix and a fixed number of decode steps. Token ids
are drawn from a 32k vocabulary; generated tokens are fixed by the seed too,
so two replays of a trace issue exactly the same calls.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["TraceRequest", "shared_prefix_trace"]

VOCAB = 32_000


@dataclass(frozen=True, eq=False)
class TraceRequest:
    """One request of a trace: prompt, the tokens it will generate, and its group."""

    request_id: int
    prompt: np.ndarray  # int32 [prompt_len]
    output: np.ndarray  # int32 [decode_steps]
    group: int


def shared_prefix_trace(
    num_requests: int = 2000,
    num_groups: int = 16,
    prefix_len: int = 1024,
    suffix_len: int = 256,
    decode_steps: int = 128,
    seed: int = 0,
) -> list[TraceRequest]:
    """Requests assigned to `num_groups` system prompts uniformly at random, in arrival order."""
    rng = np.random.default_rng(seed)
    prefixes = rng.integers(0, VOCAB, size=(num_groups, prefix_len), dtype=np.int32)
    groups = rng.integers(0, num_groups, size=num_requests)
    trace = []
    for i, g in enumerate(groups.tolist()):
        suffix = rng.integers(0, VOCAB, size=suffix_len, dtype=np.int32)
        output = rng.integers(0, VOCAB, size=decode_steps, dtype=np.int32)
        trace.append(TraceRequest(i, np.concatenate([prefixes[g], suffix]), output, g))
    return trace
