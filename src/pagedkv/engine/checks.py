"""Argument checks of `LLMEngine.add_request` / `generate`, run before a request is queued.

A prompt outside the model's vocabulary is refused here, not in the forward pass, and so is
(`InsufficientBlocksError`) a request that the pool could never hold alone (`check_fits`): it would
block the head of the queue, or preempt itself forever. `generate` checks every prompt before queueing any.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from pagedkv.core.context import as_token_array
from pagedkv.core.errors import InsufficientBlocksError
from pagedkv.core.groups import manager_for, min_request_pages
from pagedkv.core.hashing import check_salt
from pagedkv.dtype import DType
from pagedkv.engine.sampling import SamplingParams
from pagedkv.hf.mixers import adapter_for
from pagedkv.hf.support import state_modules
from pagedkv.manager.paged import PagedKVCacheManager
from pagedkv.params.state import StateCacheParams
from pagedkv.params.validation import INT32_MAX, check_int

__all__ = ["check_fits", "check_prompts", "check_request"]


def check_request(
    model: Any,
    manager: PagedKVCacheManager,
    prompt: Any,
    max_new_tokens: Any,
    sampling: Any,
    stop_token_ids: Any,
    cache_salt: Any,
) -> np.ndarray:
    """The prompt as an int32 array; TypeError / ValueError for a request that cannot be served, and
    InsufficientBlocksError for one longer than the whole cache. Changes nothing."""
    tokens = as_token_array(prompt, name="prompt")
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if isinstance(vocab, int) and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab):
        bad = int(tokens.min()) if int(tokens.min()) < 0 else int(tokens.max())
        raise ValueError(f"prompt token {bad} is outside the model's vocabulary [0, {vocab})")
    check_int("max_new_tokens", max_new_tokens, 1, INT32_MAX)
    if not isinstance(sampling, SamplingParams):
        raise TypeError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
    if stop_token_ids is not None:
        if not isinstance(stop_token_ids, Sequence | set | frozenset) or isinstance(stop_token_ids, str | bytes):
            raise TypeError(f"stop_token_ids={stop_token_ids!r} must be a sequence of token ids or None")
        for token in stop_token_ids:
            if not isinstance(token, int | np.integer) or isinstance(token, bool):
                raise TypeError(f"stop_token_ids holds {token!r}; token ids are ints")
    check_salt(cache_salt)
    check_fits(manager, len(tokens), max_new_tokens)
    return tokens


def check_fits(manager: PagedKVCacheManager, prompt_length: int, max_new_tokens: int) -> None:
    """InsufficientBlocksError unless a request of `prompt_length` tokens generating `max_new_tokens`
    fits the whole pool alone: `pagedkv.core.groups.min_request_pages` over the manager's groups
    (full groups: every token; window groups: the peak of one step)."""
    params = manager.params
    spec = params.num_eagle_speculative_tokens
    length = prompt_length + max_new_tokens - 1  # the last sampled token is never fed back
    total, ps = manager.total_num_pages, manager.page_size
    if all(leaf.attention_kind == "full" for leaf in params.leaves()):
        slots = length + spec
        if slots > total * ps:
            raise InsufficientBlocksError(
                f"a prompt of {prompt_length} tokens with max_new_tokens={max_new_tokens} needs {slots} token slots "
                f"but the whole cache holds {total * ps} ({total} pages of {ps})",
                needed=-(-slots // ps),
                available=total,
            )
        return
    groups = [manager_for(g, leaf.kv_cache_spec) for g, leaf in enumerate(params.leaves())]
    need = min_request_pages(groups, prompt_length, max_new_tokens, spec=spec)
    if need > total:
        kinds = "+".join(leaf.attention_kind for leaf in params.leaves())
        raise InsufficientBlocksError(
            f"a prompt of {prompt_length} tokens with max_new_tokens={max_new_tokens} needs {need} pages of {ps} "
            f"at its peak (its {kinds} groups together, one step at a time) but the whole cache holds {total} "
            f"pages; raise num_pages or memory_budget, or shorten the request",
            needed=need,
            available=total,
        )


def check_prompts(prompts: Any) -> None:
    """`generate`'s prompts: a list of token-id sequences."""
    if not isinstance(prompts, Sequence) or isinstance(prompts, str | bytes):
        raise TypeError(f"prompts must be a list of token-id lists, got {type(prompts).__name__}")
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str | bytes) or not isinstance(prompt, Sequence | np.ndarray):
            raise TypeError(f"prompts[{i}]={prompt!r} must be a sequence of token ids")


def check_state_layers(model: torch.nn.Module, leaves: Sequence[Any], state_map: dict[int, tuple[int, int]]) -> None:
    """ValueError unless `state_map` covers exactly the model's recurrent mixers (`pagedkv.hf.support.state_modules`)
    and each names a `StateCacheParams` group whose `MambaSpec` has the shapes and dtypes the mixer's adapter
    reads and writes (one replica's whole TP group). Changes nothing."""
    mixers = state_modules(model)
    if sorted(mixers) != sorted(state_map):
        raise ValueError(f"state_map has layers {sorted(state_map)} but the model's recurrent mixers are at layers "
                         f"{sorted(mixers)}")  # fmt: skip
    dtype = next(model.parameters()).dtype
    for idx, (group, slot) in sorted(state_map.items()):
        leaf = leaves[group] if 0 <= group < len(leaves) else None
        if not isinstance(leaf, StateCacheParams) or not 0 <= slot < leaf.num_layers:
            raise ValueError(f"state_map[{idx}]=({group}, {slot}) is not a layer slot of a StateCacheParams group")
        name, module = mixers[idx]
        adapter = adapter_for(module)
        assert adapter is not None
        shapes, dtypes = adapter.state_spec(module, dtype)
        want = (tuple(tuple(s) for s in shapes), tuple(DType.from_torch(d) for d in dtypes))
        have = (leaf.spec.shapes, leaf.spec.dtypes)
        if want != have:
            raise ValueError(
                f"state group {group} (layer {idx}, {name}) has state shapes {have[0]} and dtypes "
                f"{[d.name for d in have[1]]}, but the mixer reads and writes {want[0]} in {[d.name for d in want[1]]}"
            )
