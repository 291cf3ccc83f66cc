"""`pagedkv bench engine`: what prefix caching saves the engine on the demo workload; `--compare-hf`: vs transformers.

Serves the demo workload (groups of requests sharing a system prompt) with
prefix caching on and off, alternating runs side by side, and reports the
prefill tokens the cache skipped and the time-to-first-token ratio.
"""

from __future__ import annotations

import argparse
from typing import Any

from pagedkv.bench import report
from pagedkv.demos.engine import DemoWorkload, run_engine

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
    p.add_argument(
        "--compare-hf",
        action="store_true",
        help="also serve an 8-layer Llama (random weights; 16 prompts of 256 tokens, 64 new) with pagedkv, "
        "transformers' generate() and generate_batch(), fp32 and bf16 (about 5 minutes on 2 cores)",
    )
    p.add_argument("--compare-only", action="store_true", help="--compare-hf without the demo workload")
    p.add_argument("--compare-repeats", type=int, default=2, help="runs of each way in --compare-hf; the best is kept")
    p.add_argument("--compare-dtypes", default="float32,bfloat16", help="comma-separated dtypes of --compare-hf")


def command(args: argparse.Namespace) -> int:
    """`pagedkv bench engine`: serve both ways, print the table, write --json / --plots."""
    import torch

    threads = torch.get_num_threads()
    result: dict[str, Any] = {}
    text = []
    if not args.compare_only:
        torch.set_num_threads(1)  # the demo model is tiny: one thread is faster and steadier
        result = run_engine_bench(num_requests=args.requests, repeats=args.repeats, seed=args.seed)
        text.append(format_engine_report(result))
    if args.compare_hf or args.compare_only:
        from pagedkv.bench import engine_hf

        torch.set_num_threads(threads)  # a real model size: every core, as transformers runs by default
        dtypes = tuple(d.strip() for d in args.compare_dtypes.split(",") if d.strip())
        result["compare_hf"] = engine_hf.compare_hf(dtypes=dtypes, repeats=args.compare_repeats)
        text.append(engine_hf.format_compare_report(result["compare_hf"]))
    report.finish(args, "\n\n".join(text), result, plots if "ttft_mean_on" in result else None)
    return 0
