"""`pagedkv bench hybrid`: memory, prefix hits and bookkeeping of mixed-attention models.

The scenario letters name the four setups vLLM 0.33's hybrid KV cache manager was measured in, on
the same kind of machine and the same traces: A all-full decode, B all-full hit rate, D hybrid
decode, E hybrid hit rate (vLLM's "Hybrid KV Cache Manager" design document describes the groups).

1. KV bytes one request holds at 8k and 32k context, for a Gemma3-like model
   (48 layers, 5 local : 1 global, window 1024, 8 KV heads x 256, bf16) and a
   gpt-oss-like model (24 layers alternating window 128 / full, 8 x 64, bf16):
   pagedkv vs every layer full, vs the theoretical minimum (full layers keep
   every token, window layers their last W).
2. Prefix hit rate at fixed memory, scenario E: 2000 requests, 64 system prompts
   of 1024 tokens chosen zipf(1), 256-token suffixes, 128 outputs; 32 layers of
   which 24 sliding (W=1024) in 3 groups + 8 full, 8 KV heads x 128 bf16, page 16,
   8 GiB (16384 page ids of 8 layers); 256 sequences and 8192 prompt tokens a
   step. The same trace all-full at 8 GiB is scenario B.
3. Decode bookkeeping per request per step with those 4 groups (and with one
   full group), at 40 GiB where nothing is evicted: scenarios D and A.
Buffers live on torch's meta device: only bookkeeping runs.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from pagedkv.bench import report
from pagedkv.bench.timing import gc_frozen
from pagedkv.core.context import TextContext
from pagedkv.dtype import DeviceRef, DType
from pagedkv.interface import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec, group_layer_specs
from pagedkv.interface.config import KVCacheConfig, KVCacheGroupSpec
from pagedkv.manager.paged import PagedKVCacheManager
from pagedkv.params.bridge import params_from_kv_cache_config
from pagedkv.params.kv import KVCacheParams
from pagedkv.params.multi import MultiKVCacheParams
from pagedkv.workloads.replay import replay
from pagedkv.workloads.traces import ideal_hit_rates, shared_prefix_trace

__all__ = ["MODELS", "add_arguments", "command", "format_hybrid_report", "plots", "run_hybrid_bench"]

GiB = 1024**3
META = [DeviceRef.META()]
# name -> (layer kinds as window sizes (None = full), kv heads, head_dim)
MODELS: dict[str, tuple[list[int | None], int, int]] = {
    "gemma3-like (48 layers, 5:1, W=1024)": ([None if (i + 1) % 6 == 0 else 1024 for i in range(48)], 8, 256),
    "gpt-oss-like (24 layers, 1:1, W=128)": ([128 if i % 2 == 0 else None for i in range(24)], 8, 64),
}


def layer_specs(windows: list[int | None], heads: int, head_dim: int, page: int = 16) -> dict[str, KVCacheSpec]:
    """One spec per layer: full attention, or a sliding window of that size."""
    common: dict[str, Any] = dict(block_size=page, num_kv_heads=heads, head_size=head_dim, dtype=DType.bfloat16)
    return {
        str(i): FullAttentionSpec(**common) if w is None else SlidingWindowSpec(**common, sliding_window=w)
        for i, w in enumerate(windows)
    }


def params_for(specs: dict[str, KVCacheSpec], **kwargs: Any) -> KVCacheParams | MultiKVCacheParams:
    """The params tree of vLLM-style groups of `specs` (a single cache when there is one group)."""
    groups = group_layer_specs(specs)
    tree = params_from_kv_cache_config(
        KVCacheConfig(1, [], [KVCacheGroupSpec(n, s) for n, s in groups]), META, **kwargs
    )
    return tree.leaves()[0] if len(groups) == 1 else tree


def request_bytes(params: KVCacheParams | MultiKVCacheParams, context: int, chunk: int = 2048) -> int:
    """Bytes of the pages one request holds in a decode step at `context` tokens (prefill chunked)."""
    page_bytes = max(leaf.bytes_per_block for leaf in params.leaves())  # one page id, whichever group
    manager = PagedKVCacheManager(
        params, None, -(-2 * context // params.page_size) * len(params.leaves()), max_batch_size=1
    )
    ctx = TextContext(0, list(range(context - 1)))
    manager.claim(0)
    while ctx.tokens.active_length > 1 or ctx.tokens.is_chunked:
        manager.alloc(ctx, num_scheduled_tokens=chunk)
        if ctx.tokens.active_length > chunk:
            ctx.tokens.chunk(chunk)
        ctx.update(1)
        manager.step([[ctx]])
    manager.alloc(ctx)  # the decode step at position context - 1
    return manager.get_num_used_pages() * page_bytes


def minimum_bytes(windows: list[int | None], heads: int, head_dim: int, context: int) -> int:
    """What the layers need: every token in a full layer, the last W in a window layer."""
    per_token = 2 * heads * head_dim * 2  # K and V, bf16
    return sum((context if w is None else min(w, context)) * per_token for w in windows)


def memory_figures(contexts: tuple[int, ...] = (8192, 32768)) -> list[dict[str, Any]]:
    """KV bytes per request, pagedkv vs all-full vs minimum, per model and context."""
    rows = []
    for name, (windows, heads, head_dim) in MODELS.items():
        params = params_for(layer_specs(windows, heads, head_dim))
        for context in contexts:
            paged = request_bytes(params, context)
            full = context * len(windows) * 2 * heads * head_dim * 2
            minimum = minimum_bytes(windows, heads, head_dim, context)
            rows.append({"model": name, "context": context, "paged": paged, "all_full": full, "minimum": minimum})
    return rows


# (label, window layers?, eviction policy, protected_fraction, vLLM 0.33 on the same trace and memory)
HIT_SCENARIOS = (
    ("E: 3 SW groups + 1 full", True, "lru", 0.25, 0.4058),
    ("E: 3 SW groups + 1 full", True, "slru", 0.25, 0.4058),
    ("E: 3 SW groups + 1 full", True, "slru", 0.0, 0.4058),
    ("B: all full", False, "lru", 0.25, 0.6530),
    ("B: all full", False, "slru", 0.25, 0.6530),
)


def hit_rate_figures(num_requests: int = 2000, seed: int = 0) -> list[dict[str, Any]]:
    """Scenario E (3 sliding groups + 1 full, 8 GiB) and B (all full, 8 GiB) on the zipf trace,
    under each eviction setting of `HIT_SCENARIOS`, with decode bookkeeping per request-step."""
    trace = shared_prefix_trace(num_requests, 64, 1024, 256, 128, seed=seed, zipf=1.0)
    ideal = ideal_hit_rates(trace, 16)[0]  # page-granular
    rows = []
    for name, windowed, policy, fraction, vllm in HIT_SCENARIOS:
        windows: list[int | None] = [1024] * 24 + [None] * 8 if windowed else [None] * 32
        params = params_for(
            layer_specs(windows, 8, 128), enable_prefix_caching=True, eviction_policy=policy,
            protected_fraction=fraction,
        )  # fmt: skip
        pages = 8 * GiB // max(leaf.bytes_per_block for leaf in params.leaves())
        manager = PagedKVCacheManager(params, None, pages, max_batch_size=256)
        with gc_frozen():
            stats = replay(manager, trace, max_batch_size=256, max_num_batched_tokens=8192)
        rows.append({
            "scenario": name, "policy": policy, "protected_fraction": fraction, "pages": pages,
            "groups": len(params.leaves()), "hit_rate": stats.first_admission_hit_rate, "ideal": ideal,
            "vllm": vllm, "preemptions": stats.preemptions,
        })  # fmt: skip
    return rows


def _decode_us(windows: list[int | None], pages: int, batch: int, steps: int) -> float:
    """Mean microseconds of alloc + step per request per decode step: `batch` requests of vLLM's
    scenario D trace (8 shared 1024-token prompts + 256 unique tokens), prefilled untimed first."""
    params = params_for(layer_specs(windows, 8, 128), enable_prefix_caching=True)
    manager = PagedKVCacheManager(params, None, pages, max_batch_size=batch)
    contexts = [TextContext(r.rid, r.prompt) for r in shared_prefix_trace(batch, 8, 1024, 256, steps)]
    for c in contexts:
        manager.claim(c.request_id)
        manager.alloc(c)
        c.update(1)
        manager.step([[c]])
    with gc_frozen():
        seconds, clock = 0.0, time.perf_counter
        for _ in range(steps):
            start = clock()
            for c in contexts:
                manager.alloc(c)
            seconds += clock() - start
            for c in contexts:  # the model's part: not bookkeeping
                c.update(7)
            start = clock()
            manager.step([contexts])
            seconds += clock() - start
    return 1e6 * seconds / (batch * steps)


def decode_figures(repeats: int = 5, batch: int = 256, steps: int = 128) -> list[dict[str, Any]]:
    """Decode bookkeeping, hybrid 3:1 (4 groups) vs all full, alternated `repeats` times (best kept),
    at vLLM's 40 GiB (81920 / 20480 page ids): nothing is evicted, as in vLLM's scenarios D and A."""
    configs: dict[str, tuple[list[int | None], int, float]] = {
        "3 SW groups + 1 full (4 groups)": ([1024] * 24 + [None] * 8, 81920, 14.6),
        "all full (1 group)": ([None] * 32, 20480, 4.95),
    }
    best = dict.fromkeys(configs, float("inf"))
    for _ in range(repeats):
        for name, (windows, pages, _) in configs.items():
            best[name] = min(best[name], _decode_us(windows, pages, batch, steps))
    return [{"model": name, "decode_us": best[name], "vllm_us": vllm} for name, (_, _, vllm) in configs.items()]


def run_hybrid_bench(num_requests: int = 2000, seed: int = 0, repeats: int = 5) -> dict[str, Any]:
    """Every figure of the module docstring."""
    return {
        "memory": memory_figures(), "hits": hit_rate_figures(num_requests, seed),
        "decode": decode_figures(repeats, batch=min(256, num_requests)),
    }  # fmt: skip


def format_hybrid_report(r: dict[str, Any]) -> str:
    """Markdown tables of the figures."""
    lines = [
        "| model | context | pagedkv | all layers full | minimum | pagedkv / minimum |",
        "|---|---|---|---|---|---|",
    ]
    for m in r["memory"]:
        lines.append(
            f"| {m['model']} | {m['context']} | {m['paged'] / 2**20:.1f} MiB | {m['all_full'] / 2**20:.1f} MiB | "
            f"{m['minimum'] / 2**20:.1f} MiB | {m['paged'] / m['minimum']:.3f} (target <= 1.05) |"
        )
    lines += ["", "| scenario (8 GiB) | groups | policy | protected_fraction | hit rate | ideal | vLLM 0.33 | "
              "preemptions |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for h in r["hits"]:
        lines.append(
            f"| {h['scenario']} | {h['groups']} | {h['policy']} | {h['protected_fraction']} | {h['hit_rate']:.4f} | "
            f"{h['ideal']:.4f} | {h['vllm']:.4f} | {h['preemptions']} |"
        )
    lines += ["", "| decode, 40 GiB, 256 requests | pagedkv us / request-step (alloc + step, hashing included) | "
              "vLLM 0.33 allocate_slots (hashing excluded) |", "|---|---|---|"]  # fmt: skip
    for d in r["decode"]:
        lines.append(f"| {d['model']} | {d['decode_us']:.2f} | {d['vllm_us']:.2f} |")
    return "\n".join(lines)


def plots(r: dict[str, Any]) -> list[report.Plot]:
    """KV bytes per request, hit rates against the ideal and vLLM, decode bookkeeping against vLLM."""
    mem, hits, dec = r["memory"], r["hits"], r["decode"]
    return [
        report.Plot("hybrid_memory_mib", "KV per request", "MiB", [f"{m['model'].split(' (')[0]} @ {m['context']}" for m in mem],
                    {k: [m[key] / 2**20 for m in mem] for k, key in (("pagedkv", "paged"), ("all layers full", "all_full"),
                                                                     ("minimum", "minimum"))}),
        report.Plot("hybrid_hit_rate", "prefix hit rate at 8 GiB",  "hit rate",
                    [f"{h['scenario'][0]} {h['policy']} {h['protected_fraction']}" for h in hits],
                    {"pagedkv": [h["hit_rate"] for h in hits], "ideal": [h["ideal"] for h in hits],
                     "vLLM 0.33": [h["vllm"] for h in hits]}),
        report.Plot("hybrid_decode_us", "decode bookkeeping at 40 GiB", "us per request-step",
                    [d["model"] for d in dec], {"pagedkv": [d["decode_us"] for d in dec],
                                                "vLLM 0.33": [d["vllm_us"] for d in dec]}),
    ]  # fmt: skip


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `pagedkv bench hybrid`."""
    p.add_argument("--requests", type=int, default=2000, help="requests of the zipf hit-rate trace")
    p.add_argument("--seed", type=int, default=0, help="seed of the hit-rate trace")
    p.add_argument("--repeats", type=int, default=5, help="alternated decode runs; the best of each is kept")


def command(args: argparse.Namespace) -> int:
    """`pagedkv bench hybrid`: measure, print the tables, write --json / --plots."""
    result = run_hybrid_bench(num_requests=args.requests, seed=args.seed, repeats=args.repeats)
    report.finish(args, format_hybrid_report(result), result, plots)
    return 0
