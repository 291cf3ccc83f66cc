"""`pagedkv demo --connector tiered|redis`: prefixes reused across engine processes through a tier.

Three fresh processes serve chat requests whose groups share long system
prompts, with a Llama-style model (8 layers, hidden 512) built from a
seeded config:

1. fill:      engine with the connector; its pages go down to host, then disk / Redis.
2. warm:      a new process, cold device and host, the same connector: new questions
              after the same system prompts, so each group's prompt comes from disk / Redis.
3. recompute: a new process without any connector serves the same requests as (2).

It prints where each run's prompt tokens came from (device prefix cache,
host, disk, Redis, computed), the time to first token of (2) and (3), and
checks that (2) and (3) generated the same tokens.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Any

import numpy as np

__all__ = ["TierDemoSpec", "run_tier_demo", "serve_phase"]

TierDemoSpec = dict[str, Any]  # JSON: connector, dir, redis_url, prefix, seed, questions_seed, requests...


def build_tier_model(seed: int = 0) -> Any:
    """The tier demo's model: Llama-style, 8 layers, hidden 512, GQA 8:4, vocab 2048, seeded weights."""
    from pagedkv.testing import build_llama

    return build_llama(
        seed, vocab_size=2048, hidden_size=512, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=4096, initializer_range=0.05,
    )  # fmt: skip


def prompts(spec: TierDemoSpec, vocab: int) -> list[list[int]]:
    """`groups` system prompts (fixed by `seed`), each followed by `requests // groups` questions
    drawn with `questions_seed` (a new seed gives new questions after the same system prompts)."""
    system = np.random.default_rng(spec["seed"]).integers(3, vocab, size=(spec["groups"], spec["prefix_len"]))
    rng = np.random.default_rng(spec["questions_seed"])
    out = []
    for i in range(spec["requests"]):
        question = rng.integers(3, vocab, size=int(rng.integers(16, 48)))
        out.append([*system[i % spec["groups"]].tolist(), *question.tolist()])
    return out


def serve_phase(spec: TierDemoSpec) -> dict[str, Any]:
    """One engine process's run (called in a fresh process by `run_tier_demo`): outputs, TTFTs,
    where the prompt tokens came from, and each tier's counters."""
    import torch

    from pagedkv.engine import LLMEngine
    from pagedkv.params.connector import KVConnectorConfig

    torch.set_num_threads(spec.get("threads", 4))
    model = build_tier_model(spec["seed"])
    tiers: dict[str, Any] = {}
    if spec["connector"] != "null":
        config = KVConnectorConfig(model_id="pagedkv-tier-demo", disk_offload_dir=spec.get("dir"),
                                   redis_url=spec.get("redis_url"), redis_key_prefix=spec.get("prefix", "pagedkv:"))  # fmt: skip
        tiers = dict(kv_connector=spec["connector"], kv_connector_config=config, host_kvcache_swap_space_gb=0.25,
                     total_num_host_pages=spec["host_pages"])  # fmt: skip
    engine = LLMEngine.from_hf(model, page_size=16, num_pages=spec["device_pages"], max_batch_size=8,
                               max_num_batched_tokens=512, **tiers)  # fmt: skip
    requests = [engine.add_request(p, spec["new_tokens"]) for p in prompts(spec, model.config.vocab_size)]
    start = time.perf_counter()
    engine.run()
    wall = time.perf_counter() - start
    engine.manager.sync_tiers()  # every page pushed down and written: the next process finds them
    stats = engine.manager.tier_stats()
    engine.manager.close()
    summary = engine.summary
    from_tiers = {name: int(s["pages_loaded"]) * 16 for name, s in stats.items()}  # type: ignore[call-overload]
    ttfts = [r.ttft for r in requests if r.ttft is not None]
    return {
        "connector": spec["connector"], "outputs": [r.output for r in requests], "wall_seconds": wall,
        "ttft_mean": statistics.mean(ttfts), "ttft_p50": statistics.median(ttfts), "prompt_tokens":
        summary["prompt_tokens"], "cached_tokens": summary["prompt_tokens_cached"], "from_tiers": from_tiers,
        "from_device": summary["prompt_tokens_cached"] - sum(from_tiers.values()),
        "computed_tokens": summary["prefill_tokens_computed"], "tier_stats": stats,
    }  # fmt: skip


def _run_process(spec: TierDemoSpec) -> dict[str, Any]:
    result = subprocess.run([sys.executable, "-m", "pagedkv.demos.tiers", json.dumps(spec)], capture_output=True,
                            text=True, timeout=1800)  # fmt: skip
    if result.returncode != 0:
        raise RuntimeError(f"tier demo process failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def _sources(r: dict[str, Any]) -> str:
    total = r["prompt_tokens"]
    parts = [f"device {r['from_device'] / total:.3f}"]
    parts += [f"{name} {tokens / total:.3f}" for name, tokens in r["from_tiers"].items()]
    parts.append(f"computed {r['computed_tokens'] / total:.3f}")
    return ", ".join(parts)


def run_tier_demo(
    connector: str,
    *,
    directory: str | None = None,
    redis_url: str | None = None,
    requests: int = 24,
    seed: int = 0,
    groups: int = 6,
    prefix_len: int = 1024,
) -> dict[str, Any]:
    """Run fill, warm and recompute in fresh processes; print the report; return the three results."""
    if connector == "redis" and not redis_url:
        raise ValueError("--connector redis needs --redis-url (e.g. redis://127.0.0.1:6379/0)")
    if connector not in ("local", "tiered", "redis"):
        raise ValueError(f"connector={connector!r}: choose tiered or redis (local lives in one process only)")
    scratch = tempfile.TemporaryDirectory(prefix="pagedkv-tier-demo-")
    base: TierDemoSpec = dict(
        connector=connector, dir=directory or scratch.name, redis_url=redis_url, seed=seed, groups=groups,
        prefix_len=prefix_len,
        requests=requests, new_tokens=8, device_pages=512, host_pages=512, prefix=f"pagedkv-demo:{uuid.uuid4().hex}:",
    )  # fmt: skip
    where = {"tiered": f"disk under {base['dir']}", "redis": f"Redis at {redis_url}", "local": "host memory"}
    print(f"pagedkv tier demo: {requests} requests in {groups} groups sharing a {prefix_len}-token system prompt, "
          "8 new tokens; "
          f"Llama-style model (8 layers, hidden 512); connector {connector} ({where[connector]})")  # fmt: skip
    try:
        fill = _run_process({**base, "questions_seed": seed + 1})
        print(f"  1 fill       prompt tokens from: {_sources(fill)}")
        warm = _run_process({**base, "questions_seed": seed + 2})
        print(f"  2 warm       prompt tokens from: {_sources(warm)}  (new process, new questions)")
        cold = _run_process({**base, "connector": "null", "questions_seed": seed + 2})
        print(f"  3 recompute  prompt tokens from: {_sources(cold)}  (new process, no tier)")
    finally:
        if connector == "redis":
            _delete_redis_keys(str(redis_url), base["prefix"])
        scratch.cleanup()
    for name, r in (("warm from the tier", warm), ("recompute", cold)):
        print(f"  time to first token, {name:18s}: mean {1e3 * r['ttft_mean']:7.1f} ms, "
              f"median {1e3 * r['ttft_p50']:7.1f} ms")  # fmt: skip
    print(f"  TTFT speedup (mean): {cold['ttft_mean'] / warm['ttft_mean']:.2f}x")
    same = sum(a == b for a, b in zip(warm["outputs"], cold["outputs"], strict=True))
    print(f"  outputs: {same}/{len(cold['outputs'])} identical between the warm run and the recompute run")
    return {"fill": fill, "warm": warm, "recompute": cold, "identical": same, "requests": len(cold["outputs"]),
            "ttft_speedup": cold["ttft_mean"] / warm["ttft_mean"]}  # fmt: skip


def _delete_redis_keys(url: str, prefix: str) -> None:
    """Remove the demo's keys (its own random prefix) from the server (every node of a cluster)."""
    try:
        from pagedkv.offload.redis_client import redis_client, unlink_prefix
        from pagedkv.params.connector import KVConnectorConfig

        for _ in unlink_prefix(redis_client(KVConnectorConfig(redis_url=url)), prefix):
            pass
    except Exception as exc:  # noqa: BLE001 - cleanup is best effort: report and go on
        print(f"  (could not delete the demo's Redis keys: {exc})")


if __name__ == "__main__":  # one phase in this fresh process: print its JSON result last
    print(json.dumps(serve_phase(json.loads(sys.argv[1]))))
    sys.exit(0)
