"""`pagedkv bench fp8`: how much an FP8 (or bf16) KV cache moves the logits.

Serves the same prompts through the engine with the demo model in several
(model dtype, cache dtype) settings and compares every step's logits with
fp32 everywhere and with bf16 everywhere. Decoding is teacher-forced: every
setting continues the fp32 run's tokens, so each step compares logits of the
same prefix and errors cannot snowball through a different token.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from pagedkv.bench import report
from pagedkv.demos.engine import DemoWorkload
from pagedkv.dtype import DType
from pagedkv.params.kv import KVCacheQuantizationConfig
from pagedkv.testing import build_demo_model

__all__ = [
    "SETTINGS",
    "add_arguments",
    "command",
    "format_fp8_report",
    "plots",
    "run_fp8_bench",
    "teacher_forced_logits",
]

# name -> (model dtype, cache dtype, FP8 scale granularity)
SETTINGS: dict[str, tuple[torch.dtype, DType, int | None]] = {
    "fp32 model, fp32 cache": (torch.float32, DType.float32, None),
    "fp32 model, bf16 cache": (torch.float32, DType.bfloat16, None),
    "fp32 model, fp8 cache": (torch.float32, DType.float8_e4m3fn, 16),
    "bf16 model, bf16 cache": (torch.bfloat16, DType.bfloat16, None),
    "bf16 model, fp8 cache": (torch.bfloat16, DType.float8_e4m3fn, 16),
}


def teacher_forced_logits(
    prompts: list[list[int]], continuations: list[list[int]], model_dtype: torch.dtype, kv_dtype: DType,
    granularity: int | None, seed: int = 0,
) -> list[torch.Tensor]:  # fmt: skip
    """Per request, logits [len(continuation) + 1, V] (float32) after the prompt and each forced token.

    Every prefix ``prompt + continuation[:k]`` is served as its own one-token
    request; with prefix caching on, each reuses the pages of the shorter ones,
    so the logits come from KV stored in `kv_dtype` pages.
    """
    from pagedkv.engine import LLMEngine

    model = build_demo_model(seed).to(model_dtype)
    quant = None if granularity is None else KVCacheQuantizationConfig(quantization_granularity=granularity)
    engine = LLMEngine.from_hf(
        model, page_size=16, num_pages=512, kv_dtype=kv_dtype, quantization=quant, max_batch_size=64,
        record_logits=True,
    )  # fmt: skip
    per_request = []
    for prompt, continuation in zip(prompts, continuations, strict=True):
        requests = [engine.add_request(prompt + continuation[:k], 1) for k in range(len(continuation) + 1)]
        engine.run()
        per_request.append(torch.stack([r.logits[0] for r in requests]))
    return per_request


def run_fp8_bench(num_requests: int = 16, new_tokens: int = 16, seed: int = 0) -> dict[str, Any]:
    """Max and mean |logit error| of every setting against fp32 and against bf16."""
    workload = DemoWorkload(num_requests=num_requests, max_new_tokens=new_tokens, seed=seed)
    prompts = workload.prompts(vocab=512)
    from pagedkv.engine import LLMEngine

    base = LLMEngine.from_hf(build_demo_model(seed), page_size=16, num_pages=256, max_batch_size=64)
    continuations = base.generate(prompts, new_tokens)
    logits = {name: teacher_forced_logits(prompts, continuations, *s, seed=seed) for name, s in SETTINGS.items()}
    result: dict[str, Any] = {"requests": num_requests, "steps": new_tokens, "settings": {}}
    fp32, bf16 = logits["fp32 model, fp32 cache"], logits["bf16 model, bf16 cache"]
    scale = torch.cat(fp32).std().item()
    for name, values in logits.items():
        row = {"logit_std": scale}
        for ref_name, ref in (("fp32", fp32), ("bf16", bf16)):
            diff = torch.cat([(a - b).abs().flatten() for a, b in zip(values, ref, strict=True)])
            agree = sum(int((a.argmax(-1) == b.argmax(-1)).sum()) for a, b in zip(values, ref, strict=True))
            row[f"max_vs_{ref_name}"] = float(diff.max())
            row[f"mean_vs_{ref_name}"] = float(diff.mean())
            row[f"argmax_agree_vs_{ref_name}"] = agree / sum(len(a) for a in values)
        result["settings"][name] = row
    return result


def format_fp8_report(r: dict[str, Any]) -> str:
    """A markdown table: logit error per setting against fp32 and bf16."""
    lines = [
        f"{r['requests']} requests x {r['steps'] + 1} teacher-forced steps; demo model (logit std "
        f"{next(iter(r['settings'].values()))['logit_std']:.2f})",
        "",
        "| setting | max / mean abs error vs fp32 | argmax agreement vs fp32 | max / mean vs bf16 | argmax vs bf16 |",
        "|---|---|---|---|---|",
    ]
    for name, s in r["settings"].items():
        lines.append(
            f"| {name} | {s['max_vs_fp32']:.2e} / {s['mean_vs_fp32']:.2e} | {s['argmax_agree_vs_fp32']:.3f} | "
            f"{s['max_vs_bf16']:.2e} / {s['mean_vs_bf16']:.2e} | {s['argmax_agree_vs_bf16']:.3f} |"
        )
    return "\n".join(lines)


def plots(r: dict[str, Any]) -> list[report.Plot]:
    """Mean and max |logit error| of every setting against fp32 (log scale would hide the zero row)."""
    names = list(r["settings"])
    return [report.Plot("fp8_logit_error", "logit error against an fp32 model and cache", "|logit error|", names,
                        {"max vs fp32": [r["settings"][n]["max_vs_fp32"] for n in names],
                         "mean vs fp32": [r["settings"][n]["mean_vs_fp32"] for n in names],
                         "max vs bf16": [r["settings"][n]["max_vs_bf16"] for n in names]})]  # fmt: skip


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `pagedkv bench fp8`."""
    p.add_argument("--requests", type=int, default=16, help="prompts of the demo workload")
    p.add_argument("--steps", type=int, default=16, help="teacher-forced tokens after each prompt")


def command(args: argparse.Namespace) -> int:
    """`pagedkv bench fp8`: compare, print the table, write --json / --plots."""
    torch.set_num_threads(1)  # the demo model is tiny: one thread is faster and steadier
    result = run_fp8_bench(num_requests=args.requests, new_tokens=args.steps)
    report.finish(args, format_fp8_report(result), result, plots)
    return 0
