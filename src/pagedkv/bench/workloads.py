"""Seeded synthetic request traces.

`shared_prefix_trace`: chat requests in groups that share a system prompt,
each with a unique user suffix and a fixed number of decode steps. Token ids
are drawn from a 32k vocabulary; generated tokens are fixed by the seed too,
so two replays of a trace issue exactly the same calls.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["TraceRequest", "shared_prefix_trace", "ideal_hit_rate"]

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
    zipf: float = 0.0,
) -> list[TraceRequest]:
    """Requests assigned to `num_groups` system prompts, in arrival order: uniformly at random,
    or with probability proportional to ``1 / rank ** zipf`` when `zipf` > 0."""
    rng = np.random.default_rng(seed)
    prefixes = rng.integers(0, VOCAB, size=(num_groups, prefix_len), dtype=np.int32)
    if zipf > 0:
        weights = 1.0 / np.arange(1, num_groups + 1) ** zipf
        groups = rng.choice(num_groups, size=num_requests, p=weights / weights.sum())
    else:
        groups = rng.integers(0, num_groups, size=num_requests)
    trace = []
    for i, g in enumerate(groups.tolist()):
        suffix = rng.integers(0, VOCAB, size=suffix_len, dtype=np.int32)
        output = rng.integers(0, VOCAB, size=decode_steps, dtype=np.int32)
        trace.append(TraceRequest(i, np.concatenate([prefixes[g], suffix]), output, g))
    return trace


def ideal_hit_rate(trace: list[TraceRequest], page_size: int) -> float:
    """Prompt-token hit rate of an unbounded page-granular cache: each request reuses the longest
    page-aligned prefix any earlier prompt shares (never its last token)."""
    seen: set[bytes] = set()
    hit = total = 0
    for req in trace:
        prompt = req.prompt
        pages = (len(prompt) - 1) // page_size
        keys = [prompt[: (i + 1) * page_size].tobytes() for i in range(pages)]
        run = 0
        while run < pages and keys[run] in seen:
            run += 1
        hit += run * page_size
        total += len(prompt)
        seen.update(keys)
    return hit / total if total else 0.0
