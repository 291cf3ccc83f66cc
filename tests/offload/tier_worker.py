"""One "engine process" for the tier tests: serves scripted prompts through a real PagedKVCacheManager
with tiers, under PrefixStampModel (which checks every cached position's KV), and prints a JSON report.

    python tier_worker.py '{"connector": "tiered", "dir": "...", "prompts": [[1, 2, ...], ...], ...}'

Keys: connector (local/tiered/redis), dir, redis_url, prompts, new_tokens (4), device_pages (8),
host_pages (0 = none for redis), max_gb (disk cap), fsize_limit (bytes; RLIMIT_FSIZE, a full disk),
model_id, reset_device_between (true: evict the device prefix cache before each prompt).
"""

from __future__ import annotations

import json
import resource
import signal
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from helpers import make_params  # noqa: E402
from pagedkv.core.context import TextContext  # noqa: E402
from pagedkv.manager.paged import PagedKVCacheManager  # noqa: E402
from pagedkv.params.connector import KVConnectorConfig  # noqa: E402
from pagedkv.testing import PrefixStampModel  # noqa: E402


def build(spec: dict) -> PagedKVCacheManager:
    config = KVConnectorConfig(
        model_id=spec.get("model_id", "stamp"), disk_offload_dir=spec.get("dir"),
        disk_offload_max_gb=spec.get("max_gb", 1.0), redis_url=spec.get("redis_url"),
        redis_key_prefix=spec.get("prefix", "pagedkv-test:"), redis_retry_s=spec.get("retry_s", 0.2),
        redis_timeout_s=spec.get("timeout_s", 0.5),
    )  # fmt: skip
    params = make_params(
        n_kv_heads=2, head_dim=4, num_layers=2, enable_prefix_caching=True, kv_connector=spec["connector"],
        host_kvcache_swap_space_gb=1 if spec["connector"] != "redis" else None, kv_connector_config=config,
    )  # fmt: skip
    return PagedKVCacheManager(params, None, spec.get("device_pages", 8), total_num_host_pages=spec.get("host_pages", 4),
                               max_batch_size=4, enable_runtime_checks=True)  # fmt: skip


def serve(mgr: PagedKVCacheManager, model: PrefixStampModel, rid: int, prompt: list[int], new: int) -> int:
    c = TextContext(rid, np.asarray(prompt, dtype=np.int64))
    mgr.claim(rid)
    cached = -1
    for t in range(new):
        mgr.alloc(c)
        if cached < 0:
            cached = c.cached_prefix_length
        model.forward([[c]])
        c.update(1000 + t)
        mgr.step([[c]])
    mgr.release(rid)
    return cached


def main() -> None:
    spec = json.loads(sys.argv[1])
    if "fsize_limit" in spec:  # every file write past this size fails with EFBIG, as on a full disk
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (spec["fsize_limit"], spec["fsize_limit"]))
    mgr = build(spec)
    model = PrefixStampModel(mgr)
    cached = []
    for i, prompt in enumerate(spec["prompts"]):
        if spec.get("reset_device_between", True):
            for bm in mgr._managers:
                bm.reset_prefix_cache()  # the device forgets: hits must come from the tiers
        cached.append(serve(mgr, model, i, prompt, spec.get("new_tokens", 4)))
    mgr.sync_tiers()
    report = {"cached": cached, "checked": model.positions_checked, "stats": mgr.tier_stats(),
              "host_used": mgr.get_num_used_host_pages(), "disk_used": mgr.get_num_used_disk_pages()}  # fmt: skip
    mgr.check_integrity()
    mgr.close()
    print(json.dumps(report))


if __name__ == "__main__":
    main()
