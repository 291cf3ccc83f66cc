"""The `pagedkv` command: `pagedkv demo`, `pagedkv bench <benchmark>` (`pagedkv bench --help` lists them),
`pagedkv engine` (one engine behind HTTP, publishing KV events) and `pagedkv route` (the KV-aware router)."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["BENCH_COMMANDS", "SERVICE_COMMANDS", "BenchCommand", "main", "parser"]


@dataclass(frozen=True)
class BenchCommand:
    """One `pagedkv bench` subcommand: `module` defines ``add_arguments(parser)`` and ``command(args) -> int``
    (the exit status) and prints through `pagedkv.bench.report`; every one takes ``--json PATH``, and
    ``--plots DIR`` where it prints tables (`tables`)."""

    module: str
    help: str
    tables: bool = True


# The `pagedkv bench` subcommands: a new benchmark is registered here, in one line. (The research harness,
# comparisons with other systems and stress runs, lives in the repository's benchmarks/, not installed:
# `python -m benchmarks.<name>` from a checkout.)
BENCH_COMMANDS: dict[str, BenchCommand] = {
    "manager": BenchCommand("pagedkv.bench.manager_bench", "bookkeeping cost of PagedKVCacheManager on a shared-prefix chat trace"),
    "attention": BenchCommand("pagedkv.bench.attention_bench", "paged decode attention vs contiguous SDPA (CPU; GPU rows with CUDA)"),
    "triton": BenchCommand("pagedkv.bench.triton_bench", "Triton paged decode bandwidth vs a device copy (CUDA only)", tables=False),
    "fp8": BenchCommand("pagedkv.bench.fp8_bench", "logit error of bf16/FP8 caches against fp32 and bf16 (demo model)"),
    "engine": BenchCommand("pagedkv.bench.engine_bench", "prefill skipped and TTFT with prefix caching on vs off (demo workload)"),
    "hybrid": BenchCommand("pagedkv.bench.hybrid_bench", "KV bytes, prefix hit rate and decode cost of mixed-attention models"),
    "state": BenchCommand("pagedkv.bench.state_bench", "KV + state bytes of a Qwen3.5-shaped hybrid; engine decode vs transformers generate"),
    "tiers": BenchCommand("pagedkv.bench.tiers_bench", "tier offload / load throughput vs the raw medium; TTFT from a warm tier"),
}  # fmt: skip

_FORMAT = argparse.ArgumentDefaultsHelpFormatter  # every flag's help ends with its default


# `pagedkv engine` and `pagedkv route`: module (``add_arguments(parser)``, ``main(args) -> int``), help.
SERVICE_COMMANDS: dict[str, tuple[str, str]] = {
    "engine": ("pagedkv.router.engine_server", "serve one pagedkv engine over HTTP, publishing its KV events"),
    "route": ("pagedkv.router.service", "the KV-aware router: an HTTP service routing requests over engines"),
}


def _chosen(argv: Sequence[str]) -> tuple[str | None, str | None]:
    """The subcommand and the bench name `argv` names: its first two words that are not options (`pagedkv`
    and `pagedkv bench` take no options but ``--help``, so the words before any option name them)."""
    words = []
    for arg in argv:
        if arg.startswith("-"):
            break
        words.append(arg)
    return (words[0] if words else None), (words[1] if len(words) > 1 and words[0] == "bench" else None)


def parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The parser of `pagedkv`. A subcommand's options come from its module, imported only when `argv` (the
    arguments to parse) names that subcommand, so `pagedkv --help` and `pagedkv bench --help` import no
    benchmark, engine or torch; with `argv` None every module is imported and every option is known."""
    command, bench_name = _chosen(argv) if argv is not None else (None, None)

    def wanted(name: str, chosen: str | None) -> bool:
        return argv is None or name == chosen

    top = argparse.ArgumentParser(prog="pagedkv", description=__doc__, formatter_class=_FORMAT)
    sub = top.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="serve shared-prefix requests with a small model; check against transformers",
                          formatter_class=_FORMAT)  # fmt: skip
    demo.add_argument("--requests", type=int, default=48, help="requests served")
    demo.add_argument("--seed", type=int, default=0, help="seed of the model and the prompts")
    demo.add_argument("--manager-only", action="store_true", help="the bookkeeping demo (no model)")
    demo.add_argument("--model", help="a local transformers checkpoint directory (Llama, Qwen2, Qwen3)")
    demo.add_argument("--connector", choices=["tiered", "redis"],
                      help="the tier demo: fill a tier in one process, start cold on device and warm from it in "
                           "another, compare time to first token with recompute")  # fmt: skip
    demo.add_argument("--redis-url", help="Redis server for --connector redis (redis://host:port/db)")
    demo.add_argument("--dir", help="disk tier directory for --connector tiered (default: a temporary one)")
    for name, (module, text) in SERVICE_COMMANDS.items():
        p = sub.add_parser(name, help=text, description=text, formatter_class=_FORMAT)
        if wanted(name, command):
            importlib.import_module(module).add_arguments(p)
    bench = sub.add_parser("bench", help="benchmarks", formatter_class=_FORMAT)
    kinds = bench.add_subparsers(dest="bench", required=True)
    for name, cmd in BENCH_COMMANDS.items():
        p = kinds.add_parser(name, help=cmd.help, description=cmd.help, formatter_class=_FORMAT)
        if wanted(name, bench_name):
            importlib.import_module(cmd.module).add_arguments(p)
        p.add_argument("--json", type=Path, metavar="PATH", help="also write the figures to this JSON file")
        if cmd.tables:
            p.add_argument("--plots", type=Path, metavar="DIR", help="also write PNG plots of the tables into this directory "
                                                      "(needs matplotlib: pagedkv[bench])")  # fmt: skip
    return top


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `pagedkv` console script."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser(argv).parse_args(argv)
    if args.command == "bench":
        return int(importlib.import_module(BENCH_COMMANDS[args.bench].module).command(args))
    if args.command in SERVICE_COMMANDS:
        return int(importlib.import_module(SERVICE_COMMANDS[args.command][0]).main(args))
    if args.connector:
        from pagedkv.demos.tiers import run_tier_demo

        try:
            result = run_tier_demo(args.connector, directory=args.dir, redis_url=args.redis_url, seed=args.seed)
        except ValueError as exc:
            print(f"pagedkv demo: {exc}", file=sys.stderr)
            return 2
        return 0 if result["identical"] == result["requests"] else 1
    from pagedkv.demos.engine import run_demo

    return run_demo(args.requests, args.seed, manager_only=args.manager_only, model_path=args.model)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
