"""One page policy per KV cache group type (`GroupManager` and its subclasses), and the registry that picks it.

`manager_for(group, spec)` gives the manager of a group from its layers' spec (`SPEC_MANAGERS`, as vLLM's
`spec_manager_map`); `min_request_pages` is the smallest pool in which a request alone runs to its end.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from pagedkv.core.groups.base import FAR, GroupManager, StepSpan
from pagedkv.core.groups.cross import CrossAttentionManager
from pagedkv.core.groups.full import FullAttentionManager, MLAAttentionManager
from pagedkv.core.groups.state import MambaManager
from pagedkv.core.groups.window import (
    ChunkedLocalAttentionManager,
    SinkAttentionManager,
    SlidingWindowManager,
    WindowManager,
)
from pagedkv.specs import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
)

__all__ = [
    "FAR", "GroupManager", "StepSpan", "FullAttentionManager", "MLAAttentionManager", "WindowManager",
    "SlidingWindowManager", "ChunkedLocalAttentionManager", "SinkAttentionManager", "CrossAttentionManager",
    "MambaManager", "SPEC_MANAGERS", "manager_for", "min_request_pages",
]  # fmt: skip


SPEC_MANAGERS: dict[type[KVCacheSpec], type[GroupManager]] = {
    FullAttentionSpec: FullAttentionManager,
    MLAAttentionSpec: MLAAttentionManager,
    SlidingWindowSpec: SlidingWindowManager,
    ChunkedLocalAttentionSpec: ChunkedLocalAttentionManager,
    SinkFullAttentionSpec: SinkAttentionManager,
    CrossAttentionSpec: CrossAttentionManager,
    MambaSpec: MambaManager,
}
"""The page-policy manager of each spec type (a spec subclass takes its nearest listed base's, as
`SlidingWindowMLASpec` takes `SlidingWindowSpec`'s), as vLLM's `spec_manager_map`."""


def manager_for(group: int, spec: KVCacheSpec) -> GroupManager:
    """The manager of group `group`, whose layers have `spec`; TypeError for a spec no manager serves."""
    for cls in type(spec).__mro__:
        manager = SPEC_MANAGERS.get(cls)
        if manager is not None:
            return manager.from_spec(group, spec)
    raise TypeError(f"no KV cache manager serves {type(spec).__name__}")


def min_request_pages(
    groups: Sequence[GroupManager], prompt_length: int, max_new_tokens: int, *, spec: int = 0, encoder_length: int = 0
) -> int:
    """The fewest pool pages in which a request of `prompt_length` tokens generating `max_new_tokens`
    runs alone to its end: no smaller pool can serve it, and this one does (one token a step at
    worst, the scheduler's smallest chunk).

    Its context grows to length = prompt_length + max_new_tokens - 1 (the last sampled token is never
    fed back). At each position q in [0, length) it runs a one-token step, during which each group
    holds `step_pages(q, q + 1, n)`, n = max(prompt_length, q + 1) the context's length then: full
    groups ceil((n + spec) / page_size) (the prompt is allocated at once); window groups the pages
    from the first one the query at q still reads (the sinks' pages too) through q's page and its
    `spec` draft slots (drops happen before the step's new pages are taken); cross-attention
    ceil(encoder_length / page_size). The answer is the peak over q of the groups' sum, and at
    least ceil((length + spec) / page_size): the coordinator refuses a context whose slots exceed
    the whole pool, windows or not.

    A request preempted by recompute comes back with its whole context as prompt and may need more
    (`min_request_pages(groups, length, 1, ...)`). Past every group's warmup the window counts
    repeat with the lcm of the periods while full counts only grow, so at most warmup + lcm
    positions are visited, whatever the length.
    """
    if prompt_length < 1 or max_new_tokens < 1:
        raise ValueError(f"prompt_length={prompt_length} and max_new_tokens={max_new_tokens} must be >= 1")
    length = prompt_length + max_new_tokens - 1
    warmup = max((g.periodicity()[0] for g in groups), default=0)
    period = math.lcm(*(g.periodicity()[1] for g in groups)) if groups else 1
    # window counts at q >= warmup depend on q mod period, full counts grow with q: [0, warmup) and
    # the last period (or all of [warmup, length)) hold the peak
    positions = (*range(min(length, warmup)), *range(max(warmup, length - period), length))
    tokens = [g for g in groups if g.holds_tokens]
    best = -(-(length + spec) // groups[0].page_size) if tokens else 0  # the coordinator's cap: every slot fits
    for q in positions:
        n = max(prompt_length, q + 1)
        best = max(best, sum(g.step_pages(q, q + 1, n, spec, encoder_length) for g in groups))
    return best
