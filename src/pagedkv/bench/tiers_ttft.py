"""Time to first token of a fresh engine whose tier is warm vs one that recomputes (`pagedkv bench tiers`).

A Llama-style model from a seeded config (default hidden 512, 8 layers, 8 KV
heads x 64, fp32: big enough on CPU that prefill dominates) serves prompts of
`prompt_len` distinct random tokens, one request at a time (TTFT = that
request's own prefill, no queueing). Two processes:

1. ``fill`` (in the bench's process): an engine with ``kv_connector="tiered"``
   (disk) serves the prompts, then `sync_tiers` + `close`; another with
   ``"redis"`` does the same.
2. ``measure``, a fresh process: per repeat, alternated, a fresh engine (empty
   device pool and host tier) with the warm disk tier (the files in the OS page
   cache, then again after `drop_page_cache` evicted them), one with the warm
   Redis tier, and one without any connector that recomputes every prompt.
   Each serves the same prompts; their generated tokens must be identical.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

__all__ = ["format_ttft_report", "run_ttft"]

MODES = ("disk", "disk_cold", "redis", "recompute")
LABELS = {
    "disk": "warm disk tier (files in the OS page cache)", "disk_cold": "warm disk tier (page cache dropped)",
    "redis": "warm Redis tier", "recompute": "recompute (no connector)",
}  # fmt: skip


def build_model(spec: dict[str, Any]) -> Any:
    """The seeded Llama-style model of `spec` (fp32, eval mode)."""
    from pagedkv.testing import build_llama

    hidden, heads = spec["hidden"], spec["heads"]
    return build_llama(
        spec["seed"], vocab_size=spec["vocab"], hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=spec["layers"], num_attention_heads=heads, num_key_value_heads=heads,
        max_position_embeddings=spec["prompt_len"] + 256, initializer_range=0.05,
    )  # fmt: skip


def prompts(spec: dict[str, Any]) -> list[list[int]]:
    """`num_prompts` seeded prompts of `prompt_len` random tokens (no shared prefix between them)."""
    import numpy as np

    rng = np.random.default_rng(spec["seed"])
    return rng.integers(3, spec["vocab"], size=(spec["num_prompts"], spec["prompt_len"])).tolist()  # type: ignore[no-any-return]


def engine_for(model: Any, spec: dict[str, Any], mode: str) -> Any:
    """A fresh engine: the tier of `mode` ("disk*", "redis") under this run's names, or no connector."""
    from pagedkv.engine import LLMEngine
    from pagedkv.params.connector import KVConnectorConfig

    pages = -(-(spec["prompt_len"] + spec["new_tokens"]) // 16) * 2
    kwargs: dict[str, Any] = {}
    if mode != "recompute":
        config = KVConnectorConfig(
            model_id="pagedkv-bench-tiers", disk_offload_dir=spec["dir"], redis_url=spec.get("redis_url"),
            redis_key_prefix=spec["redis_prefix"],
        )  # fmt: skip
        kwargs = dict(kv_connector="redis" if mode == "redis" else "tiered", host_kvcache_swap_space_gb=1.0,
                      total_num_host_pages=pages, kv_connector_config=config)  # fmt: skip
    return LLMEngine.from_hf(model, page_size=16, num_pages=pages, max_batch_size=1,
                             max_num_batched_tokens=spec["prompt_len"] + 16, **kwargs)  # fmt: skip


def serve(engine: Any, spec: dict[str, Any]) -> dict[str, Any]:
    """Serve every prompt alone, in order; TTFTs, outputs and prompt tokens read from the tier."""
    ttfts, outputs, cached = [], [], []
    for prompt in prompts(spec):
        request = engine.add_request(prompt, spec["new_tokens"])
        engine.run()
        ttfts.append(request.ttft)
        outputs.append(request.output)
        cached.append(request.cached_tokens)
    stats = engine.manager.tier_stats()
    load = stats["host"]["load_latency"][1] if "host" in stats else 0.0  # whole `KVConnector.load` calls
    return {"ttft": ttfts, "outputs": outputs, "cached": cached, "load_seconds": load,
            "pages_loaded": {name: s["pages_loaded"] for name, s in stats.items()}}  # fmt: skip


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    """One process's part: ``spec["step"]`` is "fill" or "measure"."""
    import torch

    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    model = build_model(spec)
    tiers = ["disk"] + (["redis"] if spec.get("redis_url") else [])
    if spec["step"] == "fill":
        out: dict[str, Any] = {}
        for mode in tiers:
            engine = engine_for(model, spec, mode)
            out[mode] = serve(engine, spec)
            engine.manager.sync_tiers()
            engine.manager.close()
        return out
    from pagedkv.bench.tiers_cases import drop_page_cache

    modes = [m for m in MODES if m != "redis" or "redis" in tiers]
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    serve(engine_for(model, spec, "recompute"), {**spec, "num_prompts": 1})  # warm up torch, untimed
    for rep in range(spec["repeats"]):
        for mode in modes if rep % 2 == 0 else modes[::-1]:
            if mode == "disk_cold":
                drop_page_cache(sorted(Path(spec["dir"]).glob("*/*/*.page")))
            engine = engine_for(model, spec, mode)
            runs[mode].append(serve(engine, spec))
            engine.manager.close()
    if "redis" in modes:  # delete this run's Redis pages
        engine = engine_for(model, spec, "redis")
        engine.manager.reset_prefix_cache()
        engine.manager.close()
    return runs


def _call(spec: dict[str, Any]) -> Any:
    """Run `worker(spec)` in a fresh Python process; its JSON report."""
    proc = subprocess.run(
        [sys.executable, "-m", "pagedkv.bench.tiers_ttft"],
        input=json.dumps(spec),
        capture_output=True,
        text=True,
        check=False,
    )  # fmt: skip (stdin: no URL in `ps`)
    if proc.returncode != 0:
        raise RuntimeError(f"tiers TTFT worker ({spec['step']}) failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_ttft(
    directory: Path, redis_url: str | None, num_prompts: int = 4, prompt_len: int = 1024, new_tokens: int = 8,
    repeats: int = 3, hidden: int = 512, layers: int = 8, heads: int = 8, vocab: int = 1024, seed: int = 0,
    threads: int = 0,
) -> dict[str, Any]:  # fmt: skip
    """Fill the tiers in one process, measure TTFT warm vs recompute in another; the figures."""
    directory.mkdir(parents=True, exist_ok=True)
    spec = dict(dir=str(directory), redis_url=redis_url, redis_prefix=f"pagedkv-bench-ttft-{os.urandom(4).hex()}:",
                num_prompts=num_prompts, prompt_len=prompt_len, new_tokens=new_tokens, repeats=repeats, hidden=hidden,
                layers=layers, heads=heads, vocab=vocab, seed=seed, threads=threads)  # fmt: skip
    fill = worker({**spec, "step": "fill"})  # this process: the engines that fill the tiers
    runs = _call({**spec, "step": "measure"})  # a fresh process: nothing of them in its memory
    expected = fill["disk"]["outputs"]
    result: dict[str, Any] = {"model": {k: spec[k] for k in ("hidden", "layers", "heads", "vocab")},
                              "num_prompts": num_prompts, "prompt_len": prompt_len, "new_tokens": new_tokens,
                              "repeats": repeats, "modes": {}}  # fmt: skip
    kv_bytes = 2 * layers * heads * (hidden // heads) * 4 * prompt_len
    result["kv_mib_per_prompt"] = kv_bytes / 2**20
    for mode, reps in runs.items():
        means = [statistics.mean(r["ttft"]) for r in reps]
        best = min(range(len(reps)), key=means.__getitem__)
        result["modes"][mode] = {
            "label": LABELS[mode], "ttft_mean_best": means[best], "ttft_mean_median": statistics.median(means),
            "ttft_means": means, "load_mean": reps[best]["load_seconds"] / num_prompts, "cached_tokens": reps[0]["cached"], "pages_loaded": reps[0]["pages_loaded"],
            "same_outputs": all(r["outputs"] == expected for r in reps),
        }  # fmt: skip
    result["fill_same_outputs"] = all(f["outputs"] == expected for f in fill.values())
    base = result["modes"]["recompute"]["ttft_mean_best"]
    for figures in result["modes"].values():
        figures["speedup_vs_recompute"] = base / figures["ttft_mean_best"]
    return result


def format_ttft_report(r: dict[str, Any]) -> str:
    """A markdown table of the TTFT figures."""
    m = r["model"]
    lines = [
        f"Time to first token, fresh engine, {r['num_prompts']} prompts of {r['prompt_len']} tokens served one at a "
        f"time (Llama-style, hidden {m['hidden']}, {m['layers']} layers, {m['heads']} KV heads, fp32; "
        f"{r['kv_mib_per_prompt']:.0f} MiB of KV per prompt); mean over prompts, best of {r['repeats']} alternated "
        "runs",
        "",
        "| engine | TTFT mean, ms | of which tier load, ms | median run, ms | vs recompute | prompt tokens from the "
        "tier | same tokens |",
        "|---|---|---|---|---|---|---|",
    ]
    for f in r["modes"].values():
        lines.append(
            f"| {f['label']} | {1e3 * f['ttft_mean_best']:.1f} | {1e3 * f['load_mean']:.1f} | "
            f"{1e3 * f['ttft_mean_median']:.1f} | "
            f"{_speedup(f['speedup_vs_recompute'])} | {sum(f['cached_tokens'])} of {r['num_prompts'] * r['prompt_len']} "
            f"| {f['same_outputs']} |"
        )
    return "\n".join(lines)


def _speedup(x: float) -> str:
    return "1 (baseline)" if x == 1.0 else f"{x:.1f}x faster" if x > 1 else f"{1 / x:.1f}x slower"


if __name__ == "__main__":
    print(json.dumps(worker(json.loads(sys.stdin.read()))))
