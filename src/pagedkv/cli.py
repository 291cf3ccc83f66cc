"""The `pagedkv` command: `pagedkv demo` and `pagedkv bench {manager,attention,triton,fp8,engine,hybrid,tiers,
compare,soak,faults}`."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pagedkv.bench.faults import add_faults_parser
from pagedkv.bench.soak import add_soak_parser

__all__ = ["main"]


POLICY_NAMES = ("pagedkv-lru-step", "pagedkv-lru", "pagedkv-slru", "pagedkv-lfu", "pagedkv-arc",
                "pagedkv-lru-leaves", "pagedkv-arc-partial")  # fmt: skip


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedkv", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="serve shared-prefix requests with a small model; check against transformers")
    demo.add_argument("--requests", type=int, default=48)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--manager-only", action="store_true", help="the bookkeeping demo (no model)")
    demo.add_argument("--model", help="a local transformers checkpoint directory (Llama, Qwen2, Qwen3)")
    demo.add_argument("--connector", choices=["tiered", "redis"],
                      help="the tier demo: fill a tier in one process, start cold on device and warm from it in "
                           "another, compare time to first token with recompute")  # fmt: skip
    demo.add_argument("--redis-url", help="Redis server for --connector redis (redis://host:port/db)")
    demo.add_argument("--dir", help="disk tier directory for --connector tiered (default: a temporary one)")
    bench = sub.add_parser("bench", help="benchmarks")
    kinds = bench.add_subparsers(dest="bench", required=True)
    mgr = kinds.add_parser("manager", help="bookkeeping cost of PagedKVCacheManager on a shared-prefix chat trace")
    mgr.add_argument("--requests", type=int, default=2000)
    mgr.add_argument("--groups", type=int, default=16)
    mgr.add_argument("--prefix-len", type=int, default=1024)
    mgr.add_argument("--suffix-len", type=int, default=256)
    mgr.add_argument("--decode-steps", type=int, default=128)
    mgr.add_argument("--max-batch-size", type=int, default=64)
    mgr.add_argument("--budget-gib", type=float, default=16.0)
    mgr.add_argument("--pool-pages", type=int, default=1_000_000, help="pool size for the construction figure")
    mgr.add_argument("--seed", type=int, default=0)
    mgr.add_argument("--repeats", type=int, default=3, help="replays; per-call figures are the best of them")
    mgr.add_argument("--json", type=Path, help="also write the figures to this JSON file")
    att = kinds.add_parser("attention", help="paged decode attention vs contiguous SDPA (CPU; GPU rows with CUDA)")
    att.add_argument("--batch", type=int, default=32)
    att.add_argument("--context", type=int, default=2048)
    att.add_argument("--repeats", type=int, default=10)
    att.add_argument("--json", type=Path, help="also write the figures to this JSON file")
    tri = kinds.add_parser("triton", help="Triton paged decode bandwidth vs a device copy (CUDA only)")
    tri.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float8_e4m3fn"])
    tri.add_argument("--json", type=Path, help="also write the figures to this JSON file")
    fp8 = kinds.add_parser("fp8", help="logit error of bf16/FP8 caches against fp32 and bf16 (demo model)")
    fp8.add_argument("--requests", type=int, default=16)
    fp8.add_argument("--steps", type=int, default=16)
    fp8.add_argument("--json", type=Path, help="also write the figures to this JSON file")
    eng = kinds.add_parser("engine", help="prefill skipped and TTFT with prefix caching on vs off (demo workload)")
    eng.add_argument("--requests", type=int, default=48)
    eng.add_argument("--repeats", type=int, default=3)
    eng.add_argument("--seed", type=int, default=0)
    eng.add_argument("--json", type=Path, help="also write the figures to this JSON file")
    hyb = kinds.add_parser("hybrid", help="KV bytes, prefix hit rate and decode cost of mixed-attention models")
    hyb.add_argument("--requests", type=int, default=2000, help="requests of the zipf hit-rate trace")
    hyb.add_argument("--seed", type=int, default=0)
    hyb.add_argument("--repeats", type=int, default=5, help="alternated decode runs; the best of each is kept")
    hyb.add_argument("--json", type=Path, help="also write the figures to this JSON file")
    tie = kinds.add_parser("tiers", help="tier offload / load throughput vs the raw medium; TTFT from a warm tier")
    tie.add_argument("--shapes", default="llama3-8b,llama3.2-1b", help="page shapes (llama3-8b: 2 MiB, llama3.2-1b)")
    tie.add_argument("--tiers", default="host,disk,redis", help="which tiers to measure (comma-separated)")
    tie.add_argument("--mib", type=int, default=256, help="MiB of pages moved per pass, per shape")
    tie.add_argument("--batch", type=int, default=64, help="pages per offload / load call")
    tie.add_argument("--repeats", type=int, default=5, help="alternated runs; the best of each side is kept")
    tie.add_argument("--io-threads", type=int, default=4, help="disk / Redis tier threads (KVConnectorConfig)")
    tie.add_argument("--dir", help="directory for the disk files (default: the system's temp directory)")
    tie.add_argument("--redis-url", help="use this Redis server instead of starting redis-server")
    tie.add_argument("--no-cold", action="store_true", help="skip the disk reads after dropping the page cache")
    tie.add_argument("--no-ttft", action="store_true", help="skip the time-to-first-token part")
    tie.add_argument("--ttft-prompts", type=int, default=4)
    tie.add_argument("--ttft-prompt-len", type=int, default=1024)
    tie.add_argument("--ttft-repeats", type=int, default=3)
    tie.add_argument("--ttft-hidden", type=int, default=512, help="hidden size of the TTFT model")
    tie.add_argument("--ttft-layers", type=int, default=8)
    tie.add_argument("--json", type=Path, help="also write the figures to this JSON file")
    cmp = kinds.add_parser("compare", help="pagedkv vs vLLM and SGLang cache managers and the Belady bound, "
                                           "on five workloads over a capacity sweep")  # fmt: skip
    cmp.add_argument("--workloads", default="zipf,multiturn,fewshot,docqa,nosharing")
    cmp.add_argument("--requests", type=int, default=1000, help="requests per workload")
    cmp.add_argument("--fractions", default="0.1,0.2,0.4,1.0",
                     help="capacities, as fractions of the pages an unbounded cache would hold")  # fmt: skip
    cmp.add_argument("--peers", default="vllm,sglang", help="peer managers to load ('' for none)")
    cmp.add_argument("--policies", default=",".join(POLICY_NAMES), help="pagedkv configurations (bench/compare/run.py)")
    cmp.add_argument("--no-belady", action="store_true")
    cmp.add_argument("--seed", type=int, default=0)
    cmp.add_argument("--json", type=Path, help="write every row to this JSON file")
    cmp.add_argument("--markdown", type=Path, help="write the tables to this markdown file")
    cmp.add_argument("--plots", type=Path, help="write PNG plots into this directory")
    cmp.add_argument("--from-json", type=Path, help="render the tables and plots of an earlier --json run")
    add_soak_parser(kinds)
    add_faults_parser(kinds)
    return parser


def _compare(args: argparse.Namespace) -> int:
    from pagedkv.bench.compare.report import format_markdown, write_plots
    from pagedkv.bench.compare.run import run_compare

    def progress(done: int, total: int, line: str) -> None:
        bar = "#" * (30 * done // total)
        sys.stderr.write(f"\r\x1b[K[{bar:.<30}] {done}/{total} {line}")
        sys.stderr.flush()

    if args.from_json:
        result = json.loads(args.from_json.read_text())
    else:
        result = run_compare(
            workloads=[w for w in args.workloads.split(",") if w], num_requests=args.requests,
            fractions=[float(f) for f in args.fractions.split(",") if f],
            peers=[p for p in args.peers.split(",") if p], policies=[p for p in args.policies.split(",") if p],
            belady=not args.no_belady, seed=args.seed, progress=progress,
        )  # fmt: skip
        sys.stderr.write("\n")
    text = format_markdown(result)
    print(text)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    if args.markdown:
        args.markdown.write_text(text)
    if args.plots:
        for path in write_plots(result, args.plots):
            print(f"wrote {path}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `pagedkv` console script."""
    args = _parser().parse_args(argv)
    if args.command == "demo" and args.connector:
        from pagedkv.tier_demo import run_tier_demo

        try:
            result = run_tier_demo(args.connector, directory=args.dir, redis_url=args.redis_url, seed=args.seed)
        except ValueError as exc:
            print(f"pagedkv demo: {exc}", file=sys.stderr)
            return 2
        return 0 if result["identical"] == result["requests"] else 1
    if args.command == "demo":
        from pagedkv.demo import run_demo

        return run_demo(args.requests, args.seed, manager_only=args.manager_only, model_path=args.model)
    if args.bench == "compare":
        return _compare(args)
    if args.bench == "faults":
        from pagedkv.bench.faults import run_faults_command

        return run_faults_command(args)
    if args.bench == "soak":
        from pagedkv.bench.soak import soak_command

        return soak_command(args)
    if args.bench == "attention":
        from pagedkv.bench.attention_bench import format_attention_report, run_attention_bench

        result = run_attention_bench(batch=args.batch, context=args.context, repeats=args.repeats)
        return _report(format_attention_report(result), result, args.json)
    if args.bench == "triton":
        from pagedkv.bench.triton_bench import format_report as format_triton_report
        from pagedkv.bench.triton_bench import run_triton_bench

        try:
            result = run_triton_bench(dtype=args.dtype)
        except RuntimeError as exc:  # no CUDA GPU (or no usable kernel) here
            print(f"pagedkv bench triton: {exc}", file=sys.stderr)
            return 2
        return _report(format_triton_report(result), result, args.json)
    if args.bench == "fp8":
        import torch

        from pagedkv.bench.fp8_bench import format_fp8_report, run_fp8_bench

        torch.set_num_threads(1)
        result = run_fp8_bench(num_requests=args.requests, new_tokens=args.steps)
        return _report(format_fp8_report(result), result, args.json)
    if args.bench == "hybrid":
        from pagedkv.bench.hybrid_bench import format_hybrid_report, run_hybrid_bench

        result = run_hybrid_bench(num_requests=args.requests, seed=args.seed, repeats=args.repeats)
        return _report(format_hybrid_report(result), result, args.json)
    if args.bench == "tiers":
        from pagedkv.bench.tiers_bench import format_tiers_report, run_tiers_bench

        ttft_options = dict(num_prompts=args.ttft_prompts, prompt_len=args.ttft_prompt_len,
                            repeats=args.ttft_repeats, hidden=args.ttft_hidden, layers=args.ttft_layers)  # fmt: skip
        result = run_tiers_bench(
            shapes=tuple(args.shapes.split(",")), mib=args.mib, batch=args.batch, repeats=args.repeats,
            tiers=tuple(args.tiers.split(",")), directory=args.dir, redis_url=args.redis_url, cold=not args.no_cold,
            io_threads=args.io_threads, ttft=not args.no_ttft, ttft_options=ttft_options,
        )  # fmt: skip
        return _report(format_tiers_report(result), result, args.json)
    if args.bench == "engine":
        import torch

        from pagedkv.bench.engine_bench import format_engine_report, run_engine_bench

        torch.set_num_threads(1)  # the demo model is tiny: one thread is faster and steadier
        result = run_engine_bench(num_requests=args.requests, repeats=args.repeats, seed=args.seed)
        return _report(format_engine_report(result), result, args.json)
    from pagedkv.bench.manager_bench import format_report, print_progress, run_manager_bench

    result = run_manager_bench(
        num_requests=args.requests, num_groups=args.groups, prefix_len=args.prefix_len, suffix_len=args.suffix_len,
        decode_steps=args.decode_steps, max_batch_size=args.max_batch_size, budget_gib=args.budget_gib,
        pool_pages=args.pool_pages, seed=args.seed, repeats=args.repeats, progress=print_progress,
    )  # fmt: skip
    return _report(format_report(result), result, args.json)


def _report(text: str, result: dict[str, Any], path: Path | None) -> int:
    print(text)
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
