"""Models for testing what is built on pagedkv: `PrefixStampModel`, a fake model that proves a cache never
serves the wrong KV, and `build_llama` / `build_demo_model`, small Llama-style transformers models with
seeded random weights (no download) that the demos, the benchmarks and `pagedkv engine` serve.

`PrefixStampModel`: for every token it runs, it writes into the page slot the lookup table names
a value derived from the token's whole prefix (K = f(prefix), V = f(prefix) + 1,
on every layer, head and shard). Before writing, it checks that every cached
position of every request already holds the value of *that request's* prefix.
Any wrong page reuse, a stale page, a page shared while still being written,
or a lookup-table slip shows up as a mismatch.

State groups (`StateCacheParams`) are checked the same way: a request's state
slot holds, in every element of every state tensor of every layer, the value of
the prefix it has processed (the stamp of a recurrent state that covers all its
tokens). Before writing the stamp of the prefix after the step, the model checks
that a slot it continues from (``has_initial_state``) holds its own prefix's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from pagedkv.core.context import TextContext
from pagedkv.manager.paged import PagedKVCacheManager
from pagedkv.params.kv import KVCacheParams
from pagedkv.runtime.inputs import KVCacheInputs, MultiKVCacheInputs, RaggedKVCacheInputs, StateCacheInputs

__all__ = ["PrefixStampModel", "build_demo_model", "build_llama", "prefix_values"]

_MOD = (1 << 24) - 3  # values stay exact in float32


def prefix_values(tokens: np.ndarray, known: np.ndarray | None = None) -> np.ndarray:
    """value[p] = rolling hash of tokens[:p + 1], exact in float32.

    `known`, the values of a prefix of `tokens`, is extended instead of recomputed.
    """
    start = 0 if known is None else min(len(known), len(tokens))
    out = np.empty(len(tokens), dtype=np.int64)
    out[:start] = known[:start] if known is not None else []
    h = int(out[start - 1]) if start else 7
    for i, t in enumerate(tokens[start:].tolist(), start):
        h = (h * 1_000_003 + int(t) + 11) % _MOD
        out[i] = h
    return out


class PrefixStampModel:
    """Checks, then writes, the KV of a batch through `runtime_inputs` (fp32/fp64 caches).

    Use it to test a scheduler or an engine built on `PagedKVCacheManager`:
    call `forward(batches)` where the real model would run. It raises
    AssertionError naming the request and position at the first wrong value.
    """

    def __init__(self, manager: PagedKVCacheManager) -> None:
        self.manager = manager
        self.page_size = manager.page_size
        self.positions_checked = 0  # cached positions verified so far
        self._memo: dict[object, tuple[np.ndarray, np.ndarray]] = {}  # request id -> (tokens, their values)

    def forward(self, batches: Sequence[Sequence[TextContext]]) -> KVCacheInputs:
        """Check every cached position each request can read, then write the active tokens' values."""
        inputs = self.manager.runtime_inputs(batches)
        groups = list(inputs.children.values()) if isinstance(inputs, MultiKVCacheInputs) else [inputs]
        for g, group in enumerate(groups):
            for state in (r for r in group.inputs if isinstance(r, StateCacheInputs)):
                per_replica = len(group.inputs) // self.manager.num_replicas
                self._run_state(state, batches[group.inputs.index(state) // per_replica])
            records = [r for r in group.inputs if isinstance(r, RaggedKVCacheInputs)]
            per_replica = len(records) // self.manager.num_replicas
            for i, record in enumerate(records):
                replica = i // per_replica
                policy = self._policy(replica, g)
                if policy is None or not policy.is_cross_attention:  # encoder pages: not written by decoder tokens
                    self._run_device(record, batches[replica], replica, policy)
        return inputs

    def _policy(self, replica: int, group: int) -> KVCacheParams | None:
        """The cache's params, which say (independently of the managers) which keys a query sees."""
        return self.manager.params.leaves()[group] if self.manager.hybrid else None

    def _prefix_values(self, ctx: TextContext, end: int) -> np.ndarray:
        """prefix_values of the request's first `end` tokens, extending the last result when it still applies."""
        tokens = ctx.tokens.all[:end]
        known = None
        if ctx.request_id in self._memo:
            old_tokens, old_values = self._memo[ctx.request_id]
            k = min(len(old_tokens), end)
            if np.array_equal(old_tokens[:k], tokens[:k]):
                known = old_values[:k]
        values = prefix_values(tokens, known)
        self._memo[ctx.request_id] = (tokens.copy(), values)
        return values

    def _run_state(self, record: StateCacheInputs, batch: Sequence[TextContext]) -> None:
        """Check then stamp the state slots of `batch` (see the module docstring)."""

        def stamp_of(ctx: TextContext, end: int) -> float:
            return float(self._prefix_values(ctx, end)[end - 1])

        self.positions_checked += _check_then_stamp_states(record, batch, stamp_of)

    def _run_device(
        self, record: RaggedKVCacheInputs, batch: Sequence[TextContext], replica: int, policy: KVCacheParams | None
    ) -> None:
        ps, blocks = self.page_size, record.blocks  # [pages+1, kv_dim, L, ps, H, D]
        pool = self.manager._managers[replica].pool
        same_step = bool(getattr(self.manager._managers[replica], "commit_on_alloc", False))
        reads = []
        for b, ctx in enumerate(batch):  # writes first: every layer stores the batch's KV before attention
            cached = int(record.cache_lengths[b])
            assert cached == ctx.tokens.processed_length
            end = ctx.tokens.current_position
            values = torch.from_numpy(self._prefix_values(ctx, end).astype(np.float32))  # [end]
            lut = record.lookup_table[b].long()  # [cols]
            pos = torch.arange(end)  # [end]
            pages, slots = lut[pos // ps], pos % ps  # [end], [end]
            assert not (pages[cached:] == pool.null_block).any(), f"{ctx.request_id!r}: an active position is null"
            # a state checkpoint's tail references the page that holds it: slots past the tail stay writable
            states = getattr(self.manager._managers[replica], "states", None)
            tails = states.tail_lengths() if states is not None else {}
            refs = states.tail_refs() if states is not None else {}
            written = list(zip(pages[cached:].tolist(), slots[cached:].tolist(), strict=True))
            assert all(slot >= tails.get(page, 0) for page, slot in written), (
                f"{ctx.request_id!r} writes into a state checkpoint's tail"
            )
            shared = [p for p in {p for p, _ in written} if pool.ref_count(p) - refs.get(p, 0) != 1]
            # (commit_on_alloc: a request admitted in this step may already share the pages this one fills)
            assert same_step or not shared, f"{ctx.request_id!r} writes into shared pages {shared}"
            active = values[cached:].view(-1, 1, 1, 1)  # [active, 1, 1, 1]
            blocks[pages[cached:], 0, :, slots[cached:]] = active.expand(-1, *blocks.shape[2:3], *blocks.shape[4:])
            if blocks.shape[1] == 2:
                blocks[pages[cached:], 1, :, slots[cached:]] = (
                    active.expand(-1, *blocks.shape[2:3], *blocks.shape[4:]) + 1
                )
            reads.append((ctx, cached, values, pages, slots, pos))
        for ctx, cached, values, pages, slots, pos in reads:  # then every cached position a query reads
            read = _readable(pos[:cached], cached, policy)  # [cached] bool: positions a query of this step can see
            assert not (pages[:cached][read] == pool.null_block).any(), (
                f"{ctx.request_id!r}: a readable position is null"
            )
            got = blocks[pages[:cached][read], 0, :, slots[:cached][read]]  # [readable, L, H, D]
            want = values[:cached][read].view(-1, 1, 1, 1).expand_as(got)
            bad = (got != want).nonzero()
            assert bad.numel() == 0, f"{ctx.request_id!r}: a cached position holds another prefix's KV"
            if blocks.shape[1] == 2:
                got_v = blocks[pages[:cached][read], 1, :, slots[:cached][read]]  # [readable, L, H, D]
                assert torch.equal(got_v, want + 1), f"{ctx.request_id!r}: V differs from K + 1"
            self.positions_checked += int(read.sum())


def _check_then_stamp_states(
    record: StateCacheInputs, batch: Sequence[TextContext], stamp_of: Callable[[TextContext, int], float]
) -> int:
    """Check that every slot a request continues from holds its processed prefix's stamp, then write the
    stamp of the prefix after the step. Returns how many slots were checked."""
    checked = 0
    slots = record.state_slots[:, 0].long().tolist()
    for b, ctx in enumerate(batch):
        cached = int(record.cache_lengths[b])
        assert cached == ctx.tokens.processed_length
        assert bool(record.has_initial_state[b]) == (cached > 0)
        for tensors in record.layer_states:
            for state in tensors:
                if cached:
                    want = stamp_of(ctx, cached)
                    assert bool((state[slots[b]] == want).all()), (
                        f"{ctx.request_id!r}: its state slot holds another state"
                    )
                    checked += 1
                state[slots[b]] = stamp_of(ctx, ctx.tokens.current_position)
    return checked


def _readable(positions: torch.Tensor, first_query: int, params: KVCacheParams | None) -> torch.Tensor:
    """[n] bool: cached positions the step's first query (and so every later one) attends to.

    From the attention semantics (transformers' masks), not from the managers:
    window W: k > q - W; chunk C: k // C == q // C; sinks: also k < sink_tokens.
    """
    if params is None or params.attention_kind == "full":
        return torch.ones_like(positions, dtype=torch.bool)
    if params.attention_chunk_size is not None:
        return positions // params.attention_chunk_size == first_query // params.attention_chunk_size
    assert params.sliding_window is not None
    return (positions > first_query - params.sliding_window) | (positions < params.sink_tokens)


def build_llama(seed: int = 0, attn_implementation: str = "eager", **config: Any) -> Any:
    """A Llama-style causal LM from `config` (`LlamaConfig` fields) with seeded random weights, no
    BOS/EOS (every request generates its `max_new_tokens`), pad id 0, in eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    fields: dict[str, Any] = dict(eos_token_id=None, bos_token_id=None, pad_token_id=0)
    fields.update(config)
    torch.manual_seed(seed)
    model = LlamaForCausalLM._from_config(LlamaConfig(**fields), attn_implementation=attn_implementation)
    model.generation_config.eos_token_id = None
    return model.eval()


def build_demo_model(seed: int = 0, attn_implementation: str = "eager") -> Any:
    """A 4-layer Llama-style model (hidden 128, GQA 8:2 heads, vocab 512) with seeded random weights."""
    return build_llama(
        seed, attn_implementation, vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.1,
    )  # fmt: skip
