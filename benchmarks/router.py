"""`python -m benchmarks.router`: KV-aware routing vs round-robin vs random over pagedkv engines in child processes.

Four engines (`pagedkv engine`: a random-weight Llama, 2 layers, hidden 64, vocabulary 32000, each
process on one torch thread) publish their KV events; an in-process `PrefixIndex` + `Router` routes
the zipf and multiturn traces of `benchmarks.compare` (`pagedkv.workloads.traces`) to them over HTTP with
`--clients` concurrent clients (a multiturn turn waits for the previous turn of its conversation).
Every policy runs the same trace on the same engines, their caches reset in between. Per policy:
fleet prefix hit rate (cached prompt tokens the engines reported / prompt tokens), mean TTFT
(engine side: arrival to first token), and for the KV-aware policies the share of requests whose
predicted hit equalled the hit the engine reported.

Decision latency: a `Router` over four engines whose index holds `--blocks` blocks each (fed
through `PrefixIndex.ingest`, no sockets), routing zipf prompts: microseconds per decision, hashing
included, for pagedkv's sha256 chain and vLLM's sha256 block hash.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from benchmarks.processes import child_env
from pagedkv.bench import report
from pagedkv.workloads.traces import make_trace

__all__ = ["add_arguments", "command", "decision_latency", "run_policies"]

POLICIES: dict[str, dict[str, Any]] = {  # label -> RouterPolicy fields
    "kv": {"mode": "kv"}, "kv, load_margin=2": {"mode": "kv", "load_margin": 2},
    "round-robin": {"mode": "round-robin"}, "random": {"mode": "random"},
}  # fmt: skip


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `python -m benchmarks.router`."""
    p.add_argument("--engines", type=int, default=4, help="engine processes")
    p.add_argument("--zipf-requests", type=int, default=400, help="requests of the zipf trace")
    p.add_argument("--multiturn-requests", type=int, default=300, help="requests of the multiturn trace (5 turns each)")
    p.add_argument("--num-pages", type=int, default=384, help="device pages per engine (16 tokens each)")
    p.add_argument("--clients", type=int, default=4, help="concurrent clients")
    p.add_argument("--max-tokens", type=int, default=4, help="tokens generated per request")
    p.add_argument("--blocks", type=int, default=10_000, help="cached blocks per engine for the decision latency")
    p.add_argument("--decisions", type=int, default=2000, help="decisions timed")
    p.add_argument("--seed", type=int, default=0, help="trace seed")


def _post(url: str, body: dict[str, Any]) -> Any:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as resp:
        return json.loads(resp.read())


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return json.loads(resp.read())


def _start_engines(n: int, num_pages: int) -> list[tuple[subprocess.Popen[str], dict[str, Any]]]:
    env = child_env()
    procs = [subprocess.Popen([sys.executable, "-m", "pagedkv.router.engine_server", "--name", f"e{i}",
                               "--num-pages", str(num_pages), "--max-len", "2048"],
                              stdout=subprocess.PIPE, text=True, env=env) for i in range(n)]  # fmt: skip
    out = []
    for proc in procs:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError("an engine process did not start")
        out.append((proc, json.loads(line)))
    return out


def _run_trace(router: Any, urls: dict[str, str], trace: list[Any], clients: int, max_tokens: int) -> dict[str, Any]:
    done = {r.rid: threading.Event() for r in trace}
    rows: list[tuple[int, int, float, int]] = []
    lock = threading.Lock()

    def one(req: Any) -> None:
        if req.after is not None:
            done[req.after].wait()
        prompt = req.prompt.tolist()
        d = router.route(prompt)
        try:
            answer = _post(urls[d.engine] + "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens})
        finally:
            done[req.rid].set()
        cached = int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])
        router.finished(d, cached)
        with lock:
            rows.append((len(prompt), cached, float(answer["pagedkv"]["ttft_s"]), d.predicted_tokens))

    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(one, trace))
    wall = time.perf_counter() - start
    prompt = sum(r[0] for r in rows)
    return {"requests": len(rows), "prompt_tokens": prompt, "cached_tokens": sum(r[1] for r in rows),
            "hit_rate": sum(r[1] for r in rows) / prompt, "ttft_mean_ms": 1e3 * float(np.mean([r[2] for r in rows])),
            "ttft_p90_ms": 1e3 * float(np.percentile([r[2] for r in rows], 90)),
            "exact_predictions": sum(r[1] == r[3] for r in rows) / len(rows), "wall_s": wall}  # fmt: skip


def run_policies(engines: int, traces: dict[str, int], num_pages: int, clients: int, max_tokens: int,
                 seed: int) -> dict[str, Any]:  # fmt: skip
    """Every policy on every trace over one fleet of engine processes: {trace: {policy: figures}}."""
    from pagedkv.router import EngineSpec, PagedKVHasher, PrefixIndex, Router, RouterPolicy

    fleet = _start_engines(engines, num_pages)
    hasher = PagedKVHasher(16)
    index = PrefixIndex(
        [EngineSpec(i["name"], i["events"], hasher, i["replay"], i["topic"], i["url"]) for _, i in fleet]
    )
    urls = {i["name"]: i["url"] for _, i in fleet}
    out: dict[str, Any] = {}
    try:
        index.wait_ready()
        for name, n in traces.items():
            trace = make_trace(name, n, seed)
            out[name] = {}
            for policy, fields in POLICIES.items():
                for url in urls.values():
                    _post(url + "/reset", {})
                time.sleep(0.3)  # the clears reach the index
                router = Router(index, RouterPolicy(**fields, seed=seed, stale_after_s=3600))
                for engine in urls:
                    router.report_load(engine, 0)
                out[name][policy] = _run_trace(router, urls, trace, clients, max_tokens)
                print(f"{name} {policy}: {out[name][policy]}", file=sys.stderr, flush=True)
    finally:
        index.close()
        for proc, _ in fleet:
            proc.terminate()
        for proc, _ in fleet:
            proc.wait(10)
    return out


def decision_latency(blocks: int, decisions: int, engines: int = 4, seed: int = 0) -> dict[str, float]:
    """Microseconds per `Router.route` with `blocks` cached blocks per engine, per hasher."""
    import msgspec

    from pagedkv.router import EngineSpec, PagedKVHasher, PrefixIndex, Router, VLLMHasher

    prompts = [r.prompt for r in make_trace("zipf", decisions, seed)]
    out = {}
    for label, hasher in (("pagedkv sha256", PagedKVHasher(16, seed=bytes(32))), ("vLLM sha256", VLLMHasher(16))):
        index = PrefixIndex(
            [EngineSpec(f"e{i}", "tcp://127.0.0.1:1", hasher, topic="kv") for i in range(engines)], start=False
        )
        rng = np.random.default_rng(seed)
        for i in range(engines):  # each engine: the first prompts' blocks, then random ones up to `blocks`
            held = list(dict.fromkeys(h for p in prompts[i::engines][:20] for h in hasher.hashes(p)))[:blocks]
            held += rng.integers(0, 2**63, size=blocks - len(held)).tolist()  # (a collision is 2**-50 likely)
            event = {"type": "BlockStored", "block_hashes": held[:blocks], "parent_block_hash": None,
                     "token_ids": [], "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None}  # fmt: skip
            index.ingest(f"e{i}", [b"kv", (0).to_bytes(8, "big"), msgspec.msgpack.encode([0.0, [event], 0])])
        router = Router(index)
        for i in range(engines):
            router.report_load(f"e{i}", 0)
        for p in prompts[:50]:  # warm up
            router.finished(router.route(p))
        start = time.perf_counter()
        for p in prompts:
            router.finished(router.route(p))
        out[label] = 1e6 * (time.perf_counter() - start) / len(prompts)
        out[f"{label} blocks per engine"] = float(
            sum(index.num_blocks(f"e{i}")["GPU"] for i in range(engines)) / engines
        )
    out["prompt tokens (mean)"] = float(np.mean([len(p) for p in prompts]))
    return out


def format_report(result: dict[str, Any]) -> str:
    """Markdown tables of `result`."""
    rows = []
    for trace, by_policy in result["fleet"].items():
        for policy, f in by_policy.items():
            rows.append([trace, policy, f["requests"], f"{100 * f['hit_rate']:.1f}%", f"{f['ttft_mean_ms']:.1f}",
                         f"{f['ttft_p90_ms']:.1f}", f"{f['wall_s']:.1f}",
                         f"{100 * f['exact_predictions']:.0f}%" if policy.startswith("kv") else "-"])  # fmt: skip
    lines = report.table(["trace", "policy", "requests", "fleet hit rate", "TTFT mean ms", "TTFT p90 ms", "wall s",
                          "exact predictions"], rows)  # fmt: skip
    lat = result["latency"]
    lines += ["", *report.table(["hasher", "cached blocks per engine", "µs per decision"],
                                [[k, f"{lat[k + ' blocks per engine']:.0f}", f"{lat[k]:.0f}"]
                                 for k in ("pagedkv sha256", "vLLM sha256")])]  # fmt: skip
    lines.append(f"\n(decision prompts: zipf, {lat['prompt tokens (mean)']:.0f} tokens on average)")
    return "\n".join(lines)


def command(args: argparse.Namespace) -> int:
    """`python -m benchmarks.router`."""
    traces = {"zipf": args.zipf_requests, "multiturn": args.multiturn_requests}
    result = {
        "fleet": run_policies(args.engines, traces, args.num_pages, args.clients, args.max_tokens, args.seed),
        "latency": decision_latency(args.blocks, args.decisions, args.engines, args.seed),
    }
    report.finish(args, format_report(result), result)
    return 0


if __name__ == "__main__":  # python -m benchmarks.router
    from benchmarks.command import main

    sys.exit(main("benchmarks.router", sys.modules[__name__]))
