"""`create_connector`: the tiers `KVCacheParams.kv_connector` asks for, for one replica's buffers."""

from __future__ import annotations

from typing import Any

from pagedkv.core.events import EventSink
from pagedkv.offload.connector import KVConnector
from pagedkv.offload.format import layout_fingerprint
from pagedkv.offload.state_images import StateImageMover
from pagedkv.offload.tier import LowerTier
from pagedkv.offload.transfer import PageMover, RowMover
from pagedkv.params.connector import KVConnectorConfig
from pagedkv.params.kv import KVConnectorType
from pagedkv.params.multi import KVCacheParamInterface
from pagedkv.runtime.arena import HybridKVCacheBuffer
from pagedkv.runtime.buffers import KVCacheBuffer, MultiKVCacheBuffer

__all__ = ["STATE_TIER_SHARE", "create_connector", "create_state_connector", "describe_layout"]

STATE_TIER_SHARE = 3  # a model with recurrent state gives 1/3 of its host rows and disk cap to state checkpoints


def describe_layout(params: KVCacheParamInterface, mover: RowMover) -> list[Any]:
    """Every field that decides what a page row's bytes mean (the input of the layout fingerprint)."""
    out: list[Any] = []
    for leaf in params.leaves():
        quant = leaf.kvcache_quant_config
        out.append((
            leaf.dtype.name, leaf.page_size, leaf.n_kv_heads, leaf.head_dim, leaf.num_layers,
            leaf.tensor_parallel_degree, leaf.is_mla, leaf.attention_kind,
            None if quant is None else (quant.scale_dtype.name, quant.quantization_granularity),
        ))  # fmt: skip
        spec = getattr(leaf, "state_spec", None)
        if spec is not None:  # a state cache's row: its tensors' shapes and dtypes, not attention fields
            out.append(("state", spec.shapes, tuple(d.name for d in spec.dtypes), spec.tp_replicated))
    out.append(tuple(mover.widths))
    return out


def create_connector(
    params: KVCacheParamInterface,
    buffer: KVCacheBuffer | MultiKVCacheBuffer,
    host_pages: int,
    emit: EventSink | None = None,
    *,
    mover: RowMover | None = None,
    disk_bytes: int | None = None,
    hash_algo: str | None = None,
    kind_tag: str = "",
) -> KVConnector:
    """The connector of one replica: host rows (when `host_pages`), plus disk (tiered) or Redis (redis).

    `mover` (default: a `PageMover` of `buffer`) decides what a row holds; `disk_bytes` caps the disk tier
    (default: the config's cap); `hash_algo` is the algorithm of the keys (default: the params'); `kind_tag`
    names what the rows hold in the stats ("" for pages) and in the layout fingerprint."""
    kind = params.kv_connector
    config = params.kv_connector_config or KVConnectorConfig()
    mover = mover if mover is not None else PageMover(buffer)
    algo = hash_algo or params.kv_hash_algo
    tagged = [("rows", kind_tag)] if kind_tag else []  # (the tiers name pages by fingerprint and signing key)
    fingerprint = layout_fingerprint(describe_layout(params, mover) + tagged, config.model_id)
    lower: list[LowerTier] = []
    if kind is KVConnectorType.tiered:
        from pagedkv.offload.disk import DiskTier

        assert config.disk_offload_dir is not None  # checked by KVCacheParams
        cap = config.disk_max_bytes if disk_bytes is None else disk_bytes
        lower.append(DiskTier(config.disk_offload_dir, mover.row_bytes, cap, fingerprint, algo,
                              threads=config.io_threads, emit=emit, mac_key=config.mac_key,
                              timeout_s=config.disk_timeout_s))  # fmt: skip
    elif kind is KVConnectorType.redis:
        from pagedkv.offload.redis_tier import RedisTier

        lower.append(RedisTier(config, mover.row_bytes, fingerprint, algo, emit=emit))
    name = kind.value if kind is not None else "null"
    connector = KVConnector(name, mover, host_pages=host_pages, lower=lower, page_size=params.page_size, emit=emit)
    for tier in connector.tiers:
        tier.stats.name = f"{tier.stats.name}{kind_tag}"
    return connector


def create_state_connector(
    params: KVCacheParamInterface, buffer: HybridKVCacheBuffer, pages: PageMover, host_rows: int, tail_groups: int,
    emit: EventSink | None = None,
) -> tuple[KVConnector, StateImageMover] | None:  # fmt: skip
    """The connector of one replica's state checkpoints (`StateImageMover` images under checkpoint keys):
    `host_rows` image rows, and the same lower tier as the pages (a third of the disk cap, `STATE_TIER_SHARE`).
    None when there would be no tier at all (no host row and no disk or Redis)."""
    images = StateImageMover(buffer.state_arenas, pages, tail_groups, buffer.arenas)
    if not host_rows and params.kv_connector not in (KVConnectorType.tiered, KVConnectorType.redis):
        return None
    config = params.kv_connector_config or KVConnectorConfig()
    disk = config.disk_max_bytes // STATE_TIER_SHARE if config.disk_offload_dir is not None else None
    connector = create_connector(params, buffer, host_rows, emit, mover=images, disk_bytes=disk, hash_algo="sha256",
                                 kind_tag="_states")  # fmt: skip
    return connector, images
