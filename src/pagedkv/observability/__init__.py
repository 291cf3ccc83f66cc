"""Observability: KV events over ZMQ in vLLM's wire format, and a Prometheus exporter.

Importing this package needs neither pyzmq, msgspec nor prometheus_client: they are imported
when a publisher, an encoder or a collector is first used (``pip install 'pagedkv[events]'``,
``pip install 'pagedkv[metrics]'``).
"""

from __future__ import annotations

from pagedkv.observability.kv_events import (
    END_SEQ,
    ZmqEventPublisher,
    decode_batch,
    encode_batch,
    external_block_hash,
    offset_endpoint_port,
)
from pagedkv.observability.prometheus import MetricsServer, PagedKVCollector, start_metrics_server

__all__ = [
    "END_SEQ", "MetricsServer", "PagedKVCollector", "ZmqEventPublisher", "decode_batch", "encode_batch",
    "external_block_hash", "offset_endpoint_port", "start_metrics_server",
]  # fmt: skip
