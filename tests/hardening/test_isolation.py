"""Tenants (`cache_salt`) and weights versions get disjoint hash chains on the device and in every tier.

Each case: tenant A serves a prompt; the device forgets it (or a fresh manager, another "process", starts
with an empty device), so a hit could only come from the tier under test; then tenant B (and a request
with no salt) serves the same prompt and must get no hit at all, while A, asking again, does (the
positive control: the tier does serve A's pages). The same for a weights version: after
`set_weights_version`, nothing computed under the old version is served.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from helpers import make_params
from offload.redis_server import RedisServer
from pagedkv.core.context import TextContext
from pagedkv.dtype import DeviceRef
from pagedkv.manager.paged import PagedKVCacheManager
from pagedkv.params.connector import KVConnectorConfig
from pagedkv.testing import PrefixStampModel

PROMPT = list(range(1, 30))  # 29 tokens, page 4: 7 full prompt pages
TIERS = ["device", "host", "disk", "redis"]


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with RedisServer.running(tmp_path_factory.mktemp("redis")) as server:
        yield server


def _params(tier: str, root: Path, redis: RedisServer | None, **extra: Any) -> Any:
    base: dict[str, Any] = dict(n_kv_heads=2, head_dim=4, num_layers=2, page_size=4, enable_prefix_caching=True)
    if tier == "host":
        base.update(kv_connector="local", host_kvcache_swap_space_gb=0.001)
    elif tier == "disk":
        base.update(kv_connector="tiered", host_kvcache_swap_space_gb=0.001,
                    kv_connector_config=KVConnectorConfig(disk_offload_dir=str(root / "disk")))  # fmt: skip
    elif tier == "redis":
        assert redis is not None
        base.update(kv_connector="redis", kv_connector_config=KVConnectorConfig(
            redis_url=redis.url, redis_key_prefix=f"iso-{root.name}:", redis_timeout_s=2.0))  # fmt: skip
    return make_params(**base, **extra)


class Deployment:
    """Managers of one deployment: for disk and Redis each `fresh()` one is another process's view."""

    def __init__(self, tier: str, root: Path, redis: RedisServer | None, **extra: Any) -> None:
        self.tier, self.root, self.redis, self.extra = tier, root, redis, extra
        self.mgr = self._new()
        self.next_id = 0

    def _new(self) -> PagedKVCacheManager:
        params = _params(self.tier, self.root, self.redis, **self.extra)
        return PagedKVCacheManager(params, None, 64, total_num_host_pages=64 if self.tier in ("host", "disk") else 0,
                                   max_batch_size=4, enable_runtime_checks=True)  # fmt: skip

    def serve(self, salt: str | None) -> int:
        """Serve PROMPT (+2 tokens) as tenant `salt`; returns the prompt tokens that were cache hits."""
        c = TextContext(self.next_id, np.asarray(PROMPT), cache_salt=salt)
        self.next_id += 1
        model = PrefixStampModel(self.mgr)  # checks that every cached position holds its own prefix's KV
        self.mgr.claim(c.request_id)
        cached = -1
        for t in range(2):
            self.mgr.alloc(c)
            cached = c.cached_prefix_length if cached < 0 else cached
            model.forward([[c]])
            c.update(1000 + t)
            self.mgr.step([[c]])
        self.mgr.release(c.request_id)
        self.mgr.sync_tiers()
        self.mgr.check_integrity()
        return cached

    def forget_device(self) -> None:
        """Drop the device's cached pages: the next hit can only come from the tier under test."""
        if self.tier == "device":
            return
        if self.tier in ("disk", "redis"):  # another process: a new manager, an empty device, the same tier
            self.mgr.close()
            self.mgr = self._new()
        else:
            for bm in self.mgr._managers:
                bm.reset_prefix_cache()

    def set_weights_version(self, version: str) -> None:
        """A weight update: this manager moves to `version`, and so does every later "process"."""
        self.mgr.set_weights_version(version)
        self.extra["weights_version"] = version

    def tier_hits(self) -> int:
        return sum(int(s["pages_loaded"]) for s in self.mgr.tier_stats().values())  # type: ignore[call-overload]


def _deployment(tier: str, tmp_path: Path, request: pytest.FixtureRequest, **extra: Any) -> Deployment:
    redis = request.getfixturevalue("redis_server") if tier == "redis" else None
    return Deployment(tier, tmp_path, redis, **extra)


FULL_PAGES = (len(PROMPT) - 1) // 4 * 4  # 28 prompt tokens in full pages can be hits


@pytest.mark.parametrize("tier", TIERS)
def test_tenant_b_gets_no_hit_on_tenant_a_prompt(tier: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    d = _deployment(tier, tmp_path, request)
    assert d.serve("tenant-a") == 0
    for other in ("tenant-b", None, "tenant-a "):  # another tenant, no tenant, a near-identical salt
        d.forget_device()
        hits_before = d.tier_hits()
        assert d.serve(other) == 0, f"{other!r} hit tenant-a's pages on {tier}"
        assert d.tier_hits() == hits_before, f"{other!r} got a {tier} tier hit"
    d.forget_device()
    assert d.serve("tenant-a") == FULL_PAGES  # the control: tenant A's own pages are served from this tier
    d.mgr.close()


@pytest.mark.parametrize("tier", TIERS)
def test_no_page_of_old_weights_is_served_after_an_update(
    tier: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    d = _deployment(tier, tmp_path, request, weights_version="step-100")
    assert d.mgr.weights_version == "step-100"
    assert d.serve(None) == 0 and d.serve("t") == 0
    d.set_weights_version("step-101")  # an RL trainer pushed new weights: no reset_prefix_cache
    for salt in (None, "t"):
        d.forget_device()
        hits_before = d.tier_hits()
        assert d.serve(salt) == 0, f"a page of the old weights was served from {tier}"
        assert d.tier_hits() == hits_before
    d.forget_device()
    assert d.serve(None) == FULL_PAGES  # pages of the new version are shared as usual
    d.set_weights_version("step-100")
    d.forget_device()
    assert d.serve("t") == FULL_PAGES  # and the old version's pages are still those of the old weights
    d.mgr.close()


def test_weights_version_moves_every_replica_and_is_validated() -> None:
    mgr = PagedKVCacheManager(make_params(enable_prefix_caching=True, data_parallel_degree=2,
                                          devices=[DeviceRef.CPU()] * 2), None, 8, max_batch_size=2)  # fmt: skip
    mgr.set_weights_version("v9")
    assert [bm.hasher.version for bm in mgr._managers] == ["v9", "v9"]
    for bad, err, match in [(7, TypeError, "version=7 must be a str or None"),
                            ("", ValueError, "version has 0 characters; it must have 1 to 1024"),
                            ("x" * 1025, ValueError, "version has 1025 characters")]:  # fmt: skip
        with pytest.raises(err, match=match):
            mgr.set_weights_version(bad)  # type: ignore[arg-type]
    assert mgr.weights_version == "v9"
    mgr.set_weights_version(None)
    assert mgr.weights_version is None
