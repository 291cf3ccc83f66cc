"""`pagedkv bench state`: memory and decode speed of models with recurrent-state layers.

1. KV + state bytes one request holds at 1k, 8k and 32k tokens for a Qwen3.5-shaped hybrid
   (Qwen3.5-9B's dimensions: 32 layers, 3 gated-delta-net : 1 full attention; GDN with 16 key heads
   and 32 value heads of 128, conv kernel 4, bf16 conv state, fp32 recurrent state; attention 4 KV
   heads x 256 in bf16), against the same model with every layer full attention. Measured in the
   pool: the pages the request's `alloc` takes, times the bytes of a page id (`get_kv_cache_config`
   groups the layers and grows the attention page until it holds a layer's state, as vLLM does).
   The all-full model uses pages of 16 tokens. Bookkeeping only: no tensor is allocated.
2. Decode throughput of `LLMEngine` on a random Qwen3.5-style hybrid (the `--hidden`-wide text model,
   3 : 1) against transformers' `generate()` on the same model and prompts (equal lengths, so no
   padding enters the recurrent state), greedy, fp32 and bf16, runs interleaved, best of `--repeats`:
   generated tokens after the first per second (the engine: the steps after its one prefill step;
   `generate()`: a full run minus a one-token run), and the prefill time of both.
"""

from __future__ import annotations

import argparse
import copy
import time
from typing import Any

from pagedkv.bench import report
from pagedkv.core.context import TextContext
from pagedkv.dtype import DeviceRef, DType
from pagedkv.interface import FullAttentionSpec, KVCacheSpec, MambaSpec, get_kv_cache_config
from pagedkv.interface.bridge import params_from_kv_cache_config
from pagedkv.manager.hybrid import make_block_manager

__all__ = ["add_arguments", "command", "format_state_report", "memory_figures", "run_state_bench", "throughput"]

TOKENS = (1024, 8192, 32768)
LAYERS = 32
GDN_CONV = (2 * 16 * 128 + 32 * 128, 3)  # (conv channels q|k|v, K - 1)
GDN_STATE = (32, 128, 128)  # (value heads, key dim, value dim)


def _specs(hybrid: bool) -> dict[str, KVCacheSpec]:
    attention = FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=256, dtype=DType.bfloat16)
    state = MambaSpec(block_size=16, shapes=(GDN_CONV, GDN_STATE), dtypes=(DType.bfloat16, DType.float32),
                      mamba_type="gdn_attn")  # fmt: skip
    return {f"layer{i}": state if hybrid and i % 4 != 3 else attention for i in range(LAYERS)}


def _request_bytes(specs: dict[str, KVCacheSpec], tokens: int) -> tuple[int, int, int]:
    """(bytes the pool gives one request of `tokens` tokens, attention page in tokens, pages it holds)."""
    config = get_kv_cache_config(specs, 1 << 50)
    params = params_from_kv_cache_config(config, [DeviceRef.META()])
    tree = params.leaves()[0] if len(config.kv_cache_groups) == 1 else params
    pages = -(-tokens // tree.page_size) * len(config.kv_cache_groups) + len(config.kv_cache_groups)
    bookkeeping = make_block_manager(tree, pages)
    ctx = TextContext("r", list(range(tokens)))
    bookkeeping.claim("r")
    bookkeeping.alloc(ctx)
    used = bookkeeping.metrics.used_pages
    return used * config.bytes_per_block, tree.page_size, used


def memory_figures() -> list[dict[str, Any]]:
    """Per context length: the hybrid's and the all-full model's bytes per request, and the content."""
    rows = []
    state_content = sum(s.state_content_size_bytes for s in _specs(True).values() if isinstance(s, MambaSpec))
    for tokens in TOKENS:
        hybrid, block, pages = _request_bytes(_specs(True), tokens)
        full, _, _ = _request_bytes(_specs(False), tokens)
        content = state_content + (LAYERS // 4) * tokens * 4 * 256 * 2 * 2
        rows.append({"tokens": tokens, "hybrid_bytes": hybrid, "all_full_bytes": full, "hybrid_content_bytes": content,
                     "attention_block": block, "hybrid_pages": pages, "ratio": hybrid / full})  # fmt: skip
    return rows


def _model(hidden: int, dtype: Any) -> Any:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config_class: Any = CONFIG_MAPPING["qwen3_5_text"]
    config = config_class(
        vocab_size=1024, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, linear_num_key_heads=2,
        linear_key_head_dim=hidden // 4, linear_num_value_heads=4, linear_value_head_dim=hidden // 4,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 2,
        pad_token_id=0, eos_token_id=2, bos_token_id=1,
    )  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="eager").eval()


def throughput(hidden: int, batch: int, prompt: int, new: int, repeats: int, dtype_name: str) -> dict[str, Any]:
    """Best-of-`repeats` decode tokens per second (after the prefill) and prefill seconds: the engine vs
    transformers' `generate()` (whose decode time is a full run minus a one-token run)."""
    import torch

    from pagedkv.engine import LLMEngine

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    hf = _model(hidden, dtype)
    engine_model = copy.deepcopy(hf)
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(3, 1024, (batch, prompt), generator=g)  # [B, P]
    pages = batch * (-(-(prompt + new) // 16) + 8) + 8
    engine = LLMEngine.from_hf(engine_model, page_size=16, num_pages=pages, max_batch_size=batch,
                               max_num_batched_tokens=batch * prompt, enable_prefix_caching=False)  # fmt: skip
    decode = {"engine": 0.0, "hf": 0.0}
    prefill = {"engine": float("inf"), "hf": float("inf")}
    outputs: dict[str, list[list[int]]] = {}

    def hf_generate(tokens: int) -> tuple[float, Any]:
        start = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=tokens,
                              min_new_tokens=tokens, do_sample=False)  # fmt: skip
        return time.perf_counter() - start, out

    for _ in range(repeats):
        requests = [engine.add_request(p, new, stop_token_ids=[]) for p in prompts.tolist()]
        start = time.perf_counter()
        engine.step()  # every prompt in one step (the budget holds them all): the first token each
        middle = time.perf_counter()
        engine.run()
        end = time.perf_counter()
        prefill["engine"] = min(prefill["engine"], middle - start)
        decode["engine"] = max(decode["engine"], batch * (new - 1) / (end - middle))
        outputs["engine"] = [r.output for r in requests]
        first, _ = hf_generate(1)
        whole, out = hf_generate(new)
        prefill["hf"] = min(prefill["hf"], first)
        decode["hf"] = max(decode["hf"], batch * (new - 1) / max(whole - first, 1e-9))
        outputs["hf"] = out[:, prompt:].tolist()
    same = sum(a == b for a, b in zip(outputs["engine"], outputs["hf"], strict=True))
    return {"dtype": dtype_name, "engine_decode_tokens_per_second": decode["engine"],
            "hf_decode_tokens_per_second": decode["hf"], "decode_ratio": decode["engine"] / decode["hf"],
            "engine_prefill_seconds": prefill["engine"], "hf_prefill_seconds": prefill["hf"],
            "same_outputs": same, "requests": batch}  # fmt: skip


def run_state_bench(hidden: int = 256, batch: int = 8, prompt: int = 64, new: int = 32, repeats: int = 3,
                    dtypes: tuple[str, ...] = ("fp32", "bf16")) -> dict[str, Any]:  # fmt: skip
    """Both parts: the memory rows and one throughput row per dtype."""
    return {
        "memory": memory_figures(),
        "throughput": [throughput(hidden, batch, prompt, new, repeats, d) for d in dtypes],
        "setup": {"hidden": hidden, "batch": batch, "prompt": prompt, "new_tokens": new, "repeats": repeats},
    }


def format_state_report(r: dict[str, Any]) -> str:
    """Markdown tables of both parts."""
    mib = 1024**2
    lines = [
        "KV + state bytes per request, Qwen3.5-9B-shaped hybrid (24 GDN + 8 full layers) vs all 32 layers full:",
        "",
        *report.table(
            ["tokens", "hybrid (pool)", "hybrid content", "all full", "hybrid / all full", "attention page"],
            [
                (
                    f"{m['tokens']:,}",
                    f"{m['hybrid_bytes'] / mib:.1f} MiB",
                    f"{m['hybrid_content_bytes'] / mib:.1f} MiB",
                    f"{m['all_full_bytes'] / mib:.1f} MiB",
                    f"{m['ratio']:.3f}",
                    f"{m['attention_block']} tokens",
                )
                for m in r["memory"]
            ],
        ),  # fmt: skip
        "",
        f"Decode throughput, random Qwen3.5-style model (hidden {r['setup']['hidden']}, 6 GDN + 2 full layers), "
        f"{r['setup']['batch']} prompts of {r['setup']['prompt']} tokens, {r['setup']['new_tokens']} new tokens, "
        f"best of {r['setup']['repeats']}:",
        "",
        *report.table(
            [
                "dtype",
                "engine decode tok/s",
                "generate() decode tok/s",
                "engine / generate",
                "prefill ms, engine / generate",
                "same greedy outputs",
            ],
            [
                (
                    t["dtype"],
                    f"{t['engine_decode_tokens_per_second']:.0f}",
                    f"{t['hf_decode_tokens_per_second']:.0f}",
                    f"{t['decode_ratio']:.2f}",
                    f"{1e3 * t['engine_prefill_seconds']:.0f} / {1e3 * t['hf_prefill_seconds']:.0f}",
                    f"{t['same_outputs']} of {t['requests']}",
                )
                for t in r["throughput"]
            ],
        ),  # fmt: skip
    ]
    return "\n".join(lines)


def plots(r: dict[str, Any]) -> list[report.Plot]:
    """Bytes per request by context length, hybrid vs all full."""
    x = [m["tokens"] for m in r["memory"]]
    return [
        report.Plot("state_bytes_per_request", "KV + state bytes per request", "MiB", x,
                    {"hybrid": [m["hybrid_bytes"] / 1024**2 for m in r["memory"]],
                     "all full": [m["all_full_bytes"] / 1024**2 for m in r["memory"]]}, xlabel="tokens"),
    ]  # fmt: skip


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `pagedkv bench state`."""
    p.add_argument("--hidden", type=int, default=256, help="hidden size of the throughput model")
    p.add_argument("--batch", type=int, default=8, help="prompts generated together")
    p.add_argument("--prompt", type=int, default=64, help="tokens per prompt")
    p.add_argument("--new-tokens", type=int, default=32, help="tokens generated per prompt")
    p.add_argument("--repeats", type=int, default=3, help="interleaved runs per side; the best is kept")
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"], help="model dtypes")


def command(args: argparse.Namespace) -> int:
    """`pagedkv bench state`: print both tables, write --json / --plots."""
    result = run_state_bench(args.hidden, args.batch, args.prompt, args.new_tokens, args.repeats, tuple(args.dtypes))
    report.finish(args, format_state_report(result), result, plots)
    return 0
