"""Seeded request traces every bookkeeping bench replays, and their ideal (unbounded-cache) hit rates.

Token ids are drawn from a 32k vocabulary with numpy's PCG64, so every replay (and every manager) sees
exactly the same requests. Each request carries the tokens it will generate, so a conversation's next
turn can be built from the previous turn's full context, and two replays issue the same calls.

`shared_prefix_trace` (`pagedkv bench manager`, `pagedkv bench hybrid`, the manager demo): chat
requests in groups that share a system prompt, each with a unique suffix, groups drawn uniformly or
zipf-distributed. `WORKLOADS` (`python -m benchmarks.compare`, by `make_trace`):

    zipf        shared system prompts (64 of 1000 tokens), popularity zipf(s=1.0),
                + 250 unique tokens; 64 generated
    multiturn   conversations of 5 turns: a 500-token first message, then each
                turn = the previous turn's prompt + its answer + a 90-token message;
                64 generated per turn; turn k+1 arrives when turn k finishes; 32
                users chat at once (a conversation starts when an earlier one ends)
    fewshot     8 tasks x 8 examples of 90 tokens, a shared 70-token instruction;
                each prompt lists its task's examples in one of 6 orders, then a
                48-token question; 32 generated
    docqa       8 documents of 3990 tokens; questions of 30 tokens about one of
                them, uniformly; 64 generated
    nosharing   unique 1000-token prompts; 64 generated (the control)

Lengths are deliberately not multiples of the page size: real prompts are not.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "VOCAB",
    "WORKLOADS",
    "TraceRequest",
    "decode_trace",
    "ideal_hit_rates",
    "make_trace",
    "shared_prefix_trace",
    "touches_page",
    "unique_pages",
]

VOCAB = 32_000


@dataclass(eq=False)
class TraceRequest:
    """One request of a trace plus the driver's view of its progress.

    `tokens` holds the prompt followed by every token the request will
    generate; the live sequence is ``tokens[:num_tokens]``.
    """

    rid: int
    tokens: np.ndarray  # int32 [prompt_len + output_len]
    prompt_len: int
    after: int | None = None  # rid that must finish before this one arrives
    num_output: int = 0  # generated tokens so far (the sequence is prompt + these)
    num_computed: int = 0  # tokens whose KV is written
    admissions: int = 0
    handle: Any = None  # the adapter's per-request state

    @property
    def prompt(self) -> np.ndarray:
        return self.tokens[: self.prompt_len]  # int32 [prompt_len]

    @property
    def output(self) -> np.ndarray:
        """The tokens the request will generate."""
        return self.tokens[self.prompt_len :]  # int32 [output_len]

    @property
    def output_len(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def num_tokens(self) -> int:
        """Length of the live sequence (prompt + generated so far)."""
        return self.prompt_len + self.num_output

    @property
    def live_tokens(self) -> np.ndarray:
        return self.tokens[: self.num_tokens]  # int32 [num_tokens]

    def fresh(self) -> TraceRequest:
        """A copy with no progress (each replay starts from these)."""
        return TraceRequest(self.rid, self.tokens, self.prompt_len, self.after)


def _tokens(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(0, VOCAB, size=n, dtype=np.int32)


def _request(rid: int, prompt: np.ndarray, output: np.ndarray, after: int | None = None) -> TraceRequest:
    return TraceRequest(rid, np.concatenate([prompt, output]).astype(np.int32), len(prompt), after)


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
        trace.append(_request(i, np.concatenate([prefixes[g], suffix]), output))
    return trace


def zipf(n: int, rng: np.random.Generator) -> list[TraceRequest]:
    prefixes = [_tokens(rng, 1000) for _ in range(64)]
    weights = 1.0 / np.arange(1, 65) ** 1.0
    groups = rng.choice(64, size=n, p=weights / weights.sum())
    return [_request(i, np.concatenate([prefixes[g], _tokens(rng, 250)]), _tokens(rng, 64))
            for i, g in enumerate(groups.tolist())]  # fmt: skip


def multiturn(n: int, rng: np.random.Generator, turns: int = 5, users: int = 32) -> list[TraceRequest]:
    reqs: list[TraceRequest] = []
    last_turn: list[int] = []  # per conversation, the rid of its last turn
    for c in range(max(1, n // turns)):
        # `users` people chat at once: conversation c starts when conversation c - users has ended
        prompt, after = _tokens(rng, 500), (last_turn[c - users] if c >= users else None)
        for _ in range(turns):
            req = _request(len(reqs), prompt, _tokens(rng, 64), after)
            reqs.append(req)
            prompt, after = np.concatenate([req.tokens, _tokens(rng, 90)]), req.rid
        last_turn.append(reqs[-1].rid)
    return reqs


def fewshot(n: int, rng: np.random.Generator) -> list[TraceRequest]:
    instruction = _tokens(rng, 70)
    tasks = [[_tokens(rng, 90) for _ in range(8)] for _ in range(8)]
    orders = [[rng.permutation(8) for _ in range(6)] for _ in range(8)]
    reqs = []
    for i in range(n):
        t, o = int(rng.integers(8)), int(rng.integers(6))
        shots = [tasks[t][k] for k in orders[t][o]]
        reqs.append(_request(i, np.concatenate([instruction, *shots, _tokens(rng, 48)]), _tokens(rng, 32)))
    return reqs


def docqa(n: int, rng: np.random.Generator) -> list[TraceRequest]:
    docs = [_tokens(rng, 3990) for _ in range(8)]
    return [_request(i, np.concatenate([docs[int(rng.integers(8))], _tokens(rng, 30)]), _tokens(rng, 64))
            for i in range(n)]  # fmt: skip


def nosharing(n: int, rng: np.random.Generator) -> list[TraceRequest]:
    return [_request(i, _tokens(rng, 1000), _tokens(rng, 64)) for i in range(n)]


WORKLOADS: dict[str, Callable[[int, np.random.Generator], list[TraceRequest]]] = {
    "zipf": zipf, "multiturn": multiturn, "fewshot": fewshot, "docqa": docqa, "nosharing": nosharing,
}  # fmt: skip


def touches_page(num_tokens: int, page_size: int) -> bool:
    """Whether a one-token decode step of a sequence of `num_tokens` tokens (the new one included) takes a new
    page (``(num_tokens - 1) % page_size == 0``: alloc) or fills one (``num_tokens % page_size == 0``: step)."""
    return (num_tokens - 1) % page_size == 0 or num_tokens % page_size == 0


def decode_trace(page_size: int, num_requests: int = 256, seed: int = 0) -> list[TraceRequest]:
    """Requests that share nothing and decode together (`benchmarks.compare`'s decode-step figure): prompts of two
    full pages and one token, then ``page_size - 1`` generated tokens, so that after the prefill no step of a
    request takes a new page or fills one."""
    rng = np.random.default_rng([seed, 1 + len(WORKLOADS)])
    return [_request(i, _tokens(rng, 2 * page_size + 1), _tokens(rng, page_size - 1)) for i in range(num_requests)]


def make_trace(name: str, num_requests: int, seed: int = 0) -> list[TraceRequest]:
    """The `name` workload with about `num_requests` requests (multiturn rounds down to whole conversations)."""
    if name not in WORKLOADS:
        raise ValueError(f"workload={name!r} must be one of {tuple(WORKLOADS)}")
    if not isinstance(num_requests, int) or num_requests < 1:
        raise ValueError(f"num_requests={num_requests!r} must be an int >= 1")
    return WORKLOADS[name](num_requests, np.random.default_rng([seed, list(WORKLOADS).index(name)]))


def _page_keys(tokens: np.ndarray, page_size: int) -> list[int]:
    """Chained keys of the full pages of `tokens` (key k names tokens[: (k + 1) * page_size])."""
    keys, key = [], 0
    for k in range(len(tokens) // page_size):
        key = hash((key, tokens[k * page_size : (k + 1) * page_size].tobytes()))
        keys.append(key)
    return keys


def ideal_hit_rates(trace: list[TraceRequest], page_size: int) -> tuple[float, float]:
    """(page-granular, token-granular) prompt hit rates of an unbounded cache over first admissions in
    trace order: each prompt reuses the longest prefix any earlier request computed (all its tokens but
    the last), never its own last prompt token. Token-granular adds the longest match inside the next
    page (what partial-page reuse can reach)."""
    pages: set[int] = set()
    nexts: dict[tuple[int, int], list[np.ndarray]] = {}  # (page key, first token) -> following page's tokens
    hit_p = hit_t = total = 0
    for req in trace:
        prompt, cap = req.tokens[: req.prompt_len], req.prompt_len - 1
        keys = _page_keys(prompt[:cap], page_size)
        run = 0
        while run < len(keys) and keys[run] in pages:
            run += 1
        start = run * page_size
        want = prompt[start : min(cap, start + page_size)]
        best = 0
        if len(want):
            for cand in nexts.get((keys[run - 1] if run else 0, int(want[0])), ()):
                m = min(len(cand), len(want))
                diff = np.flatnonzero(cand[:m] != want[:m])
                best = max(best, int(diff[0]) if len(diff) else m)
        hit_p += start
        hit_t += start + best
        total += req.prompt_len
        computed = req.tokens[: len(req.tokens) - 1]
        ckeys = _page_keys(computed, page_size)
        pages.update(ckeys)
        for k in range(len(ckeys) + 1):
            page = computed[k * page_size : (k + 1) * page_size]
            if len(page):
                nexts.setdefault((ckeys[k - 1] if k else 0, int(page[0])), []).append(page)
    return hit_p / total, hit_t / total


def unique_pages(trace: list[TraceRequest], page_size: int) -> int:
    """Distinct full pages all requests compute: what an unbounded cache ends up holding."""
    seen: set[int] = set()
    for req in trace:
        seen.update(_page_keys(req.tokens[: len(req.tokens) - 1], page_size))
    return len(seen)
