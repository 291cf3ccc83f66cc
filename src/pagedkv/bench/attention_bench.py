"""`pagedkv bench attention`: decode attention over the paged cache vs SDPA over contiguous K/V.

One decode step of a batch (default: 32 requests x 2048 tokens, 8 KV heads of
128, 32 query heads, page size 16, one layer). The paged side calls
`pagedkv.ops.paged_attention` on pages handed out in a shuffled order, so
every request's pages are scattered over the pool; the step's `PagedMetadata`
is built once outside the timed call, as an engine does once per step for all
layers. The contiguous side runs
``torch.nn.functional.scaled_dot_product_attention`` over the same K/V held as
``[B, H_kv, S, D]`` with ``enable_gqa=True`` (the baseline of the target), and also
with the GQA group folded into the query axis (``[B, H_kv, group, D]``), the
fastest contiguous form on CPU. The calls are interleaved and each figure is
the best of `repeats`, so a noisy machine slows all of them alike.

CPU rows always run. GPU rows (`gpu_rows`, the hook for the Triton decode
kernel in `pagedkv.ops.triton_decode`) run only when ``torch.cuda.is_available()``.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812

from pagedkv import ops
from pagedkv.bench import report
from pagedkv.bench.timing import best_of
from pagedkv.ops.metadata import PagedMetadata
from pagedkv.runtime.inputs import RaggedKVCacheInputs, max_lengths_table

__all__ = [
    "TARGET_RATIO",
    "add_arguments",
    "command",
    "format_attention_report",
    "gpu_rows",
    "plots",
    "run_attention_bench",
]

TARGET_RATIO = 1.3  # paged / contiguous SDPA (enable_gqa=True), CPU decode


def _decode_case(
    batch: int, context: int, n_kv_heads: int, n_q_heads: int, head_dim: int, page_size: int,
    dtype: torch.dtype, device: torch.device, seed: int,
) -> dict[str, Any]:  # fmt: skip
    """The paged inputs and the same K/V contiguous, for one decode step at position context - 1."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    pages_per_request = math.ceil(context / page_size)
    num_pages = batch * pages_per_request
    blocks = torch.randn((num_pages + 1, 2, 1, page_size, n_kv_heads, head_dim), generator=gen).to(dtype)
    blocks = blocks.to(device)  # [P + 1, 2, L=1, page_size, H_kv, D]
    order = torch.randperm(num_pages, generator=gen).view(batch, pages_per_request)  # [B, n] scattered pages
    lut = torch.full((batch, pages_per_request + 16), num_pages, dtype=torch.int32)  # null-padded
    lut[:, :pages_per_request] = order.to(torch.int32)
    inputs = RaggedKVCacheInputs(
        blocks, torch.full((batch,), context - 1, dtype=torch.int32, device=device), lut.to(device),
        max_lengths_table(1, context),
    )  # fmt: skip
    offsets = torch.arange(batch + 1, device=device)  # one new token per request
    order = order.to(device)
    k = blocks[order, 0, 0].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()  # [B, H_kv, S, D]
    v = blocks[order, 1, 0].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()  # [B, H_kv, S, D]
    query = torch.randn((batch, n_q_heads, head_dim), generator=gen).to(dtype).to(device)  # [B, H_q, D]
    meta = PagedMetadata.build(inputs, offsets, batch)
    return {"inputs": inputs, "offsets": offsets, "meta": meta, "query": query, "k": k, "v": v}


def _measure(case: dict[str, Any], backend: str, repeats: int, sync: Callable[[], None]) -> dict[str, float]:
    query, k, v = case["query"], case["k"], case["v"]  # [B, H_q, D], [B, H_kv, S, D] x 2
    batch, n_q_heads, head_dim = query.shape
    q_gqa = query.unsqueeze(2)  # [B, H_q, 1, D]
    q_grouped = query.view(batch, k.shape[1], -1, head_dim)  # [B, H_kv, group, D]

    def paged() -> torch.Tensor:
        with ops.use_backend(backend):
            return ops.paged_attention(query, case["inputs"], case["offsets"], 0, metadata=case["meta"])

    calls = {
        "paged": paged,
        "sdpa": lambda: F.scaled_dot_product_attention(q_gqa, k, v, enable_gqa=True),
        "sdpa_grouped": lambda: F.scaled_dot_product_attention(q_grouped, k, v),
    }
    want = calls["sdpa_grouped"]().reshape(batch, n_q_heads, head_dim).float()
    error = (paged().float() - want).abs().max().item()
    best = best_of(calls, repeats, sync)
    return {
        "paged_ms": best["paged"], "contiguous_ms": best["sdpa"], "contiguous_grouped_ms": best["sdpa_grouped"],
        "ratio": best["paged"] / best["sdpa"], "ratio_grouped": best["paged"] / best["sdpa_grouped"],
        "max_abs_diff": error,
    }  # fmt: skip


def gpu_rows(config: dict[str, Any], dtypes: tuple[str, ...], repeats: int) -> tuple[list[dict[str, Any]], str]:
    """GPU hook: (rows, note). Rows for the "triton" (when `pagedkv.ops.triton_decode` is usable) and
    "torch" backends on cuda:0; no rows and the reason when CUDA or the kernel is missing."""
    if not torch.cuda.is_available():
        return [], "skipped: torch.cuda.is_available() is False"
    backends, note = ["torch"], ""
    try:
        from pagedkv.ops import triton_decode

        if triton_decode.available():
            backends.insert(0, "triton")
        else:
            note = "triton backend unavailable (triton_decode.available() is False)"
    except ImportError as exc:
        note = f"triton backend skipped: {exc}"
    device, rows = torch.device("cuda", 0), []
    for name in dtypes:
        case = _decode_case(**config, dtype=getattr(torch, name), device=device, seed=0)
        for backend in backends:
            rows.append({"device": "cuda", "dtype": name, "backend": backend,
                         **_measure(case, backend, repeats, torch.cuda.synchronize)})  # fmt: skip
        del case
        torch.cuda.empty_cache()
    return rows, note


def run_attention_bench(
    batch: int = 32,
    context: int = 2048,
    n_kv_heads: int = 8,
    n_q_heads: int = 32,
    head_dim: int = 128,
    page_size: int = 16,
    dtypes: tuple[str, ...] = ("float32", "bfloat16"),
    repeats: int = 10,
    seed: int = 0,
    gpu: bool = True,
) -> dict[str, Any]:
    """Time paged decode attention (torch backend on CPU) against contiguous SDPA; returns the figures.

    Returns ``{"config": {...}, "repeats": n, "rows": [...], "gpu_note": str}``; each row has
    device, dtype, backend, paged_ms, contiguous_ms (SDPA, enable_gqa=True),
    contiguous_grouped_ms (SDPA, group folded into the query axis), ratio
    (paged / contiguous), ratio_grouped and max_abs_diff (paged vs contiguous output).
    The fp32 case needs about 1 GiB of memory (paged + contiguous copy).
    """
    if n_q_heads % n_kv_heads:
        raise ValueError(f"n_q_heads={n_q_heads} must be a multiple of n_kv_heads={n_kv_heads}")
    config = {"batch": batch, "context": context, "n_kv_heads": n_kv_heads, "n_q_heads": n_q_heads,
              "head_dim": head_dim, "page_size": page_size}  # fmt: skip
    rows = []
    for i, name in enumerate(dtypes):
        case = _decode_case(**config, dtype=getattr(torch, name), device=torch.device("cpu"), seed=seed + i)
        rows.append({"device": "cpu", "dtype": name, "backend": "torch", **_measure(case, "torch", repeats, _no_sync)})
        del case
    note = "skipped: gpu=False"
    if gpu:
        gpu_result, note = gpu_rows(config, dtypes, repeats)
        rows.extend(gpu_result)
    return {"config": config, "repeats": repeats, "rows": rows, "gpu_note": note}


def _no_sync() -> None:
    pass


def format_attention_report(result: dict[str, Any]) -> str:
    """A markdown table of `run_attention_bench`'s figures, with the CPU target."""
    c = result["config"]
    lines = [
        f"Decode attention: batch {c['batch']} x context {c['context']}, {c['n_kv_heads']} KV heads x "
        f"{c['head_dim']}, {c['n_q_heads']} query heads, page size {c['page_size']} (pages shuffled); "
        f"best of {result['repeats']}, interleaved",
        "",
        "| device | dtype | backend | paged ms | SDPA enable_gqa ms | ratio | SDPA grouped-q ms | ratio | max abs diff |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        target = f" (target <= {TARGET_RATIO})" if r["device"] == "cpu" else ""
        lines.append(
            f"| {r['device']} | {r['dtype']} | {r['backend']} | {r['paged_ms']:.2f} | {r['contiguous_ms']:.2f} | "
            f"{r['ratio']:.2f}{target} | {r['contiguous_grouped_ms']:.2f} | {r['ratio_grouped']:.2f} | "
            f"{r['max_abs_diff']:.1e} |"
        )
    if not any(r["device"] == "cuda" for r in result["rows"]) or result["gpu_note"]:
        lines.append(f"\nGPU: {result['gpu_note']}")
    return "\n".join(lines)


def plots(result: dict[str, Any]) -> list[report.Plot]:
    """Milliseconds of the paged call and both contiguous SDPA forms, per device, dtype and backend."""
    rows = result["rows"]
    return [report.Plot("attention_ms", "decode attention, one step", "ms per call",
                        [f"{r['device']} {r['dtype']} {r['backend']}" for r in rows],
                        {"paged": [r["paged_ms"] for r in rows], "SDPA enable_gqa": [r["contiguous_ms"] for r in rows],
                         "SDPA grouped-q": [r["contiguous_grouped_ms"] for r in rows]})]  # fmt: skip


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `pagedkv bench attention`."""
    p.add_argument("--batch", type=int, default=32, help="requests in the decode step")
    p.add_argument("--context", type=int, default=2048, help="tokens each request attends")
    p.add_argument("--repeats", type=int, default=10, help="interleaved rounds; each figure is the best of them")


def command(args: argparse.Namespace) -> int:
    """`pagedkv bench attention`: time, print the table, write --json / --plots."""
    result = run_attention_bench(batch=args.batch, context=args.context, repeats=args.repeats)
    report.finish(args, format_attention_report(result), result, plots)
    return 0
