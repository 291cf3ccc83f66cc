"""The command line of each research benchmark: ``python -m benchmarks.<name> [flags]`` from the repository root.

A benchmark module defines ``add_arguments(parser)`` and ``command(args) -> int`` (the exit status), as the
`pagedkv bench` commands do (`pagedkv.cli.BenchCommand`), and prints through `pagedkv.bench.report`;
`main` builds its parser with ``--json PATH`` (and ``--plots DIR`` where it prints tables) and runs it.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

__all__ = ["BENCHMARKS", "Benchmark", "main", "parser"]


@dataclass(frozen=True)
class Benchmark:
    """One research benchmark: `module` defines ``add_arguments`` and ``command``; `tables`: it takes ``--plots``."""

    module: str
    help: str
    tables: bool = True


# By what follows `python -m`: a new benchmark is registered here, in one line.
BENCHMARKS: dict[str, Benchmark] = {
    "benchmarks.compare": Benchmark("benchmarks.compare.run", "pagedkv vs vLLM and SGLang cache managers and the Belady bound, on five workloads over a capacity sweep"),
    "benchmarks.compare.state_prefix": Benchmark("benchmarks.compare.state_prefix", "prefix hit rate of a Qwen3.5-shaped hybrid (state checkpoints) vs vLLM align mode and the all-attention ceiling, at equal bytes"),
    "benchmarks.headline": Benchmark("benchmarks.headline", "the README's headline figures, rendered from docs/figures/*.json (--write, --check)", tables=False),
    "benchmarks.soak": Benchmark("benchmarks.soak", "engine soak over every tier: RSS, leaks, tokens"),
    "benchmarks.faults": Benchmark("benchmarks.faults", "Redis killed, disk full, corrupt / truncated pages, slow Redis while engines serve"),
    "benchmarks.router": Benchmark("benchmarks.router", "KV-aware routing vs round-robin vs random over 4 engine processes: fleet hit rate, TTFT; decision latency", tables=False),
    "benchmarks.connector": Benchmark("benchmarks.connector", "vLLM KV connector: blocks/s saved and loaded through its worker side vs the raw medium (needs vLLM)"),
    "benchmarks.hicache": Benchmark("benchmarks.hicache", "SGLang HiCache storage backend (pagedkv.integrations.sglang) on Redis and a directory vs the raw medium and SGLang's HiCacheFile (needs SGLang)"),
    "benchmarks.step_calls": Benchmark("benchmarks.step_calls", "pagedkv calls per layer per decode step of a tiny Llama (one-pass check)"),
}  # fmt: skip


def parser(name: str, module: ModuleType | None = None) -> argparse.ArgumentParser:
    """The parser of ``python -m <name>`` (`name` a key of `BENCHMARKS`); `module` defines its options
    (default: the registered module, imported)."""
    bench = BENCHMARKS[name]
    module = module or importlib.import_module(bench.module)
    p = argparse.ArgumentParser(prog=f"python -m {name}", description=bench.help,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # fmt: skip
    module.add_arguments(p)
    p.add_argument("--json", type=Path, metavar="PATH", help="also write the figures to this JSON file")
    if bench.tables:
        p.add_argument("--plots", type=Path, metavar="DIR", help="also write PNG plots of the tables into this directory "
                                                  "(needs matplotlib: pagedkv[bench])")  # fmt: skip
    return p


def main(name: str, module: ModuleType | None = None, argv: Sequence[str] | None = None) -> int:
    """Run ``python -m <name>`` with `argv` (default: the process's arguments); returns its exit status.
    `module`: the benchmark's module when it runs as ``__main__`` (so it is not imported twice)."""
    module = module or importlib.import_module(BENCHMARKS[name].module)
    return int(module.command(parser(name, module).parse_args(argv)))
