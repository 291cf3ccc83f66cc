"""Hostile inputs, beds: the ops, engine and tier setups and the composite manager setups.

Each returns a `Case.setup` (or is one): fresh objects, a `Trial` of the bad call and the state it must
leave as it was. The row types and the core builders are in `hostile_support`.
"""

from __future__ import annotations

import math
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from hostile_support import CPU, LOCAL, Pages, Trial, manager, mgr_state, params, running

from pagedkv import ops
from pagedkv.core.context import TextContext
from pagedkv.manager.paged import PagedKVCacheManager
from pagedkv.params import KVCacheParams
from pagedkv.params.connector import KVConnectorConfig
from pagedkv.params.multi import MultiKVCacheParams
from pagedkv.runtime.inputs import RaggedKVCacheInputs


@dataclass
class OpsBed:
    """A manager's step inputs: request "a" (6 tokens) allocated, K/V/Q of the step, the offsets."""

    mgr: PagedKVCacheManager
    inputs: Any
    offsets: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    query: torch.Tensor


def ops_bed(nonfinite: str = "pass", mla: bool = False, sizes: tuple[int, ...] = (6,)) -> OpsBed:
    """Requests "a", "b", ... of `sizes` new tokens (default: "a" alone, 6 tokens)."""
    extra: dict[str, Any] = dict(is_mla=True, n_kv_heads=1, num_q_heads=2) if mla else {}
    mgr = manager(nonfinite_kv=nonfinite, **extra)
    ctxs = [running(mgr, rid, n=n) for rid, n in zip("abcd", sizes, strict=False)]
    inputs = mgr.runtime_inputs([ctxs]).inputs[0]
    g = torch.Generator().manual_seed(0)
    heads, tokens = 1 if mla else 2, sum(sizes)
    kv = [torch.randn(tokens, heads, 4, generator=g) for _ in range(2)]
    offsets = torch.tensor([0, *np.cumsum(sizes).tolist()])
    return OpsBed(mgr, inputs, offsets, kv[0], kv[1], torch.randn(tokens, 2, 4, generator=g))


def on_ops(call: Callable[[OpsBed], Any], nonfinite: str = "pass", backend: str = "torch",
           check: Callable[[OpsBed], Callable[[Any], None]] | None = None, mla: bool = False,
           sizes: tuple[int, ...] = (6,)) -> Callable[[], Trial]:  # fmt: skip
    """`call(bed)` under `backend`; the state is the bytes of every page."""

    def setup() -> Trial:
        bed = ops_bed(nonfinite, mla, sizes)

        def run() -> Any:
            with ops.use_backend(backend):
                return call(bed)

        state = lambda: Pages([bed.inputs.blocks])  # noqa: E731
        return Trial(run, state, check(bed) if check else None, bed.mgr.close)

    return setup


def with_nan(x: torch.Tensor, value: float = math.nan) -> torch.Tensor:
    y = x.clone()
    y[0, 0, 0] = value
    return y


def nan_stored(bed: OpsBed) -> Callable[[Any], None]:
    def check(_: Any) -> None:
        page = bed.mgr.get_req_blocks("a")[0]
        assert torch.isnan(bed.inputs.blocks[page, 0, 0, 0, 0, 0]), "the NaN key was not stored as is"

    return check


# ----------------------------------------------------------------- engine
TINY_LLAMA = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, max_position_embeddings=128)  # fmt: skip


def engine(nan_weights: bool = False, **params_kwargs: Any) -> Any:
    """A fresh `LLMEngine` over a 1-layer Llama (vocab 64) and 16 pages of 4 tokens."""
    from pagedkv.engine import LLMEngine
    from pagedkv.testing import build_llama

    model = build_llama(0, **TINY_LLAMA)
    if nan_weights:  # every key of layer 0 becomes NaN
        with torch.no_grad():
            model.model.layers[0].self_attn.k_proj.weight.fill_(math.nan)
    return LLMEngine.from_hf(model, page_size=4, num_pages=16, max_batch_size=2, max_num_batched_tokens=32,
                             **params_kwargs)  # fmt: skip


def engine_state(eng: Any) -> tuple[Any, ...]:
    sched = eng.scheduler
    return ([r.request_id for r in sched.waiting], [r.request_id for r in sched.running], eng._next_id,
            mgr_state(eng.manager))  # fmt: skip


def on_engine(call: Callable[[Any], Any], nan_weights: bool = False, pages_only: bool = False,
              check: Callable[[Any], None] | None = None, queued: bool = False, **kw: Any) -> Callable[[], Trial]:  # fmt: skip
    """`call(engine)`; the state is the engine's queue and manager, or only the page bytes (`pages_only`).
    `queued`: request 0 (prompt [1, 2], 2 tokens) waits in the engine first."""

    def setup() -> Trial:
        eng = engine(nan_weights, **kw)
        if queued:
            eng.add_request([1, 2], 2)
        state = (lambda: Pages([t for b in eng.manager._buffers for t in b.all_buffers])) if pages_only else (
            lambda: engine_state(eng))  # fmt: skip
        return Trial(lambda: call(eng), state, check, eng.manager.close)

    return setup


def generated(expected: int) -> Callable[[Any], None]:
    def check(outputs: Any) -> None:
        assert [len(o) for o in outputs] == [expected], outputs

    return check


# ----------------------------------------------------------------- tiers
def on_connector(call: Callable[[Any], Any]) -> Callable[[], Trial]:
    """`call(connector)` on the host-tier connector of a local manager whose request "a" ran one step."""

    def setup() -> Trial:
        mgr = manager(host_pages=4, **LOCAL)
        c = running(mgr)
        mgr.runtime_inputs([[c]])
        c.update(10)
        mgr.step([[c]])
        mgr.sync_tiers()
        conn = mgr.tiers.connectors[0]

        def state() -> Any:
            conn.wait_for_offloads()
            return mgr_state(mgr, c)

        return Trial(lambda: call(conn), state, close=mgr.close)

    return setup


def tiered_params(directory: str, model_id: str = "llama-a", **overrides: Any) -> KVCacheParams:
    config = KVConnectorConfig(model_id=model_id, disk_offload_dir=directory)
    return params(kv_connector="tiered", host_kvcache_swap_space_gb=1, kv_connector_config=config, **overrides)


PROMPT = np.arange(1, 14)  # 13 tokens: 3 full pages of 4 are hashed


def tier_miss(**reader: Any) -> Callable[[], Trial]:
    """A manager of layout A fills a disk directory with PROMPT's pages; a manager whose layout or model
    differs by `reader` opens the same directory and admits PROMPT: it must load none of them."""

    def setup() -> Trial:
        directory = tempfile.mkdtemp(prefix="pagedkv-hostile-")
        writer = PagedKVCacheManager(tiered_params(directory), None, 8, 4, max_batch_size=2)
        c = TextContext("w", PROMPT)
        writer.claim("w")
        writer.alloc(c)
        writer.runtime_inputs([[c]])
        c.update(99)
        writer.step([[c]])
        writer.runtime_inputs([[c]])
        writer.sync_tiers()
        writer.close()
        options = dict(reader)
        reader_params = tiered_params(directory, options.pop("model_id", "llama-a"), **options)
        mgr = PagedKVCacheManager(reader_params, None, 8, 4, max_batch_size=2)
        r = TextContext("r", PROMPT)
        mgr.claim("r")

        def check(_: Any) -> None:
            assert r.cached_prefix_length == 0 and mgr.tier_stats()["disk"]["pages_loaded"] == 0
            assert r.tokens.processed_length == 0

        def admit() -> TextContext:
            mgr.alloc(r)
            return r

        def close() -> None:
            mgr.close()
            shutil.rmtree(directory, ignore_errors=True)

        return Trial(admit, check=check, close=close)

    return setup


# ----------------------------------------------------------------- misc. helpers
def manager_then(prepare: Callable[[PagedKVCacheManager, TextContext], Any],
                 call: Callable[[PagedKVCacheManager, TextContext], Any], **kw: Any) -> Callable[[], Trial]:  # fmt: skip
    """Like `on_manager`, with `prepare(mgr, ctx)` run before the state is taken."""

    def setup() -> Trial:
        mgr = manager(**kw)
        c = running(mgr)
        prepare(mgr, c)
        return Trial(lambda: call(mgr, c), lambda: mgr_state(mgr, c), close=mgr.close)

    return setup


def step_ready(mgr: PagedKVCacheManager, c: TextContext) -> None:
    """Request "a" ran its forward: the next `step` would commit two pages."""
    mgr.runtime_inputs([[c]])
    c.update(10)


def dp_step_with_unknown() -> Trial:
    """Two data-parallel replicas; replica 0's batch is fine, replica 1's names an unknown request."""
    p = params(devices=[CPU, CPU], data_parallel_degree=2)
    mgr = PagedKVCacheManager(p, None, 8, 0, True, max_batch_size=4)
    a = running(mgr, "a", replica=0)
    mgr.runtime_inputs([[a], []])
    a.update(10)
    ghost = TextContext("ghost", [1, 2, 3])
    return Trial(lambda: mgr.step([[a], [ghost]]), lambda: mgr_state(mgr, a))


def full_pool_swap_in() -> Trial:
    """Request "a" swapped out, then "b" takes every device page: swapping "a" back in cannot fit."""
    mgr = manager(host_pages=8, **LOCAL)
    a = running(mgr)
    assert mgr.swap_out("a")
    running(mgr, "b", n=32)
    return Trial(lambda: mgr.swap_in(a), lambda: mgr_state(mgr, a), close=mgr.close)


def swapped_out(mgr: PagedKVCacheManager, c: TextContext) -> None:
    assert mgr.swap_out(c.request_id)


def hybrid_manager() -> PagedKVCacheManager:
    tree = MultiKVCacheParams({"full": params(), "window": params(sliding_window=8)})
    return PagedKVCacheManager(tree, None, 16, 0, True, max_batch_size=2)


def on_hybrid(call: Callable[[PagedKVCacheManager, TextContext], Any]) -> Callable[[], Trial]:
    def setup() -> Trial:
        mgr = hybrid_manager()
        c = TextContext("a", np.arange(1, 20))
        mgr.claim("a")
        mgr.alloc(c, num_scheduled_tokens=19)
        return Trial(lambda: call(mgr, c), lambda: mgr_state(mgr, c))

    return setup


def five_dim(inputs: RaggedKVCacheInputs) -> RaggedKVCacheInputs:
    """`inputs` with a page tensor of 5 dims (page 0 of the real one)."""
    return RaggedKVCacheInputs(inputs.blocks[0], inputs.cache_lengths, inputs.lookup_table, inputs.max_lengths)


def buffer_values(**kw: Any) -> list[torch.Tensor]:
    return [torch.zeros(9, 2, 2, 4, 2, 4, **kw)]
