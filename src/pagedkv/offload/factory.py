"""`create_connector`: the tiers `KVCacheParams.kv_connector` asks for, for one replica's buffers."""

from __future__ import annotations

from typing import Any

from pagedkv.connector_config import KVConnectorConfig
from pagedkv.core.events import EventSink
from pagedkv.multi_params import KVCacheParamInterface
from pagedkv.offload.connector import KVConnector
from pagedkv.offload.format import layout_fingerprint
from pagedkv.offload.tier import LowerTier
from pagedkv.offload.transfer import PageMover
from pagedkv.params import KVConnectorType
from pagedkv.runtime.buffers import KVCacheBuffer, MultiKVCacheBuffer

__all__ = ["create_connector", "describe_layout"]


def describe_layout(params: KVCacheParamInterface, mover: PageMover) -> list[Any]:
    """Every field that decides what a page row's bytes mean (the input of the layout fingerprint)."""
    out: list[Any] = []
    for leaf in params.leaves():
        quant = leaf.kvcache_quant_config
        out.append((
            leaf.dtype.name, leaf.page_size, leaf.n_kv_heads, leaf.head_dim, leaf.num_layers,
            leaf.tensor_parallel_degree, leaf.is_mla, leaf.attention_kind,
            None if quant is None else (quant.scale_dtype.name, quant.quantization_granularity),
        ))  # fmt: skip
    out.append(tuple(mover.widths))
    return out


def create_connector(
    params: KVCacheParamInterface,
    buffer: KVCacheBuffer | MultiKVCacheBuffer,
    host_pages: int,
    emit: EventSink | None = None,
) -> KVConnector:
    """The connector of one replica: host rows (when `host_pages`), plus disk (tiered) or Redis (redis)."""
    kind = params.kv_connector
    config = params.kv_connector_config or KVConnectorConfig()
    mover = PageMover(buffer)
    signed = [("hmac-sha256",)] if config.mac_key is not None else []  # signed pages: their own namespace
    fingerprint = layout_fingerprint(describe_layout(params, mover) + signed, config.model_id)
    lower: list[LowerTier] = []
    if kind is KVConnectorType.tiered:
        from pagedkv.offload.disk import DiskTier

        assert config.disk_offload_dir is not None  # checked by KVCacheParams
        lower.append(DiskTier(config.disk_offload_dir, mover.row_bytes, config.disk_max_bytes, fingerprint,
                              params.kv_hash_algo, threads=config.io_threads, emit=emit,
                              mac_key=config.mac_key))  # fmt: skip
    elif kind is KVConnectorType.redis:
        from pagedkv.offload.redis_tier import RedisTier

        lower.append(RedisTier(config, mover.row_bytes, fingerprint, params.kv_hash_algo, emit=emit))
    name = kind.value if kind is not None else "null"
    return KVConnector(name, mover, host_pages=host_pages, lower=lower, page_size=params.page_size, emit=emit)
