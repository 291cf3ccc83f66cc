"""`EncoderDecoderEngine`: continuous batching of a transformers encoder-decoder model (BART) on pagedkv pages.

A request is an encoder prompt plus a decoder prompt (by default just the
decoder start token). Its context pages the decoder tokens in the "self"
group and holds ceil(encoder_len / page_size) pages in the "cross" group
(`pagedkv.hf.encoder_decoder`). One step is `LLMEngine.step`, except that
before the forward pass every request admitted in this step (for the first
time, or again after a preemption released its pages) runs its encoder and
writes its cross K/V into its fresh cross pages.

Decoder pages are prefix-cached as usual, salted with a digest of the
encoder tokens: equal decoder prefixes share pages only under equal encoder
inputs, since their K/V depend on the encoder through cross-attention.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from pagedkv.core.context import TextContext
from pagedkv.core.hashing import check_salt
from pagedkv.dtype import DType
from pagedkv.engine.engine import GREEDY, LLMEngine
from pagedkv.engine.request import Request
from pagedkv.engine.sampling import SamplingParams
from pagedkv.hf import encoder_decoder as ed
from pagedkv.hf.attention import register
from pagedkv.hf.context import ATTENTION_NAME, ForwardContext
from pagedkv.manager.paged import PagedKVCacheManager
from pagedkv.params.kv import KVCacheQuantizationConfig
from pagedkv.params.validation import INT32_MAX, as_token_array, check_int
from pagedkv.runtime.inputs import MultiKVCacheInputs, RaggedKVCacheInputs, max_lengths_table

__all__ = ["EncoderDecoderEngine", "EncoderDecoderRequest", "encoder_salt"]


@dataclass(eq=False)
class EncoderDecoderRequest(Request):
    """A `Request` with its encoder tokens; `output` is what the decoder generated after its prompt."""

    encoder_prompt: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    cross_written: int | None = None  # `preemptions` at the admission whose cross K/V are in the pages


def encoder_salt(encoder_prompt: Sequence[int] | np.ndarray, cache_salt: str | None = None) -> str:
    """The decoder's prefix-cache salt: the tenant salt (None: none; "" is refused by `check_salt` before) and
    a SHA-256 of the encoder tokens."""
    digest = hashlib.sha256(np.asarray(encoder_prompt, dtype=np.int64).tobytes()).hexdigest()
    return f"{'' if cache_salt is None else cache_salt}|encoder:{digest}"


class EncoderDecoderEngine(LLMEngine):
    """Serve (encoder prompt, decoder prompt) pairs with a transformers encoder-decoder model.

    Args: as `LLMEngine`; `manager` must have a cross-attention group (`pagedkv.hf.encoder_decoder.kv_layout`).
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
    ) -> None:
        super().__init__(
            model, manager, max_num_batched_tokens=max_num_batched_tokens, max_batch_size=max_batch_size,
            record_logits=record_logits, layer_map=layer_map,
        )  # fmt: skip
        cross = [g for g, p in enumerate(self._group_params) if p.is_cross_attention]
        if len(cross) != 1:
            raise ValueError(f"an encoder-decoder manager needs exactly one cross-attention group, got {len(cross)}")
        self.cross_group = cross[0]
        config: Any = model.config
        ed.install_position_hook(model)
        param = next(model.parameters())
        pages = self._group_params[self.cross_group]  # the layout the decoder's modules compute (`ed.kv_layout`)
        self._cache = ed.decoder_cache(
            pages.num_layers, pages.n_kv_heads, pages.head_dim, dtype=param.dtype, device=self.device
        )
        self._encoder_placeholder = torch.zeros((1, 1, config.d_model), dtype=param.dtype, device=self.device)
        start = getattr(getattr(model, "generation_config", None), "decoder_start_token_id", None)
        self.decoder_start_token_id = int(start if start is not None else config.decoder_start_token_id)
        self.encoder_runs = 0  # encoder forward passes (one per admission)
        self.encoder_tokens = 0  # tokens they encoded

    @classmethod
    def from_hf(  # type: ignore[override]
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
    ) -> EncoderDecoderEngine:
        """An engine for a transformers encoder-decoder model (BART), switched to pagedkv attention.

        Give either `num_pages` or `memory_budget` (bytes for the KV pages, both groups). The model is
        modified in place: its attention implementation becomes ``"pagedkv"`` and its decoder's position
        embedding gets a pre-hook (`pagedkv.hf.encoder_decoder.install_position_hook`).
        """
        if (num_pages is None) == (memory_budget is None):
            raise ValueError("give exactly one of num_pages or memory_budget")
        param = next(model.parameters())
        layout = ed.kv_layout(  # the K/V shape of the modules, not the config's
            model.config, page_size=page_size, dtype=param.dtype, device=param.device, model=model,
            enable_prefix_caching=enable_prefix_caching, kv_dtype=kv_dtype, quantization=quantization,
        )  # fmt: skip
        model.set_attn_implementation(register())  # type: ignore[operator]
        if num_pages is not None:
            manager = PagedKVCacheManager(layout.params, None, num_pages, max_batch_size=max_batch_size)
        else:
            assert memory_budget is not None
            manager = PagedKVCacheManager.from_memory_budget(
                layout.params, memory_budget, max_batch_size=max_batch_size
            )
        return cls(
            model, manager, max_num_batched_tokens=max_num_batched_tokens, record_logits=record_logits,
            layer_map=layout.layer_map,
        )  # fmt: skip

    # ----------------------------------------------------------------- requests
    def add_request(  # type: ignore[override]
        self,
        prompt: Sequence[int],
        max_new_tokens: int,
        sampling: SamplingParams = GREEDY,
        stop_token_ids: Sequence[int] | None = None,
        *,
        decoder_prompt: Sequence[int] | None = None,
        cache_salt: str | None = None,
    ) -> EncoderDecoderRequest:
        """Queue an encoder prompt; returns its request (filled in as the engine steps).

        The decoder starts from `decoder_prompt`, with the decoder start token put in front unless it
        already begins with it (as transformers' `generate(decoder_input_ids=...)` does), or from the start
        token alone. `output` is what follows the decoder prompt.
        """
        check_int("max_new_tokens", max_new_tokens, 1, INT32_MAX)
        encoder = as_token_array(prompt, name="prompt").astype(np.int64)  # (the token checks of every entry)
        check_salt(cache_salt)
        start = self.decoder_start_token_id
        decoder = (
            [start]
            if decoder_prompt is None
            else as_token_array(decoder_prompt, allow_empty=True, name="decoder_prompt").tolist()
        )
        if not decoder or decoder[0] != start:
            decoder.insert(0, start)
        rid = self._next_id
        self._next_id += 1
        generator = None
        if not sampling.greedy and sampling.seed is not None:
            generator = torch.Generator().manual_seed(sampling.seed)  # per request, as vLLM
        stops = self._default_stops() if stop_token_ids is None else stop_token_ids
        ctx = TextContext(
            rid, np.asarray(decoder, dtype=np.int64), cache_salt=encoder_salt(encoder, cache_salt),
            encoder_length=len(encoder),
        )  # fmt: skip
        request = EncoderDecoderRequest(
            ctx, len(decoder), max_new_tokens, sampling, frozenset(stops), generator, encoder_prompt=encoder
        )
        self.scheduler.add(request)
        return request

    # ----------------------------------------------------------------- one step
    def _forward(self, batch: list[Request]) -> torch.Tensor:
        self._write_new_cross_kv(batch)
        ctxs = [r.ctx for r in batch]
        tree = self.manager.runtime_inputs([ctxs])
        assert isinstance(tree, MultiKVCacheInputs)
        inputs = [g.inputs[0] for g in tree.children.values()]  # one device
        ids = np.concatenate([c.tokens.active for c in ctxs]).astype(np.int64)  # [T]
        offsets = np.zeros(len(ctxs) + 1, dtype=np.int64)  # [B + 1]
        np.cumsum([c.tokens.active_length for c in ctxs], out=offsets[1:])
        inputs[self.cross_group] = _cross_query_lengths(inputs[self.cross_group], ctxs)
        context = ForwardContext.build(inputs, self._group_params, torch.from_numpy(offsets), len(ids), self.layer_map)
        last = torch.from_numpy(offsets[1:] - 1).to(self.device)  # [B]
        with torch.inference_mode(), ed.decoder_positions(context.positions):
            out = self.model(
                decoder_input_ids=torch.from_numpy(ids).to(self.device)[None], encoder_outputs=(self._encoder_placeholder,),
                past_key_values=self._cache, use_cache=True, **{ATTENTION_NAME: context},
            )  # fmt: skip
        return out.logits[0, last]  # [B, V]

    def _write_new_cross_kv(self, batch: list[Request]) -> None:
        """Run the encoder of every request whose cross pages are new (this admission) and fill them."""
        fresh = [r for r in batch if isinstance(r, EncoderDecoderRequest) and r.cross_written != r.preemptions]
        if not fresh:
            return
        with torch.inference_mode():
            hidden = [ed.encode(self.model, torch.from_numpy(r.encoder_prompt).to(self.device)) for r in fresh]
            tree = self.manager.runtime_inputs([[r.ctx for r in fresh]])
            assert isinstance(tree, MultiKVCacheInputs)
            cross = list(tree.children.values())[self.cross_group].inputs[0]
            offsets = np.zeros(len(fresh) + 1, dtype=np.int64)
            np.cumsum([len(r.encoder_prompt) for r in fresh], out=offsets[1:])
            ed.write_cross_kv(self.model, torch.cat(hidden), cross, torch.from_numpy(offsets))
        self.encoder_runs += len(fresh)
        self.encoder_tokens += int(offsets[-1])
        for r in fresh:
            r.cross_written = r.preemptions

    def cross_pages(self, request: Request) -> list[int]:
        """The request's cross-attention page ids (empty while it holds no pages)."""
        if not self.manager.contains(request.request_id):
            return []
        return self.manager.get_req_blocks(request.request_id, group=self.cross_group)

    @property
    def summary(self) -> dict[str, Any]:
        """`LLMEngine.summary` plus the encoder's runs and tokens (re-encoded after preemptions included)."""
        return {**super().summary, "encoder_runs": self.encoder_runs, "encoder_tokens": self.encoder_tokens}


def _cross_query_lengths(inputs: RaggedKVCacheInputs, ctxs: list[TextContext]) -> RaggedKVCacheInputs:
    """The cross group's inputs with host max lengths (longest decoder window, longest encoder).

    The manager's cross tables record no query window (their max prompt length is 0); the metadata's
    host ints size the padded attention on devices where they are not recomputed (CUDA).
    """
    longest_q = max(c.tokens.active_length for c in ctxs)
    longest_kv = max(c.encoder_length for c in ctxs)
    return RaggedKVCacheInputs(
        inputs.blocks, inputs.cache_lengths, inputs.lookup_table, max_lengths_table(longest_q, longest_kv),
        inputs.kv_scales,
    ).with_policy(inputs.nonfinite_kv)  # fmt: skip
