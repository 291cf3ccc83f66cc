"""`python -m benchmarks.soak`: a long run of the engine over every tier, with resident memory sampled.

Two `LLMEngine`s share one tiny seeded Llama (fp32): ``kv_connector="tiered"`` (host + a disk directory
small enough for its LRU to delete files) and ``"redis"`` (host + a `redis-server` it starts, or `redis_url`).
Small pools make eviction, offload, tier loads and swap preemption happen. Seeded requests over prompts
sharing prefixes run in waves, alternating engines. Every token is checked against transformers' greedy
tokens; prompts with a near tie (top-2 logit gap < `tie_margin`) are redrawn, so a mismatch means wrong KV.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pagedkv.bench import report

__all__ = ["add_arguments", "command", "format_soak_report", "plots", "run_soak"]

Progress = Callable[[int, int], None]
Handles = tuple[set[int], set[threading.Thread]]
MODEL: dict[str, Any] = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                             initializer_range=0.1)  # fmt: skip


def process_figures() -> tuple[dict[str, int], Handles]:
    """VmRSS (kB, /proc/self/status), fd and thread counts; the open fd numbers and live threads."""
    with open("/proc/self/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    fds, threads = {int(fd) for fd in os.listdir("/proc/self/fd")}, set(threading.enumerate())
    return {"rss_kib": rss, "fds": len(fds), "threads": len(threads)}, (fds, threads)


def greedy_reference(model: Any, prompt: list[int], new_tokens: int) -> tuple[list[int], float]:
    """transformers' greedy tokens for `prompt` (its own cache) and the smallest top-2 logit gap on the way."""
    import torch

    tokens, margin = list[int](), float("inf")
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([prompt]), use_cache=True)
        for step in range(new_tokens):
            top = out.logits[0, -1].float().topk(2)  # of [V]
            margin = min(margin, float(top.values[0] - top.values[1]))
            tokens.append(int(top.indices[0]))
            if step + 1 < new_tokens:
                out = model(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens, margin


def prompt_pool(model: Any, knobs: dict[str, Any]) -> tuple[list[list[int]], list[list[int]], int]:
    """Seeded prompts of ``knobs["lengths"]`` tokens (inclusive) over ``num_prefixes`` shared prefixes,
    their reference tokens, and how many drawn prompts were redrawn for a near tie."""
    import numpy as np

    rng = np.random.default_rng(knobs["seed"])
    vocab, (lo, hi), groups = model.config.vocab_size, knobs["lengths"], knobs["num_prefixes"]
    prefixes = [rng.integers(3, vocab, int(rng.integers(lo // 2, hi // 2 + 1))).tolist() for _ in range(groups)]
    prompts, refs, redrawn = list[list[int]](), list[list[int]](), 0
    while len(prompts) < knobs["num_prompts"]:
        prefix = prefixes[len(prompts) % groups]
        total = int(rng.integers(max(lo, len(prefix) + 1), hi + 1))
        prompt = [*prefix, *rng.integers(3, vocab, total - len(prefix)).tolist()]
        tokens, margin = greedy_reference(model, prompt, knobs["new_tokens"][1])
        if margin < knobs["tie_margin"]:
            redrawn += 1
            continue
        prompts.append(prompt)
        refs.append(tokens)
    return prompts, refs, redrawn


def build_engines(model: Any, directory: Path, redis_url: str, knobs: dict[str, Any]) -> dict[str, Any]:
    """The "tiered" (host + disk) and "redis" (host + Redis) engines over `model`, sized by `knobs`."""
    from pagedkv.engine import LLMEngine
    from pagedkv.offload.format import HEADER_SIZE
    from pagedkv.params.connector import KVConnectorConfig

    cfg, k = model.config, knobs
    row = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.hidden_size // cfg.num_attention_heads
    file_bytes = HEADER_SIZE + row * 4 * k["page_size"]  # fp32 K and V of every layer, one file per page
    config = KVConnectorConfig(model_id="pagedkv-soak", disk_offload_dir=str(directory), redis_url=redis_url,
                               disk_offload_max_gb=k["disk_pages"] * file_bytes / 2**30, io_threads=k["io_threads"],
                               redis_key_prefix=f"pagedkv-soak-{os.getpid()}-{os.urandom(4).hex()}:")  # fmt: skip
    common: dict[str, Any] = dict(page_size=k["page_size"], num_pages=k["device_pages"], kv_connector_config=config,
                                  max_batch_size=k["max_batch_size"], max_num_batched_tokens=k["token_budget"],
                                  total_num_host_pages=k["host_pages"], host_kvcache_swap_space_gb=0.01)  # fmt: skip
    return {name: LLMEngine.from_hf(model, kv_connector=name, **common) for name in ("tiered", "redis")}


def sample(engines: dict[str, Any], served: int, seconds: float) -> tuple[dict[str, Any], Handles]:
    """One sample after a drain (tier writes flushed, `gc.collect()`): memory, fds, threads, pages in use,
    host rows lent to swaps, `check_integrity()` (None or the error); and the fds and threads."""
    for engine in engines.values():
        engine.manager.sync_tiers()  # no disk file is open mid-write while fds are counted
    gc.collect()
    figures, held = process_figures()
    row: dict[str, Any] = dict(requests=served, seconds=round(seconds, 3), **figures, pages_in_use=0, rows_lent=0,
                               integrity=None)  # fmt: skip
    for name, engine in engines.items():
        manager = engine.manager
        row["pages_in_use"] += manager.get_num_used_pages()
        row["rows_lent"] += sum(s.rows_lent for s in manager.tiers.swap_spaces)
        try:
            manager.check_integrity()
        except Exception as exc:  # noqa: BLE001 - a verdict, never raised
            row["integrity"] = f"{name}: {type(exc).__name__}: {exc}"
    row["disk_pages"] = engines["tiered"].manager.get_num_used_disk_pages()  # stays at the disk cap
    return row, held


def run_soak(
    requests: int = 20000, *, wave: int = 128, num_prompts: int = 256, num_prefixes: int = 12,
    lengths: tuple[int, int] = (20, 80), new_tokens: tuple[int, int] = (2, 6), page_size: int = 8,
    device_pages: int = 48, host_pages: int = 32, disk_pages: int = 512, max_batch_size: int = 16,
    token_budget: int = 256, io_threads: int = 2, warmup_fraction: float = 0.1, sample_every: int = 0,
    rss_bound_mib: float = 4.0, tie_margin: float = 1e-3, seed: int = 0, directory: str | None = None,
    redis_url: str | None = None, progress: Progress | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Serve `requests` requests through the tiered and redis engines in waves of `wave`, alternating; the
    samples (after drains: VmRSS, fds, threads, pages in use, lent rows, `check_integrity()`), figures and
    verdicts (`checks`, `passed`: see `summarize`); never asserts. Warm-up: ``max(warmup_fraction * requests,
    4 * wave)`` requests. `sample_every` 0: about 50 samples. `redis_url`: that server (under a key prefix of
    this run, deleted at the end) instead of starting one. `directory`: the disk tier's parent directory."""
    knobs = {k: v for k, v in locals().items() if k not in ("requests", "directory", "redis_url", "progress")}
    import numpy as np
    import torch

    from pagedkv.bench.tiers_redis import start_redis
    from pagedkv.testing import build_llama

    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a model this small runs faster on one thread
    model = build_llama(seed, **MODEL)
    t0, (prompts, refs, redrawn) = time.perf_counter(), prompt_pool(model, knobs)  # t0 is taken first
    tally: dict[str, Any] = dict(reference_seconds=time.perf_counter() - t0, redrawn_near_ties=redrawn, served=0,
                                 waves=0, generated=0, wrong_prompts=[],
                                 warmup=min(requests, max(int(requests * warmup_fraction), 4 * wave)))  # fmt: skip
    gc.collect()
    baseline, held = process_figures()
    seen = {"baseline": held}
    tmp = Path(tempfile.mkdtemp(prefix="pagedkv-soak-", dir=directory))
    server = None if redis_url else start_redis()
    engines: dict[str, Any] = {}
    samples: list[dict[str, Any]] = []
    rng, every = np.random.default_rng(seed + 1), sample_every or max(wave, requests // 50)
    try:
        engines = build_engines(model, tmp, redis_url or server.url, knobs)  # type: ignore[union-attr]
        start = time.perf_counter()
        while (served := tally["served"]) < requests:
            count = min(wave, requests - served)
            picks, news = rng.integers(0, len(prompts), count), rng.integers(new_tokens[0], new_tokens[1] + 1, count)
            engine = engines["tiered" if tally["waves"] % 2 == 0 else "redis"]
            batch = [(int(i), engine.add_request(prompts[i], int(n))) for i, n in zip(picks, news, strict=True)]
            engine.run()
            for i, request in batch:  # every wrong or missing token counts, under its prompt's index
                out, ref = request.output, refs[i][: request.max_new_tokens]
                tally["generated"] += len(out)
                bad = sum(a != b for a, b in zip(out, ref, strict=False)) + abs(len(ref) - len(out))
                tally["wrong_prompts"] += [i] * bad
            now, crossed = served + count, served < tally["warmup"] <= served + count
            tally.update(served=now, waves=tally["waves"] + 1)
            if now // every > served // every or now == requests or crossed:
                row, held = sample(engines, now, time.perf_counter() - start)
                samples.append(row)
                seen.update({"warmup": held} if crossed else {}, end=held)
                if progress:
                    progress(now, requests)
        tally["wall"] = time.perf_counter() - start
        summaries = {name: e.summary for name, e in engines.items()}
        tiers = {f"{e}.{t}": {k: v for k, v in s.items() if isinstance(v, int)}  # the counters
                 for e, engine in engines.items() for t, s in engine.manager.tier_stats().items()}  # fmt: skip
    finally:
        for engine in engines.values():
            if redis_url and engine.manager.params.kv_connector.value == "redis":
                engine.manager.reset_prefix_cache()  # this run's pages off a server others may use
            engine.manager.close()
        engines.clear()
        if server is not None:
            server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
        torch.set_num_threads(torch_threads)
    gc.collect()
    after, seen["after"] = process_figures()
    return summarize(knobs, tally, samples, {"baseline": baseline, "after_shutdown": after}, seen, summaries, tiers)


def summarize(knobs: dict[str, Any], tally: dict[str, Any], samples: list[dict[str, Any]], marks: dict[str, Any],
              seen: dict[str, Handles], engines: dict[str, dict[str, Any]], tiers: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    """The figures and verdicts of a soak. The bound: after warm-up RSS grows at most `rss_bound_mib` (end and
    peak), and no thread starts; fds and threads stay within the pools' caps (opened on demand, so the count
    may rise late, but never past the cap); after shutdown no fd or thread the soak opened is left."""
    warm = next(s for s in samples if s["requests"] >= tally["warmup"])
    end, later = samples[-1], [s for s in samples if s["requests"] >= warm["requests"]]
    rss_max = max(s["rss_kib"] for s in later)
    growth, peak = (end["rss_kib"] - warm["rss_kib"]) / 1024, (rss_max - warm["rss_kib"]) / 1024
    prompt_tokens, cached, swaps = (sum(e[k] for e in engines.values()) for k in ("prompt_tokens", "prompt_tokens_cached", "swaps"))  # fmt: skip
    base = marks["baseline"]
    io = knobs["io_threads"]
    # threads: each engine's offload thread and I/O pool, and the disk tier's readers; fds: Redis connections (I/O
    # threads + the loading one) and the disk tier's page journal
    caps = {"threads": base["threads"] + len(engines) * (1 + io) + io, "fds": base["fds"] + io + 1 + 1}
    new_threads = [t.name for t in seen["end"][1] - seen["warmup"][1]]
    left_fds = sorted(seen["after"][0] - seen["baseline"][0])
    left_threads = [t.name for t in seen["after"][1] - seen["baseline"][1]]
    disk, redis, bound = tiers["tiered.disk"], tiers["redis.redis"], knobs["rss_bound_mib"]
    checks = {
        "wrong tokens == 0": not tally["wrong_prompts"],
        f"RSS growth after warm-up (end and peak) <= {bound:g} MiB": max(growth, peak) <= bound,
        "device pages in use after every drain == 0": all(s["pages_in_use"] == 0 for s in samples),
        "host rows lent to swaps after every drain == 0": all(s["rows_lent"] == 0 for s in samples),
        "check_integrity() at every sample": all(s["integrity"] is None for s in samples),
        "no thread started after warm-up": not new_threads,
        f"fds <= {caps['fds']} and threads <= {caps['threads']} (the pools' caps) at every sample":
            all(s["fds"] <= caps["fds"] and s["threads"] <= caps["threads"] for s in samples),
        "no fd or thread of the soak left after shutdown": not left_fds and not left_threads,
        "no tier error, refused page or skipped write": all(not (t["errors"] or t["refused"] or t["skipped_writes"])
                                                            for t in tiers.values()),
        "pages loaded from disk and from Redis, disk LRU deletions, swaps: all > 0":
            min(disk["pages_loaded"], redis["pages_loaded"], disk["evictions"], swaps) > 0,
    }  # fmt: skip
    wall, after_warmup = tally["wall"], end["requests"] - warm["requests"]
    return {
        "requests": tally["served"], "waves": tally["waves"], "wall_seconds": wall,
        "requests_per_second": tally["served"] / wall, "generated_tokens": tally["generated"],
        "wrong_tokens": len(tally["wrong_prompts"]), "wrong_prompts": sorted(set(tally["wrong_prompts"])),
        "distinct_prompts": knobs["num_prompts"], "redrawn_near_ties": tally["redrawn_near_ties"],
        "reference_seconds": tally["reference_seconds"], "model": MODEL, "config": knobs,
        "warmup_requests": warm["requests"], "rss_start_mib": warm["rss_kib"] / 1024,
        "rss_end_mib": end["rss_kib"] / 1024, "rss_max_mib": rss_max / 1024, "rss_growth_mib": growth,
        "rss_peak_growth_mib": peak, "rss_growth_bytes_per_request": growth * 2**20 / max(1, after_warmup),
        "rss_before_engines_mib": base["rss_kib"] / 1024, **marks,
        "at_warmup": {k: warm[k] for k in base}, "at_end": {k: end[k] for k in base}, "caps": caps,
        "threads_started_after_warmup": new_threads, "left_after_shutdown": {"fds": left_fds, "threads": left_threads},
        "pages_in_use_after_drain": max(s["pages_in_use"] for s in samples),
        "prompt_tokens": prompt_tokens, "prompt_tokens_cached": cached, "prefix_hit_rate": cached / prompt_tokens,
        "preemptions": sum(s["preemptions"] for s in engines.values()), "swaps": swaps, "engines": engines,
        "tiers": tiers, "samples": samples, "checks": checks, "passed": all(checks.values()),
    }  # fmt: skip


def format_soak_report(r: dict[str, Any]) -> str:
    """The soak's figures and verdicts as markdown."""
    m, c = r["model"], r["config"]
    marks = ("baseline", "at_warmup", "at_end", "after_shutdown")
    lines = [
        f"Soak: {r['requests']} requests in {r['waves']} waves of {c['wave']}, alternating a tiered (host "
        f"{c['host_pages']} + disk {c['disk_pages']} pages) and a redis (host {c['host_pages']} + Redis) engine, "
        f"{c['device_pages']} device pages of {c['page_size']} tokens; Llama {m['num_hidden_layers']} layers, hidden "
        f"{m['hidden_size']}, fp32; {r['distinct_prompts']} prompts of {c['lengths'][0]}-{c['lengths'][1]} tokens, "
        f"{c['num_prefixes']} prefixes, {c['new_tokens'][0]}-{c['new_tokens'][1]} new tokens",
        "", "| figure | value |", "|---|---|",
        f"| wall time, requests/s | {r['wall_seconds']:.1f} s, {r['requests_per_second']:.1f} |",
        f"| tokens generated, wrong | {r['generated_tokens']}, **{r['wrong_tokens']}** |",
        f"| RSS before engines / after warm-up ({r['warmup_requests']} requests) / end / max, MiB | "
        f"{r['rss_before_engines_mib']:.1f} / {r['rss_start_mib']:.1f} / {r['rss_end_mib']:.1f} / {r['rss_max_mib']:.1f} |",
        f"| RSS growth after warm-up, end / peak | {r['rss_growth_mib']:+.2f} / {r['rss_peak_growth_mib']:+.2f} MiB "
        f"({r['rss_growth_bytes_per_request']:.0f} B per request) |",
        f"| fds before / warm-up / end / after shutdown | {' / '.join(str(r[k]['fds']) for k in marks)} |",
        f"| threads before / warm-up / end / after shutdown | {' / '.join(str(r[k]['threads']) for k in marks)} |",
        f"| device pages in use after drains (max) | {r['pages_in_use_after_drain']} |",
        f"| prefix hit rate (prompt tokens) | {r['prefix_hit_rate']:.3f} ({r['prompt_tokens_cached']} of {r['prompt_tokens']}) |",
        f"| preemptions, of which swaps | {r['preemptions']}, {r['swaps']} |",
        *(f"| {name}: pages stored / loaded (of lookups) / evicted | {s['pages_stored']} / {s['pages_loaded']} "
          f"({s['lookups']}) / {s['evictions']} |" for name, s in r["tiers"].items()),
        "", "| check | verdict |", "|---|---|",
        *(f"| {name} | {'pass' if ok else '**FAIL**'} |" for name, ok in r["checks"].items()),
    ]  # fmt: skip
    return "\n".join(lines)


def plots(r: dict[str, Any]) -> list[report.Plot]:
    """Resident memory, and open fds and threads, at every sample."""
    xs = [s["requests"] for s in r["samples"]]
    return [
        report.Plot("soak_rss", "resident memory after each drain", "VmRSS, MiB", xs,
                    {"RSS": [s["rss_kib"] / 1024 for s in r["samples"]]}, kind="line", xlabel="requests served"),
        report.Plot("soak_handles", "open file descriptors and threads after each drain", "count", xs,
                    {"fds": [s["fds"] for s in r["samples"]], "threads": [s["threads"] for s in r["samples"]]},
                    kind="line", xlabel="requests served"),
    ]  # fmt: skip


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `python -m benchmarks.soak`."""
    p.add_argument("--requests", type=int, default=20000, help="requests served in all")
    p.add_argument("--wave", type=int, default=128, help="requests fed at once, alternating engines")
    p.add_argument("--prompts", type=int, default=256, help="distinct prompts the requests are drawn from")
    p.add_argument("--rss-bound-mib", type=float, default=4.0, help="RSS growth allowed after warm-up")
    p.add_argument("--seed", type=int, default=0, help="seed of the model, the prompts and the requests")
    p.add_argument("--dir", help="parent of the disk tier's temporary directory (default: the system's temp dir)")
    p.add_argument("--redis-url", help="use this Redis server instead of starting redis-server")


def command(args: argparse.Namespace) -> int:
    """`python -m benchmarks.soak`: run, print the report, write --json / --plots; 0 when every check passed, else 1."""
    with report.Progress("requests") as progress:
        result = run_soak(args.requests, wave=args.wave, num_prompts=args.prompts, rss_bound_mib=args.rss_bound_mib,
                          seed=args.seed, directory=args.dir, redis_url=args.redis_url, progress=progress)  # fmt: skip
    report.finish(args, format_soak_report(result), result, plots)
    return 0 if result["passed"] else 1


if __name__ == "__main__":  # python -m benchmarks.soak
    import sys

    from benchmarks.command import main

    sys.exit(main("benchmarks.soak", sys.modules[__name__]))
