"""The cases of `python -m benchmarks.connector`: `PagedKVConnector`'s worker side vs the raw medium.

`worker_connector` builds what a vLLM 0.33 worker has on CPU, with vLLM's own
code: a `VllmConfig` of a Llama-shaped model (config only, no weights), the
KV cache group, one int8 buffer with per-layer ``[B, H, N, C]`` views
(`allocate_kv_cache`), and the connector loaded by vLLM's `KVConnectorFactory`.
A `ConnectorCase` then moves `num_pages` blocks per pass in engine-step
batches: "ours" binds the step's metadata and calls ``wait_for_save`` (then
waits for the tier's writes) or ``start_load_kv`` (checking that no block
failed); "raw" moves the same number of bytes with the medium alone.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from pagedkv.bench.tiers_cases import TierCase
from pagedkv.offload.format import HEADER_SIZE

__all__ = ["ConnectorCase", "worker_connector"]


def worker_connector(layers: int, kv_heads: int, head_dim: int, block: int, kv_blocks: int, extra: dict[str, Any],
                     layout: str = "LBHNC") -> tuple[Any, dict[str, torch.Tensor]]:  # fmt: skip
    """(worker-side `PagedKVConnector`, vLLM's per-layer KV views) of a bf16 Llama-shaped model."""
    os.environ.setdefault("VLLM_CACHE_ROOT", tempfile.mkdtemp(prefix="pagedkv-vllm-cache-"))
    from benchmarks.compare.peers import ensure_torchvision_ops

    ensure_torchvision_ops()  # before vLLM / transformers import torchvision
    import vllm.model_executor.models.registry as registry

    registry._run_in_subprocess = lambda fn: fn()  # model inspection in-process (the child lacks the fix above)
    from vllm import config as c
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec
    from vllm.v1.worker.utils import allocate_kv_cache

    model = Path(tempfile.mkdtemp(prefix="pagedkv-bench-model-"))
    (model / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": kv_heads * head_dim * 4,
        "head_dim": head_dim, "intermediate_size": 1024, "num_attention_heads": kv_heads * 4,
        "num_key_value_heads": kv_heads, "num_hidden_layers": layers, "vocab_size": 1000,
        "max_position_embeddings": 4096, "torch_dtype": "bfloat16"}))  # fmt: skip
    vc = c.VllmConfig(
        model_config=c.ModelConfig(model=str(model), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=4096),
        cache_config=c.CacheConfig(block_size=block, enable_prefix_caching=True),
        kv_transfer_config=c.KVTransferConfig(kv_connector="PagedKVConnector", kv_role="kv_both",
                                              kv_connector_module_path="pagedkv.integrations.vllm",
                                              kv_connector_extra_config=extra),
        device_config=c.DeviceConfig(device="cpu"),
    )  # fmt: skip
    vc.cache_config.kv_cache_layout = layout
    spec = FullAttentionSpec(block_size=block, num_kv_heads=kv_heads, head_size=head_dim, dtype=torch.bfloat16)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    kvc = get_kv_cache_config_from_groups(
        vc, [KVCacheGroupSpec(names, spec)], spec.page_size_bytes * layers * kv_blocks
    )
    caches = allocate_kv_cache(kvc, torch.device("cpu"), vc.cache_config.get_resolved_kv_cache_layout())
    worker = KVConnectorFactory.create_connector(vc, KVConnectorRole.WORKER, kvc)
    worker.register_kv_caches(caches)
    return worker, caches


class ConnectorCase(TierCase):
    """`num_pages` blocks per pass through the worker side of `worker` (its one tier, `tier`), in steps of
    `batch` blocks; block i of a pass is KV block ``1 + i % (kv_blocks - 1)`` under a fresh key per repeat.

    Raw: Redis: redis-py pipelined SET / GET of one value per block of the same size (a row of the
    KV buffer's bytes, no header, no gather), one pipeline per step on one connection, the GET only
    receiving the values; disk: one file written / read sequentially (header + row per block, read
    into host rows), no fsync on either side."""

    phases = ("offload", "load")

    def __init__(self, tier: str, worker: Any, caches: dict[str, torch.Tensor], num_pages: int, batch: int,
                 *, redis_url: str | None = None, directory: Path | None = None) -> None:  # fmt: skip
        from pagedkv.integrations.vllm.connector import LoadJob, PagedKVConnectorMetadata, SaveJob

        self.tier = tier
        self.worker, self.meta, self.load_job, self.save_job = worker, PagedKVConnectorMetadata, LoadJob, SaveJob
        mover = worker.mover
        super().__init__(num_pages, mover.row_bytes, batch)
        self.kv_blocks = mover.num_blocks
        self.block_ids = [1 + i % (self.kv_blocks - 1) for i in range(num_pages)]  # block 0 is vLLM's null block
        self.caches = caches
        self.buffer = next(iter(caches.values())).untyped_storage()
        flat = torch.empty(0, dtype=torch.uint8).set_(self.buffer)  # the whole KV buffer, uint8
        gen = torch.Generator().manual_seed(0)
        flat.copy_(
            torch.randint(-(2**62), 2**62, (flat.numel() // 8,), dtype=torch.int64, generator=gen).view(torch.uint8)
        )
        self.flat = flat
        self.snapshot = flat.clone()  # the stored blocks, to check the loads
        self.raw_rows = self.snapshot[: (flat.numel() // self.row_bytes) * self.row_bytes].view(-1, self.row_bytes)
        self.raw_views = [memoryview(r.numpy()) for r in self.raw_rows]
        [self.store] = worker.tiers.tiers
        if tier == "redis":
            import redis

            assert redis_url is not None
            self.client: Any = redis.Redis.from_url(redis_url)
            self.medium = "redis-py pipelined SET / GET, same-size values"
        else:
            assert directory is not None
            self.raw_path = directory / "raw.bin"
            self.raw_dst = torch.empty((batch, self.row_bytes), dtype=torch.uint8)  # [batch, row]
            self.medium = "one file, sequential write / read"

    def prepare(self, phase: str, side: str) -> None:
        if phase == "load" and side == "ours" and self.rep == 1:  # the first repeat's `verify` sees loaded bytes
            for view in self.caches.values():
                view[1:].zero_()  # every block but vLLM's null block

    def _ours(self, phase: str) -> int:
        moved = 0
        for part in self.batches():
            ids, keys = self.block_ids[part.start : part.stop], self.keys[part.start : part.stop]
            if phase == "offload":
                meta = self.meta(saves=[self.save_job("bench", ids, keys)])
            else:
                meta = self.meta(loads=[self.load_job("bench", ids, keys)])
            self.worker.bind_connector_metadata(meta)
            if phase == "offload":
                self.worker.wait_for_save()
            else:
                self.worker.start_load_kv(None)
                failed = self.worker.get_block_ids_with_load_errors()
                if failed:
                    raise RuntimeError(f"{self.tier}: {len(failed)} blocks failed to load")
            self.worker.clear_connector_metadata()
            moved += len(ids) * self.row_bytes
        if phase == "offload":
            self.worker.wait_for_writes()
            if self.store.stats.errors or self.store.stats.skipped_writes:
                raise RuntimeError(f"{self.tier}: errors while storing: {self.store.stats.snapshot()}")
        return moved

    def _raw(self, phase: str) -> int:
        rows = len(self.raw_views)
        moved = 0
        if self.tier == "redis":
            for part in self.batches():
                with self.client.pipeline(transaction=False) as pipe:
                    for i in part:
                        name = f"raw:{self.keys[i].hex()}"
                        pipe.set(name, self.raw_views[i % rows]) if phase == "offload" else pipe.get(name)
                    replies = pipe.execute()
                moved += len(part) * self.row_bytes if phase == "offload" else sum(len(v) for v in replies)
            return moved
        header = bytes(HEADER_SIZE)
        if phase == "offload":
            with open(self.raw_path, "wb", buffering=0) as f:
                for i in range(self.num_pages):
                    f.write(header)
                    moved += f.write(self.raw_views[i % rows])
            return moved
        with open(self.raw_path, "rb", buffering=0) as f:
            head = bytearray(HEADER_SIZE)
            for i in range(self.num_pages):
                f.readinto(head)
                moved += f.readinto(self.raw_dst[i % self.batch].numpy().data)
        return moved

    def run(self, phase: str, side: str) -> int:
        return self._ours(phase) if side == "ours" else self._raw(phase)

    def verify(self) -> bool:
        return torch.equal(self.flat, self.snapshot)

    def end(self) -> None:
        self.store.reset()
        if self.tier == "redis":
            names = [f"raw:{k.hex()}" for k in self.keys]
            for lo in range(0, len(names), 512):
                self.client.unlink(*names[lo : lo + 512])
        else:
            self.raw_path.unlink(missing_ok=True)

    def close(self) -> None:
        self.worker.shutdown()
        if self.tier == "redis":
            self.client.close()
