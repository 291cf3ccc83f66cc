"""The `pagedkv` command: `pagedkv demo`, `pagedkv bench manager`."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedkv", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="serve a shared-prefix workload through the manager and verify every page")
    demo.add_argument("--requests", type=int, default=240)
    demo.add_argument("--seed", type=int, default=0)
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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `pagedkv` console script."""
    args = _parser().parse_args(argv)
    if args.command == "demo":
        from pagedkv.demo import run_demo

        return run_demo(num_requests=args.requests, seed=args.seed)
    from pagedkv.bench.manager_bench import format_report, print_progress, run_manager_bench

    result = run_manager_bench(
        num_requests=args.requests, num_groups=args.groups, prefix_len=args.prefix_len, suffix_len=args.suffix_len,
        decode_steps=args.decode_steps, max_batch_size=args.max_batch_size, budget_gib=args.budget_gib,
        pool_pages=args.pool_pages, seed=args.seed, repeats=args.repeats, progress=print_progress,
    )  # fmt: skip
    print(format_report(result))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
