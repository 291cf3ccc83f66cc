"""pagedkv's `KVCacheCoordinator` with state checkpoints behind the compare driver (Qwen3.5-shaped hybrid).

The model is `peer_vllm_hybrid.HybridShape` (defaults: Qwen3.5-9B, importable without vLLM): 8 full
attention layers (4 KV heads x 256, bf16) in one group of 16-token pages, and 24 gated-delta-net layers in
three state groups of 8 (as pagedkv's `hf.config.kv_layout` groups them, `group_layer_specs` by shape), each
layer a conv state (8192, 3) in bf16 and a recurrent state (32, 128, 128) in fp32. The params are the
engine's own (`StateCacheParams.from_spec` of a `MambaSpec` per state group, one `MultiKVCacheParams` tree,
built by `params.bridge.params_from_kv_cache_config` as `kv_layout` builds them), so every byte figure
comes from `core.memory`: `pool_page_bytes` (an attention page id: 8 layers x 16 tokens x 4,096 B =
524,288 B) and `state_row_bytes` (one request's state of all 24 layers: 24 x 2,146,304 = 51,511,296 B).

`budget_pages(params, budget, max_num_seqs)` is `memory.compute_num_device_blocks`: the state rows
(`max_num_seqs` live rows + `max_state_checkpoints` checkpoints, `memory.num_state_rows`) are paid first,
the rest of the budget buys attention pages. `ceiling_params` is the same model with every layer full
attention (32 layers, 2 MiB pages of 16 tokens).

`StateCheckpointAdapter` drives the coordinator as the engine's scheduler does (`engine.scheduler`): a
prefill chunk ends exactly at `checkpoint_cut` (`clip_chunk`, and the first chunk in `admit`), `step_batch`
after each forward pass, and the pending data moves (`take_state_copies`) are drained after every mutating
call, as a bookkeeping-only owner must (they are counted, not run).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from benchmarks.compare.pagedkv_adapter import handles
from benchmarks.compare.peer_vllm_hybrid import QWEN35, HybridShape
from pagedkv.core.context import TextContext
from pagedkv.core.coordinator import KVCacheCoordinator
from pagedkv.core.errors import InsufficientBlocksError
from pagedkv.core.memory import compute_num_device_blocks, num_state_rows
from pagedkv.dtype import DeviceRef, DType
from pagedkv.interface.config import KVCacheConfig, KVCacheGroupSpec, group_layer_specs
from pagedkv.manager.hybrid import make_block_manager
from pagedkv.params.bridge import params_from_kv_cache_config
from pagedkv.params.kv import KVCacheParams
from pagedkv.params.multi import MultiKVCacheParams
from pagedkv.specs import FullAttentionSpec, KVCacheSpec, MambaSpec
from pagedkv.workloads.traces import TraceRequest

__all__ = ["StallError", "StateCheckpointAdapter", "budget_pages", "ceiling_params", "gdn_spec", "hybrid_params"]


def _dtype(name: str) -> DType:
    return {"bfloat16": DType.bfloat16, "float16": DType.float16, "float32": DType.float32}[name]


def gdn_spec(shape: HybridShape = QWEN35, page_size: int = 16) -> MambaSpec:
    """One GDN layer's state as pagedkv's mixer declares it (`hf.mixers.gdn.state_spec`): conv
    ``(conv_dim, K - 1)`` in the model dtype, recurrent ``(H_v, D_k, D_v)`` in `mamba_ssm_dtype`."""
    conv_dim = 2 * shape.linear_num_key_heads * shape.linear_key_head_dim
    conv_dim += shape.linear_num_value_heads * shape.linear_value_head_dim
    shapes = ((conv_dim, shape.linear_conv_kernel_dim - 1),
              (shape.linear_num_value_heads, shape.linear_key_head_dim, shape.linear_value_head_dim))  # fmt: skip
    return MambaSpec(block_size=page_size, shapes=shapes, dtypes=(_dtype(shape.dtype), _dtype(shape.mamba_ssm_dtype)),
                     mamba_type="gdn_attn")  # fmt: skip


def _attention_spec(shape: HybridShape, page_size: int) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=page_size, num_kv_heads=shape.num_kv_heads, head_size=shape.head_dim,
                             dtype=_dtype(shape.dtype))  # fmt: skip


def hybrid_params(
    shape: HybridShape = QWEN35, page_size: int = 16, max_state_checkpoints: int | None = None, **kwargs: Any
) -> MultiKVCacheParams:
    """The hybrid's params as `kv_layout` builds them (attention groups first, then the state groups; meta
    devices, prefix caching on); `kwargs` are more shared `KVCacheParams` fields."""
    specs: dict[str, KVCacheSpec] = {}
    full = [i for i, (_, is_full) in enumerate(shape.layer_names()) if is_full]
    for i in full:
        specs[str(i)] = _attention_spec(shape, page_size)
    for i in range(shape.num_layers):
        if i not in full:
            specs[f"state{i}"] = gdn_spec(shape, page_size)
    groups = group_layer_specs(specs, by_shape=True)
    view = KVCacheConfig(1, [], [KVCacheGroupSpec(names, spec) for names, spec in groups])
    return params_from_kv_cache_config(view, [DeviceRef.META()], enable_prefix_caching=True,
                                       max_state_checkpoints=max_state_checkpoints, **kwargs)  # fmt: skip


def ceiling_params(shape: HybridShape = QWEN35, page_size: int = 16, **kwargs: Any) -> KVCacheParams:
    """The same model with every layer full attention (meta device, prefix caching on)."""
    return KVCacheParams(
        dtype=_dtype(shape.dtype), n_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim,
        num_layers=shape.num_layers, devices=[DeviceRef.META()], page_size=page_size, enable_prefix_caching=True,
        **kwargs,
    )  # fmt: skip


def budget_pages(params: KVCacheParams | MultiKVCacheParams, budget_bytes: int, max_num_seqs: int) -> int:
    """Attention pages a budget buys once the state rows are paid (`memory.compute_num_device_blocks`;
    raises `InsufficientBlocksError` when the rows or a single page do not fit)."""
    return compute_num_device_blocks(params, budget_bytes, max_batch_size=max_num_seqs)


class StallError(RuntimeError):
    """A request is refused with no other request claimed: nothing will ever free what it needs (the engine's
    scheduler drops such a request with `InsufficientBlocksError`; the compare driver would loop forever)."""


class StateCheckpointAdapter:
    """`CacheAdapter` over the hybrid's `KVCacheCoordinator` (`make_block_manager`, the engine's factory),
    `num_pages` attention pages (checkpoints take runs of them) and ``memory.num_state_rows(params,
    max_num_seqs)`` live state rows."""

    def __init__(self, name: str, params: MultiKVCacheParams, num_pages: int, max_num_seqs: int) -> None:
        self.name = name
        coord = make_block_manager(params, num_pages, max_batch_size=max_num_seqs)
        assert isinstance(coord, KVCacheCoordinator) and coord.states is not None
        self.coord = coord
        self.states = coord.states
        self.num_state_rows = num_state_rows(params, max_num_seqs)
        self.state_copies = 0  # state rows copied (checkpoint saves and restores, rows and runs)
        self.tail_copies = 0  # attention page tails copied (token-granular restores)
        self.cut_chunks = 0  # prefill chunks shortened to end at a checkpoint cut

    def _drain(self) -> None:
        rows, pages = self.coord.take_state_copies()  # bookkeeping only: counted, nothing to copy
        self.state_copies += len(rows)
        self.tail_copies += len(pages)

    def _clip(self, req: TraceRequest, n: int) -> int:
        """`n`, or less so the chunk ends exactly at the request's checkpoint cut."""
        cut = self.coord.checkpoint_cut(req.rid)
        done = req.handle.tokens.processed_length
        if cut is not None and done < cut < done + n:
            self.cut_chunks += 1
            return cut - done
        return n

    def new_step(self) -> None:
        pass

    def lookahead(self, waiting: Sequence[TraceRequest]) -> None:
        """The engine scheduler's queue-aware retention (attention pages and checkpoint runs)."""
        self.coord.expect(handles(waiting))

    def admit(self, req: TraceRequest, budget: int) -> tuple[int, int] | None:
        ctx = req.handle
        if ctx is None:
            ctx = req.handle = TextContext(req.rid, req.live_tokens)
        self.coord.claim(req.rid)
        try:
            self.coord.alloc(ctx, num_scheduled_tokens=budget)
        except InsufficientBlocksError as exc:
            self.coord.release(req.rid)
            self._drain()
            if not self.coord.request_ids():
                pool, tails = self.coord.pool, self.states.tail_refs()
                raise StallError(
                    f"request {req.rid} ({len(ctx.tokens)} tokens) is refused alone ({exc}); {pool.num_used} of "
                    f"{pool.num_blocks} attention pages are held by the tails of {len(self.states)} checkpoints "
                    f"({sum(tails.values())} references), which only row pressure evicts"
                ) from exc
            return None
        tokens = ctx.tokens
        n = self._clip(req, min(tokens.active_length, budget))
        if n < tokens.active_length:
            tokens.chunk(n)
        self._drain()
        return tokens.processed_length, n

    def clip_chunk(self, req: TraceRequest, n: int) -> int:
        return self._clip(req, n)

    def extend(self, req: TraceRequest, n: int) -> bool:
        tokens = req.handle.tokens
        if n > 1 or tokens.active_length > 1:  # a prefill chunk (a decode step needs no window change)
            tokens.unchunk()
            if n < tokens.active_length:
                tokens.chunk(n)
        try:
            self.coord.alloc(req.handle, num_scheduled_tokens=n)
        except InsufficientBlocksError:
            return False
        self._drain()
        return True

    def advance(self, batch: Sequence[tuple[TraceRequest, int]]) -> None:
        ctxs = []
        for req, _ in batch:
            ctx = req.handle
            ctx.update(req.tokens.item(req.num_tokens - 1))  # ignored mid-prompt (chunked)
            ctxs.append(ctx)
        self.coord.step_batch(ctxs)
        self._drain()

    def free(self, req: TraceRequest, preempted: bool) -> None:
        self.coord.release(req.rid)
        self._drain()
        if preempted:
            req.handle = TextContext(req.rid, req.live_tokens)  # restarts as a prompt of every token so far

    def used_pages(self) -> int:
        return self.coord.pool.num_used
