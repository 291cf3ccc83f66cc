"""`LLMEngine`: continuous batching of a transformers causal LM over a `PagedKVCacheManager`.

One step = schedule -> forward -> sample -> update -> commit -> release:

    batch  = scheduler.schedule()                       # windows: decodes + prefill chunks
    inputs = manager.runtime_inputs([ctxs])             # lookup table, cache lengths (copied to the device once)
    ctx    = ForwardContext.build(inputs, ...)          # per group, once: options, checks, metadata, positions;
                                                        # per step: per-request position features (hf.positions)
    logits = model(ids [1, T], position_ids=ctx.positions [1, T], pagedkv=ctx)
    each request whose window reached its last token samples one token; ctx.update(...)
    manager.step([ctxs]); finished requests are released
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pagedkv.core import memory
from pagedkv.core.context import TextContext
from pagedkv.core.errors import InsufficientBlocksError
from pagedkv.core.memory import pool_page_bytes
from pagedkv.dtype import DType
from pagedkv.engine.checks import check_prompts, check_request, check_state_layers
from pagedkv.engine.request import Request
from pagedkv.engine.sampling import SamplingParams, sample_batch
from pagedkv.engine.scheduler import Scheduler
from pagedkv.hf import alibi
from pagedkv.hf.attention import pagedkv_attention, register
from pagedkv.hf.config import kv_layout
from pagedkv.hf.context import ATTENTION_NAME, ForwardContext, StateContext, active
from pagedkv.hf.rope import install as install_positions
from pagedkv.hf.state_layers import install as install_state_layers
from pagedkv.manager.paged import PagedKVCacheManager
from pagedkv.params.kv import KVCacheQuantizationConfig
from pagedkv.params.state import StateCacheParams
from pagedkv.params.validation import INT32_MAX, check_int, check_weights_version
from pagedkv.runtime.inputs import MultiKVCacheInputs
from pagedkv.specs import SchedulerLimits

__all__ = ["LLMEngine", "EngineStats"]

log = logging.getLogger(__name__)

GREEDY = SamplingParams()


@dataclass
class EngineStats:
    """Counters over the engine's life."""

    steps: int = 0
    generated_tokens: int = 0
    wall_seconds: float = 0.0


class LLMEngine:
    """Serve token-id prompts with a transformers causal LM on pagedkv pages.

    Args:
        model: a causal LM whose attention implementation is ``"pagedkv"``.
        manager: the page manager (one replica, one device).
        layer_map: model layer index -> (group, slot) for a hybrid manager (see `pagedkv.hf.kv_layout`).
        state_map: model layer index -> (state group, slot) of each recurrent layer (`pagedkv.hf.kv_layout`);
            its mixers are switched to pagedkv's state slots (`pagedkv.hf.state_layers`).
        max_num_batched_tokens: token budget per step (prefills are chunked to fit).
        max_batch_size: most requests per step (defaults to the manager's).
        record_logits: keep every generated token's logits [V] on its request (tests).
        preemption_mode: "swap" (copy a preempted request's pages to the host tier and back, bit for
            bit; the default when the manager has a host tier) or "recompute" (release them; its
            tokens are computed again as prompt when it is readmitted).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        manager: PagedKVCacheManager,
        *,
        max_num_batched_tokens: int = 256,
        max_batch_size: int | None = None,
        record_logits: bool = False,
        layer_map: dict[int, tuple[int, int]] | None = None,
        preemption_mode: str | None = None,
        state_map: dict[int, tuple[int, int]] | None = None,
    ) -> None:
        check_int("max_num_batched_tokens", max_num_batched_tokens, 1, INT32_MAX)
        if max_batch_size is not None:
            check_int("max_batch_size", max_batch_size, 1, INT32_MAX)
        if not isinstance(record_logits, bool):
            raise TypeError(f"record_logits={record_logits!r} must be a bool")
        mode = preemption_mode or ("swap" if manager.can_swap else "recompute")
        if mode not in ("swap", "recompute"):
            raise ValueError(f"preemption_mode={preemption_mode!r} must be 'swap' or 'recompute'")
        if mode == "swap" and manager.num_state_rows:
            raise ValueError("preemption_mode='swap': a model with recurrent state is not swapped (a preempted "
                             "request resumes from the checkpoint its release saves); use 'recompute'")  # fmt: skip
        if mode == "swap" and not manager.can_swap:
            raise ValueError("preemption_mode='swap' needs a host tier: a local/tiered kv_connector (or host pages)")
        if manager.num_replicas != 1 or len(manager.params.devices) != 1:
            raise ValueError("LLMEngine drives one replica on one device")
        leaves = manager.params.leaves()
        self._state_groups = [g for g, leaf in enumerate(leaves) if isinstance(leaf, StateCacheParams)]
        self._group_params = [leaf for leaf in leaves if not isinstance(leaf, StateCacheParams)]
        if self._state_groups and self._state_groups[0] != len(self._group_params):
            raise ValueError("state groups must come after the attention groups in the params tree")
        check_state_layers(model, leaves, dict(state_map or {}))  # before the model changes
        self.model = model
        install_positions(model)  # length-dependent RoPE per request (`pagedkv.hf.rope`)
        self._alibi_slopes = None  # float32 [H_q]: an ALiBi model's slopes, once (`pagedkv.hf.alibi`)
        if alibi.wrapped_type(getattr(model, "config", None)) is not None:
            slopes = alibi.slopes(model)
            self._alibi_slopes = None if slopes is None else slopes.to(manager.params.devices[0].to_torch())
            alibi.install(model, pagedkv_attention)
        self.manager = manager
        self.layer_map = dict(layer_map or {})
        self.state_map = dict(state_map or {})
        install_state_layers(model)
        self.device = manager.params.devices[0].to_torch()
        batch = max_batch_size or manager.max_batch_size
        self.preemption_mode = mode
        self.scheduler = Scheduler(manager, max_num_batched_tokens, min(batch, manager.max_batch_size), mode == "swap")
        self.record_logits = record_logits
        self.stats = EngineStats()
        self._next_id = 0
        # the attention implementation the engine serves with: `step` refuses to run under another one
        self._attention = getattr(getattr(model, "config", None), "_attn_implementation", None)

    @classmethod
    def from_hf(
        cls,
        model: torch.nn.Module,
        *,
        page_size: int = 16,
        num_pages: int | None = None,
        memory_budget: int | None = None,
        enable_prefix_caching: bool = True,
        max_batch_size: int = 32,
        max_num_batched_tokens: int = 256,
        kv_dtype: DType | None = None,
        quantization: KVCacheQuantizationConfig | None = None,
        record_logits: bool = False,
        total_num_host_pages: int = 0,
        preemption_mode: str | None = None,
        **params_kwargs: Any,
    ) -> LLMEngine:
        """An engine for a transformers causal LM, switched to pagedkv attention.

        Any decoder whose attention goes through transformers' `AttentionInterface` (full, sliding,
        chunked, sinks, softcap; DeepSeek V2/V3 MLA); others raise ValueError before the model changes
        (`pagedkv.hf.support`; docs/MODELS.md lists the tested ones). The page layout (each layer's K/V
        heads, head size, window or chunk) is what the attention modules compute, observed in one 2-token
        forward that leaves the model as it was (`pagedkv.hf.support.check_model`), never config attributes
        the model does not use; modules that contradict each other (a ``sliding_window`` passed to attention
        that the layer's mask does not keep), and a config whose ``sliding_window`` / ``layer_types`` give a
        layer another window than its attention keeps (transformers' own cache would keep the config's),
        raise ValueError naming both values. Mixed
        attention types get one page table per group over one pool. Recurrent mixers (`pagedkv.hf.mixers`:
        Mamba, Mamba2, gated delta net, short conv) keep their state in state slots of that pool; the
        attention page then grows from `page_size` until a page holds a layer's state (vLLM's rule; the
        engine's ``summary["page_size"]`` says what it became). Give either `num_pages` or
        `memory_budget` (bytes for the KV pages). The model is modified in place: its attention
        implementation becomes ``"pagedkv"`` (only once every argument was accepted: a failing call
        leaves the model as it was); Bloom, MPT and Falcon keep theirs and get their attention modules
        wrapped instead (`pagedkv.hf.alibi`: ALiBi slopes once per model; the original forward outside a step). Every size is checked under its own name (`page_size`,
        `num_pages`, `memory_budget`, `max_batch_size`, `max_num_batched_tokens`, ...). Switching the
        model to another implementation afterwards (e.g. to call its own ``generate``) makes `step`
        raise until it is switched back with ``model.set_attn_implementation("pagedkv")``. `params_kwargs` go to `KVCacheParams` (e.g.
        ``kv_connector="tiered"``, ``kv_connector_config=KVConnectorConfig(...)``,
        ``host_kvcache_swap_space_gb=4``); `total_num_host_pages` sizes the host tier (0: from the swap space).
        """
        if (num_pages is None) == (memory_budget is None):
            raise ValueError(f"give exactly one of num_pages or memory_budget (got num_pages={num_pages!r}, "
                             f"memory_budget={memory_budget!r})")  # fmt: skip
        check_int("page_size", page_size, 1, INT32_MAX)
        if num_pages is not None:
            check_int("num_pages", num_pages, 1, INT32_MAX - 1)
        if memory_budget is not None:
            check_int("memory_budget", memory_budget, 1)
        check_int("max_batch_size", max_batch_size, 1, INT32_MAX)
        check_int("max_num_batched_tokens", max_num_batched_tokens, 1, INT32_MAX)
        check_int("total_num_host_pages", total_num_host_pages, 0, INT32_MAX - 1)
        for name, flag in (("enable_prefix_caching", enable_prefix_caching), ("record_logits", record_logits)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name}={flag!r} must be a bool")
        if preemption_mode not in (None, "swap", "recompute"):
            raise ValueError(f"preemption_mode={preemption_mode!r} must be 'swap' or 'recompute'")
        param = next(model.parameters())
        layout = kv_layout(  # checks the model (ValueError) before anything in it changes
            model.config, model=model, page_size=page_size, dtype=param.dtype, device=param.device,
            enable_prefix_caching=enable_prefix_caching, kv_dtype=kv_dtype, quantization=quantization, **params_kwargs,
        )  # fmt: skip
        params = layout.params
        if num_pages is not None:
            manager = PagedKVCacheManager(params, None, num_pages, total_num_host_pages, max_batch_size=max_batch_size)
        else:
            assert memory_budget is not None
            page_bytes = pool_page_bytes(params)  # (a hybrid model's groups share one arena row per page)
            if memory_budget < page_bytes * params.data_parallel_degree:
                raise InsufficientBlocksError(
                    f"memory_budget={memory_budget} bytes holds no page: one page of {params.page_size} tokens "
                    f"takes {page_bytes} bytes (x{params.data_parallel_degree} replicas)",
                    needed=1,
                    available=0,
                )
            manager = PagedKVCacheManager.from_memory_budget(params, memory_budget, max_batch_size=max_batch_size)
        previous = getattr(model.config, "_attn_implementation", None)
        register()
        switch = alibi.wrapped_type(model.config) is None and bool(layout.layer_map)  # (a pure state model: none)
        if switch:  # Bloom, MPT, Falcon keep theirs; their attention is wrapped
            model.set_attn_implementation(ATTENTION_NAME)  # type: ignore[operator]
        try:
            return cls(
                model, manager, max_num_batched_tokens=max_num_batched_tokens, record_logits=record_logits,
                layer_map=layout.layer_map, preemption_mode=preemption_mode, state_map=layout.state_map,
            )  # fmt: skip
        except BaseException:
            if previous is not None and switch:
                model.set_attn_implementation(previous)  # type: ignore[operator]
            manager.close()
            raise

    # ----------------------------------------------------------------- requests
    def add_request(
        self,
        prompt: Sequence[int],
        max_new_tokens: int,
        sampling: SamplingParams = GREEDY,
        stop_token_ids: Sequence[int] | None = None,
        *,
        cache_salt: str | None = None,
    ) -> Request:
        """Queue a prompt; returns its `Request` (filled in as the engine steps).

        `cache_salt` (per tenant): requests with different salts never share a page, on device or in a tier.
        Raises (`pagedkv.engine.checks`) before anything is queued.
        """
        tokens = check_request(self.model, self.manager, prompt, max_new_tokens, sampling, stop_token_ids, cache_salt)
        return self._enqueue(tokens, max_new_tokens, sampling, stop_token_ids, cache_salt)

    def _enqueue(
        self, tokens: np.ndarray, max_new_tokens: int, sampling: SamplingParams,
        stop_token_ids: Sequence[int] | None, cache_salt: str | None,
    ) -> Request:  # fmt: skip
        """Queue a request whose arguments `check_request` accepted."""
        rid = self._next_id
        self._next_id += 1
        generator = None
        if not sampling.greedy and sampling.seed is not None:
            generator = torch.Generator().manual_seed(sampling.seed)  # per request, as vLLM: index-free
        stops = self._default_stops() if stop_token_ids is None else stop_token_ids
        ctx = TextContext(rid, tokens, cache_salt=cache_salt)
        request = Request(ctx, len(tokens), max_new_tokens, sampling, frozenset(stops), generator)
        self.scheduler.add(request)
        return request

    def _default_stops(self) -> list[int]:
        config = getattr(self.model, "generation_config", None)
        eos = getattr(config, "eos_token_id", None)
        return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)

    def has_unfinished(self) -> bool:
        """True while requests wait or run."""
        return self.scheduler.has_unfinished()

    def abort_request(self, request_id: int | Iterable[int]) -> list[Request]:
        """End requests now (vLLM's ``abort_request``): one id (`Request.request_id`) or an iterable of ids.

        Each request found waiting, running or swapped out leaves the engine and gives back everything it
        holds (device pages, host rows, what the queue kept for it); its `finish_reason` becomes
        ``"abort"`` and its `output` keeps what it generated. Ids of requests that already finished, or
        that this engine never issued, are ignored (as vLLM does: a client may abort a request that
        just ended). Returns the requests aborted, in the order given. Every id is checked first:
        TypeError unless an int (bool excluded), and then nothing changes. Call it between steps
        (the engine is single-threaded).
        """
        ids = [request_id] if not isinstance(request_id, Iterable) else list(request_id)
        for rid in ids:
            if type(rid) is not int:
                raise TypeError(f"request_id={rid!r} must be an int (a Request.request_id) or an iterable of them")
        sched = self.scheduler
        live = {r.request_id: r for r in (*sched.running, *sched.waiting)}
        return self._abort([r for r in (live.pop(rid, None) for rid in ids) if r is not None])

    def _abort(self, requests: Iterable[Request]) -> list[Request]:
        """Drop each request still in the engine (`Scheduler.drop`) and mark it aborted; returns those."""
        aborted = []
        for request in requests:
            if self.scheduler.drop(request):
                request.ended = "abort"
                aborted.append(request)
        return aborted

    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int = 16,
        *,
        sampling: SamplingParams = GREEDY,
        stop_token_ids: Sequence[int] | None = None,
        progress: Callable[[int, int], None] | None = None,
        cache_salt: str | None = None,
    ) -> list[list[int]]:
        """Generate for every prompt (greedy unless `sampling` says otherwise); outputs in prompt order.

        Outputs stop after `max_new_tokens` or at a stop token (the model's
        EOS by default), which is included, as in transformers' `generate`. Every prompt is checked
        before any is queued (`pagedkv.engine.checks`). A prompt whose sampling fails (see `step`) ends
        early: its list holds the tokens generated before the failure (a warning is logged; `add_request`
        gives the `Request`, whose `error` says why), and the other prompts are served in full. When
        `step` raises, the requests of this call are aborted (`abort_request`) before the error
        propagates, so the engine holds none of them afterwards.
        """
        check_prompts(prompts)
        checked = [check_request(self.model, self.manager, p, max_new_tokens, sampling, stop_token_ids, cache_salt)
                   for p in prompts]  # fmt: skip
        requests = [self._enqueue(t, max_new_tokens, sampling, stop_token_ids, cache_salt) for t in checked]
        try:
            self.run(progress=progress)
        except BaseException:
            self._abort(requests)
            raise
        return [r.output for r in requests]

    def run(self, progress: Callable[[int, int], None] | None = None) -> None:
        """Step until every queued request has finished."""
        start, done, total = time.perf_counter(), 0, len(self.scheduler.waiting) + len(self.scheduler.running)
        while self.has_unfinished():
            done += len(self.step())
            if progress:
                progress(done, total)
        self.stats.wall_seconds += time.perf_counter() - start

    def update_weights(self, weights: Mapping[str, torch.Tensor] | None, version: str) -> int:
        """Load new model weights and serve every later token from them, with no page of the old ones.

        Args:
            weights: a state dict with exactly the model's keys and shapes (None: the caller already
                updated the model in place, e.g. by a collective broadcast).
            version: the new weights version; folded into every hash chain's root from now on
                (`PagedKVCacheManager.set_weights_version`), so no page computed with other weights
                is a hit, on device or in any tier. No `reset_prefix_cache` is needed.

        Running and swapped-out requests are released and recomputed from their tokens (their
        KV was computed with the old weights). Returns how many. Validates everything first:
        a mismatched state dict raises ValueError and changes nothing.
        """
        check_weights_version(version, "version")
        if weights is not None:
            own = self.model.state_dict()
            missing, extra = sorted(set(own) - set(weights)), sorted(set(weights) - set(own))
            shapes = [k for k in own if k in weights and tuple(weights[k].shape) != tuple(own[k].shape)]
            if missing or extra or shapes:
                raise ValueError(f"weights do not match the model: missing {missing[:3]}, unexpected {extra[:3]}, "
                                 f"wrong shape {shapes[:3]} (of {len(own)} tensors)")  # fmt: skip
            with torch.no_grad():
                self.model.load_state_dict(weights, strict=True)
        self.manager.set_weights_version(version)
        return self.scheduler.recompute_all()

    # ----------------------------------------------------------------- one step
    def step(self) -> list[Request]:
        """Run one forward pass; returns the requests that finished in it.

        With nothing queued it does nothing and returns ``[]`` (as vLLM's ``step`` returns no
        outputs). Raises RuntimeError, before anything changes, when the model no longer uses the
        attention implementation the engine installed (``model.set_attn_implementation("eager")``
        to call its own ``generate``): its tokens would be wrong. A request that cannot take a
        single token with the whole pool to itself leaves the engine with `InsufficientBlocksError`
        (see `Scheduler`; `add_request` refuses such requests up front). When the forward or sampling
        raises on a model with recurrent state, the step's layers may already have updated some state
        slots in place: every running request is released and computed again from its tokens at the
        next step (attention pages are rewritten identically, so attention-only models just retry).

        A request whose own sampling raises (non-finite probabilities from NaN or inf logits, a failing
        generator: `sample_batch`) fails alone: it leaves the engine with its pages released,
        ``finish_reason == "error"`` and the exception in `Request.error` (a warning is logged), and it
        is returned with the finished ones; the other requests of the step get their tokens as usual.
        """
        if not self.scheduler.has_unfinished():
            return []
        self._check_attention()
        batch = self.scheduler.schedule()
        if not batch:  # the scheduler progresses or raises; an empty batch is a bug, never a silent spin
            raise RuntimeError(
                f"nothing could be scheduled although {len(self.scheduler.waiting)} requests wait and "
                f"{len(self.scheduler.running)} run (pool: {self.manager.num_free_blocks()} of "
                f"{self.manager.total_num_pages} pages free)"
            )
        errors: dict[int, Exception] = {}  # batch index -> why that request's sampling failed
        try:
            logits = self._forward(batch)  # [B, V]: logits of each request's last window token
            tokens = sample_batch(  # (mid-prompt chunks: no token yet)
                logits, [r.sampling for r in batch], [r.generator for r in batch],
                [not r.ctx.tokens.is_chunked for r in batch], errors,
            )  # fmt: skip
        except BaseException:
            if self._state_groups:  # layers may have moved their states on: recompute every request's state
                self.scheduler.recompute_all()
            raise
        finished = []
        for i, (request, token) in enumerate(zip(batch, tokens, strict=True)):
            ctx = request.ctx
            if token is None:
                if errors and i in errors:  # failed alone: left out of this step's commit, released below
                    continue
                ctx.update(0)  # mid-prompt chunk: no token yet
                continue
            if request.first_token_time is None:
                request.first_token_time = time.perf_counter()
            if self.record_logits:
                request.logits.append(logits[i].float().cpu())
            ctx.update(token)
            self.stats.generated_tokens += 1
            if request.finished:
                finished.append(request)
        if errors:
            self.manager.step([[r.ctx for i, r in enumerate(batch) if i not in errors]])
        else:
            self.manager.step([[r.ctx for r in batch]])
        for request in finished:
            self.scheduler.finish(request)
        for i, error in errors.items():
            finished.append(self._fail(batch[i], error))
        self.stats.steps += 1
        return finished

    def _fail(self, request: Request, error: Exception) -> Request:
        """End `request` alone with `error` (its pages released); the engine goes on with the others."""
        self.scheduler.drop(request)
        request.ended, request.error = "error", error
        log.warning("request %r failed and was ended alone: %s: %s", request.request_id, type(error).__name__, error)
        return request

    def _check_attention(self) -> None:
        """RuntimeError when the model's attention implementation is no longer the engine's."""
        if self._attention is None:
            return
        current = getattr(self.model.config, "_attn_implementation", None)
        if current != self._attention:
            raise RuntimeError(
                f"the model's attention implementation is {current!r}, not {self._attention!r}: it was switched "
                f"after the engine was built (e.g. to call model.generate), and the engine's pages would be "
                f"ignored, giving wrong tokens; call model.set_attn_implementation({self._attention!r}) before "
                "stepping the engine again"
            )

    def _forward(self, batch: list[Request]) -> torch.Tensor:
        ctxs = [r.ctx for r in batch]
        tree = self.manager.runtime_inputs([ctxs])
        groups = list(tree.children.values()) if isinstance(tree, MultiKVCacheInputs) else [tree]
        records = [g.inputs[0] for g in groups]  # one device
        inputs = records[: len(self._group_params)]  # attention groups first, state groups after
        ids = np.concatenate([c.tokens.active for c in ctxs]).astype(np.int64)  # [T]
        offsets = np.zeros(len(ctxs) + 1, dtype=np.int64)  # [B + 1]
        np.cumsum([c.tokens.active_length for c in ctxs], out=offsets[1:])
        lengths = torch.tensor([len(c.tokens) for c in ctxs], dtype=torch.int64)  # [B]: prompt + generated
        states = None
        if self._state_groups:  # per state group once: its slots; per layer: its state tensors
            state_records = {g: records[g] for g in self._state_groups}
            states = StateContext.build(state_records, torch.from_numpy(offsets), self.state_map)  # type: ignore[arg-type]
        context = ForwardContext.build(
            inputs, self._group_params, torch.from_numpy(offsets), len(ids), self.layer_map,
            sequence_lengths=lengths, model_config=getattr(self.model, "config", None),
            alibi_slopes=self._alibi_slopes, states=states,
        )  # fmt: skip
        with torch.inference_mode(), active(context):  # for layers that drop the pagedkv keyword
            out = self.model(
                input_ids=torch.from_numpy(ids).to(self.device)[None],
                position_ids=context.positions[None],  # [1, T], computed once with the metadata
                logits_to_keep=torch.from_numpy(offsets[1:] - 1).to(self.device),
                **self._model_kwargs(context), **{ATTENTION_NAME: context},
            )  # fmt: skip
        return out.logits[0]  # [B, V]

    def _model_kwargs(self, context: ForwardContext) -> dict[str, Any]:
        """Extra forward keywords: no transformers cache, except MLA's latent cache (`pagedkv.hf.mla`)."""
        if getattr(self.model.config, "model_type", None) in ("deepseek_v2", "deepseek_v3"):
            from pagedkv.hf import mla

            return mla.model_kwargs(context)
        return {"use_cache": False}

    @property
    def summary(self) -> dict[str, Any]:
        """Engine and cache counters as a flat dict."""
        metrics, sched = self.manager.get_metrics_aggregated(), self.scheduler
        return {
            "steps": self.stats.steps, "generated_tokens": self.stats.generated_tokens,
            "prompt_tokens": sched.admitted_tokens, "prompt_tokens_cached": sched.cached_tokens,
            "prefill_tokens_computed": sched.admitted_tokens - sched.cached_tokens,
            "preemptions": sched.preemptions, "swaps": sched.swaps, "cache_hit_rate": metrics.cache_hit_rate,
            "used_pages": metrics.used_pages, "total_pages": metrics.total_pages,
            "checkpoint_pages": metrics.checkpoint_pages, "page_size": self.manager.page_size,
            **self._state_summary(),
        }  # fmt: skip

    def _state_summary(self) -> dict[str, int]:
        """Recurrent state: bytes per request (the specs' arithmetic, `MambaSpec.max_memory_usage_bytes` per
        layer, summed), state rows a request holds (its live and draft slots), the bytes of one row (a live
        state or a checkpoint, padded), the rows there are and the checkpoints kept now."""
        params = self.manager.params
        leaves = [leaf for leaf in params.leaves() if isinstance(leaf, StateCacheParams)]
        limits = SchedulerLimits(max_model_len=1)
        return {
            "state_layers": sum(leaf.num_layers for leaf in leaves),
            "state_bytes_per_request": sum(
                leaf.num_layers * leaf.spec.max_memory_usage_bytes(limits) for leaf in leaves
            ),
            "state_rows_per_request": memory.state_slots_per_request(params),
            "state_row_bytes": memory.state_row_bytes(params),
            "state_rows": self.manager.num_state_rows,
            "state_checkpoints": self.manager.num_state_checkpoints(),
        }
