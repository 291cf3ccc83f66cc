"""Encoder-decoder models (BART) on pagedkv pages: decoder self-attention and cross-attention groups.

The cache is a `MultiKVCacheParams` of two groups over one pool::

    "self"  (group 0): full attention, one slot per decoder layer; prefix-cached like a decoder-only model
    "cross" (group 1): cross-attention, one slot per decoder layer; ceil(encoder_len / page_size) pages
                       allocated once per request (`CrossAttentionManager`), never prefix-cached

A request's encoder runs once, right after its pages are first allocated
(`encode` + `write_cross_kv`: every decoder layer's ``encoder_attn`` K/V
projections of the encoder output go into the request's cross pages). The
decoder then runs like a decoder-only model on a packed ragged batch, with
three adaptations to transformers' BART code:

- `encoder_attention` (encoder self-attention, ``is_decoder=False``): plain SDPA, no pages (batch 1, no padding);
- `cross_attention` (decoder ``encoder_attn``, ``is_causal=False``): attention over the request's cross pages;
  transformers' own K/V are skipped through `decoder_cache`, whose cross half says every layer is already
  filled (``is_updated``) and whose self half stores nothing;
- `install_position_hook`: BART computes decoder positions as ``arange(T) + cache length``, wrong for a packed
  batch, so a pre-hook on ``decoder.embed_positions`` substitutes each token's position (`decoder_positions`).

`pagedkv.hf.attention` dispatches the first two by module attributes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812

from pagedkv import ops
from pagedkv.dtype import DType
from pagedkv.hf.config import KVLayout, device_ref
from pagedkv.hf.context import ATTENTION_NAME, ForwardContext, GroupContext
from pagedkv.hf.support import AttentionLayer, check_cache_windows
from pagedkv.params.kv import KVCacheParams, KVCacheQuantizationConfig
from pagedkv.params.multi import MultiKVCacheParams
from pagedkv.runtime.inputs import RaggedKVCacheInputs, max_lengths_table

__all__ = [
    "SUPPORTED", "SELF_GROUP", "CROSS_GROUP", "kv_layout", "module_shape", "encoder_attention", "cross_attention", "decoder_cache",
    "install_position_hook", "decoder_positions", "encode", "write_cross_kv", "cross_group",
]  # fmt: skip

SUPPORTED = ("bart",)
SELF_GROUP, CROSS_GROUP = 0, 1  # group order of `kv_layout`'s params ("self", then "cross")

_POSITIONS: ContextVar[torch.Tensor | None] = ContextVar("pagedkv_decoder_positions", default=None)


def _check_supported(config: Any) -> None:
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED:
        raise ValueError(f"model_type={model_type!r} is not a supported encoder-decoder model; supported: {SUPPORTED}")


def kv_layout(
    config: Any,
    *,
    page_size: int = 16,
    dtype: torch.dtype = torch.float32,
    device: torch.device | None = None,
    kv_dtype: DType | None = None,
    quantization: KVCacheQuantizationConfig | None = None,
    model: torch.nn.Module | None = None,
    **params_kwargs: Any,
) -> KVLayout:
    """The two-group layout of a BART config; decoder layer i -> (SELF_GROUP, i), its cross slot is i too.

    With `model` (as `EncoderDecoderEngine.from_hf` passes it), the K/V heads, head size and layer count are
    its decoder attention modules' (`module_shape`), not the config's, and a config ``sliding_window`` /
    ``layer_types`` that gives a decoder layer a window is refused (`pagedkv.hf.support.check_cache_windows`). `params_kwargs` go to both groups (e.g.
    ``enable_prefix_caching=True``). ValueError for another model type.
    """
    _check_supported(config)
    heads = config.decoder_attention_heads
    (kv_heads, head), layers = (heads, config.d_model // heads), config.decoder_layers
    if model is not None:
        (heads, kv_heads, head), layers = module_shape(model), len(_decoder(model).layers)
        # the decoder's self-attention keeps every earlier key: a config window would be kept by transformers'
        # own cache only (its generate() would then differ from the model's forward): refused
        check_cache_windows(config, {i: AttentionLayer(kv_heads, head, heads) for i in range(layers)})
    common: dict[str, Any] = dict(
        dtype=kv_dtype or DType.from_torch(dtype), n_kv_heads=kv_heads, head_dim=head, num_layers=layers,
        devices=[device_ref(device or torch.device("cpu"))], page_size=page_size, num_q_heads=heads,
        kvcache_quant_config=quantization,
    )  # fmt: skip
    common.update(params_kwargs)
    params = MultiKVCacheParams(
        {"self": KVCacheParams(**common), "cross": KVCacheParams(**common, is_cross_attention=True)}
    )
    return KVLayout(params, {i: (SELF_GROUP, i) for i in range(layers)})


def module_shape(model: torch.nn.Module) -> tuple[int, int, int]:
    """(query heads, K/V heads, head size) of every decoder self- and cross-attention module of `model`: K and V
    are its ``k_proj`` / ``v_proj`` outputs in heads of ``head_dim``. ValueError naming both when two modules
    (or a module's K and V) disagree."""
    found: dict[tuple[int, int, int], str] = {}
    for i, layer in enumerate(_decoder(model).layers):
        for kind in ("self_attn", "encoder_attn"):
            attn, where = getattr(layer, kind), f"decoder layer {i} {kind}"
            head = int(attn.head_dim)
            k_heads, v_heads = attn.k_proj.out_features // head, attn.v_proj.out_features // head
            if k_heads != v_heads:
                raise ValueError(f"{where} computes {k_heads} key heads but {v_heads} value heads of {head}")
            found.setdefault((int(attn.num_heads), k_heads, head), where)
    if len(found) != 1:
        shown = ", ".join(f"{where}: {shape}" for shape, where in found.items())
        raise ValueError(f"decoder attention modules disagree on (query heads, K/V heads, head size): {shown}")
    return next(iter(found))


# ----------------------------------------------------------------- attention functions
def encoder_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    ctx: ForwardContext,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Encoder self-attention without pages: bidirectional SDPA over the request's own tokens.

    query/key/value [B, H, S, D] -> ([B, S, H, D], None). The encoder runs one request at a time
    (no padding, so no mask is needed; `encode`).
    """
    out = F.scaled_dot_product_attention(query, key, value, scale=scaling)  # [B, H, S, D]
    return out.transpose(1, 2).contiguous(), None


def cross_group(ctx: ForwardContext) -> GroupContext:
    """The cross-attention group of a forward pass; ValueError when there is none."""
    for group in ctx.groups:
        if group.params.is_cross_attention:
            return group
    raise ValueError("cross-attention needs a ForwardContext with a cross-attention group (is_cross_attention=True)")


def cross_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    ctx: ForwardContext,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Decoder cross-attention over the encoder K/V in the request's cross pages (slot = ``module.layer_idx``).

    query [1, H, T, D] -> ([1, T, H, D], None); `key`/`value` are `decoder_cache`'s placeholders and ignored.
    """
    if query.shape[0] != 1:
        raise ValueError(f"pagedkv packs the batch on the token axis: query batch must be 1, got {query.shape[0]}")
    group = cross_group(ctx)
    q = query[0].transpose(0, 1)  # [T, H, D]
    out = group.step.attend(q, int(module.layer_idx), scale=scaling)  # type: ignore[arg-type]  # [T, H, D]
    return out.unsqueeze(0), None  # [1, T, H, D]


# ----------------------------------------------------------------- the transformers cache stand-in
def decoder_cache(num_layers: int, num_heads: int, head_dim: int, *, dtype: torch.dtype, device: torch.device) -> Any:
    """An `EncoderDecoderCache` that keeps nothing: K/V live in the pages.

    Self-attention: `update` hands the new K/V straight back (the attention function stores them) and the
    length is always 0. Cross-attention: every layer is marked filled (``is_updated``), so BART skips its
    K/V projections of ``encoder_hidden_states`` and passes empty placeholders to `cross_attention`.
    Stateless: one instance serves every forward pass.
    """
    from transformers.cache_utils import Cache, DynamicLayer, EncoderDecoderCache

    class PassThroughCache(Cache):
        def update(
            self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
        ) -> tuple[torch.Tensor, torch.Tensor]:
            return key_states, value_states

        def get_seq_length(self, layer_idx: int = 0) -> int:
            return 0

    placeholder = torch.zeros((1, num_heads, 0, head_dim), dtype=dtype, device=device)  # [1, H, 0, D]
    self_layers: list[Any] = [DynamicLayer() for _ in range(num_layers)]
    cross_layers: list[Any] = []
    for _ in range(num_layers):
        layer = DynamicLayer()
        layer.lazy_initialization(placeholder, placeholder)
        layer.keys, layer.values = placeholder, placeholder
        cross_layers.append(layer)
    cache = EncoderDecoderCache(PassThroughCache(layers=self_layers), PassThroughCache(layers=cross_layers))
    cache.is_updated = dict.fromkeys(range(num_layers), True)
    return cache


# ----------------------------------------------------------------- decoder positions
def _decoder(model: torch.nn.Module) -> Any:
    get = getattr(model, "get_decoder", None)
    decoder = get() if callable(get) else None
    return decoder if decoder is not None else model.model.decoder  # type: ignore[union-attr]


def _encoder(model: torch.nn.Module) -> Any:
    get = getattr(model, "get_encoder", None)
    encoder = get() if callable(get) else None
    return encoder if encoder is not None else model.model.encoder  # type: ignore[union-attr]


def _positions_hook(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    positions = _POSITIONS.get()
    if positions is None:  # outside `decoder_positions`: transformers' own positions
        return None
    input_ids = args[0] if args else kwargs.get("input_ids")
    if input_ids is not None and input_ids.shape[-1] != positions.shape[0]:
        raise ValueError(f"decoder_positions has {positions.shape[0]} positions for {input_ids.shape[-1]} tokens")
    kwargs = {k: v for k, v in kwargs.items() if k not in ("input_ids", "past_key_values_length")}
    kwargs["position_ids"] = positions  # [T]; the embedding unsqueezes it to [1, T] and adds its offset
    return (input_ids,), kwargs


def install_position_hook(model: torch.nn.Module) -> None:
    """Let `decoder_positions` set the decoder's token positions (idempotent)."""
    embed = _decoder(model).embed_positions
    if not getattr(embed, "_pagedkv_positions_hook", False):
        embed.register_forward_pre_hook(_positions_hook, with_kwargs=True)
        embed._pagedkv_positions_hook = True


@contextlib.contextmanager
def decoder_positions(positions: torch.Tensor) -> Iterator[None]:
    """Within the block, the hooked decoder embeds token t at position ``positions[t]`` (int64 [T])."""
    token = _POSITIONS.set(positions)
    try:
        yield
    finally:
        _POSITIONS.reset(token)


# ----------------------------------------------------------------- encoder and cross K/V
def encode(model: torch.nn.Module, encoder_ids: torch.Tensor) -> torch.Tensor:
    """The encoder output [S, d_model] of one request's tokens (int64 [S]); call under inference mode."""
    context = ForwardContext([], torch.zeros(1, dtype=torch.int64, device=encoder_ids.device))  # no pages
    out = _encoder(model)(input_ids=encoder_ids[None], **{ATTENTION_NAME: context})
    return out.last_hidden_state[0]  # [S, d_model]


def write_cross_kv(
    model: torch.nn.Module, hidden: torch.Tensor, inputs: RaggedKVCacheInputs, offsets: torch.Tensor
) -> None:
    """Store every decoder layer's cross-attention K/V of the encoder outputs in the cross pages.

    hidden [S_total, d_model]: the encoder outputs of B requests, packed; offsets int64 [B + 1]: where each
    starts. `inputs`: the cross group's runtime inputs of those B requests (their lookup tables); the
    tokens go to positions 0..S_b - 1 of each request's cross pages.
    """
    num_tokens = hidden.shape[0]
    lengths = offsets[1:] - offsets[:-1]  # [B]
    longest = int(lengths.max()) if lengths.numel() else 0
    target = RaggedKVCacheInputs(
        inputs.blocks, torch.zeros_like(inputs.cache_lengths), inputs.lookup_table,
        max_lengths_table(longest, longest), inputs.kv_scales,
    ).with_policy(inputs.nonfinite_kv)  # fmt: skip
    step = ops.PagedStep.build(target, offsets.to(inputs.cache_lengths.device), num_tokens)  # causal: token i at i
    for i, layer in enumerate(_decoder(model).layers):
        attn = layer.encoder_attn
        key = attn.k_proj(hidden).view(num_tokens, -1, attn.head_dim)  # [S, H, D]
        value = attn.v_proj(hidden).view(num_tokens, -1, attn.head_dim)  # [S, H, D]
        step.store(key, value, i)
