"""`pagedkv bench engine`: what prefix caching saves the engine on the demo workload.

Serves the demo workload (groups of requests sharing a system prompt) with
prefix caching on and off, alternating runs side by side, and reports the
prefill tokens the cache skipped and the time-to-first-token ratio.
"""

from __future__ import annotations

import argparse
from typing import Any

from pagedkv.bench import report
from pagedkv.demo import DemoWorkload, run_engine

__all__ = ["add_arguments", "command", "format_engine_report", "plots", "run_engine_bench"]


def run_engine_bench(num_requests: int = 48, repeats: int = 3, seed: int = 0) -> dict[str, Any]:
    """Best-of-`repeats` TTFT and throughput with caching on and off, interleaved."""
    workload = DemoWorkload(num_requests=num_requests, seed=seed)
    runs: dict[bool, list[dict[str, Any]]] = {True: [], False: []}
    for _ in range(repeats):
        for caching in (True, False):
            runs[caching].append(run_engine(workload, enable_prefix_caching=caching))
    result: dict[str, Any] = {"requests": num_requests, "repeats": repeats}
    for caching, name in ((True, "on"), (False, "off")):
        best = min(runs[caching], key=lambda r: r["ttft_mean"])
        result[f"ttft_mean_{name}"] = best["ttft_mean"]
        result[f"ttft_p50_{name}"] = min(r["ttft_p50"] for r in runs[caching])
        result[f"tokens_per_second_{name}"] = max(r["tokens_per_second"] for r in runs[caching])
        result[f"prefill_tokens_computed_{name}"] = best["prefill_tokens_computed"]
        result[f"prompt_tokens_{name}"] = best["prompt_tokens"]
    result["same_outputs"] = runs[True][0]["outputs"] == runs[False][0]["outputs"]
    result["prefill_tokens_skipped"] = result["prefill_tokens_computed_off"] - result["prefill_tokens_computed_on"]
    result["ttft_ratio_on_over_off"] = result["ttft_mean_on"] / result["ttft_mean_off"]
    return result


def format_engine_report(r: dict[str, Any]) -> str:
    """A markdown table of the engine figures."""
    return "\n".join(
        [
            f"Demo workload: {r['requests']} requests, best of {r['repeats']} runs each way, interleaved",
            "",
            "| prefix caching | prefill tokens computed | TTFT mean / median, ms | generated tok/s |",
            "|---|---|---|---|",
            *(
                f"| {name} | {r[f'prefill_tokens_computed_{name}']} of {r[f'prompt_tokens_{name}']} | "
                f"{1e3 * r[f'ttft_mean_{name}']:.0f} / {1e3 * r[f'ttft_p50_{name}']:.0f} | "
                f"{r[f'tokens_per_second_{name}']:.0f} |"
                for name in ("on", "off")
            ),
            "",
            f"Prefill tokens skipped: {r['prefill_tokens_skipped']}; TTFT on/off: {r['ttft_ratio_on_over_off']:.2f}; "
            f"outputs identical both ways: {r['same_outputs']}",
        ]
    )


def plots(r: dict[str, Any]) -> list[report.Plot]:
    """Time to first token and prefill tokens computed, prefix caching on and off."""
    ways = ["on", "off"]
    return [
        report.Plot("engine_ttft_ms", "time to first token", "ms", ways,
                    {"mean": [1e3 * r[f"ttft_mean_{w}"] for w in ways], "median": [1e3 * r[f"ttft_p50_{w}"] for w in ways]},
                    xlabel="prefix caching"),
        report.Plot("engine_prefill_tokens", "prefill tokens computed", "tokens", ways,
                    {"computed": [r[f"prefill_tokens_computed_{w}"] for w in ways],
                     "prompt tokens": [r[f"prompt_tokens_{w}"] for w in ways]}, xlabel="prefix caching"),
    ]  # fmt: skip


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `pagedkv bench engine`."""
    p.add_argument("--requests", type=int, default=48, help="requests of the demo workload")
    p.add_argument("--repeats", type=int, default=3, help="runs each way, interleaved; the best is kept")
    p.add_argument("--seed", type=int, default=0, help="seed of the demo workload")


def command(args: argparse.Namespace) -> int:
    """`pagedkv bench engine`: serve both ways, print the table, write --json / --plots."""
    import torch

    torch.set_num_threads(1)  # the demo model is tiny: one thread is faster and steadier
    result = run_engine_bench(num_requests=args.requests, repeats=args.repeats, seed=args.seed)
    report.finish(args, format_engine_report(result), result, plots)
    return 0
