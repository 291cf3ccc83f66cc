"""`pagedkv bench state`: memory and decode speed of models with recurrent-state layers.

1. KV + state bytes one request holds at 1k, 8k and 32k tokens for a Qwen3.5-shaped hybrid
   (Qwen3.5-9B's dimensions: 32 layers, 3 gated-delta-net : 1 full attention; GDN with 16 key heads
   and 32 value heads of 128, conv kernel 4, bf16 conv state, fp32 recurrent state; attention 4 KV
   heads x 256 in bf16), against the same model with every layer full attention. Measured in the
   pools: the attention pages (16 tokens) and state rows the request's `alloc` takes, times their
   bytes (`core.memory`); beside it vLLM's layout of the same model (`get_kv_cache_config` groups the
   layers and grows the attention block until a page holds a layer's state: 528 tokens). The all-full
   model uses pages of 16 tokens. Bookkeeping only: no tensor is allocated.
2. Decode throughput of `LLMEngine` on a random Qwen3.5-style hybrid (the `--hidden`-wide text model,
   3 : 1) against transformers' `generate()` on the same model and prompts (equal lengths, so no
   padding enters the recurrent state), greedy, fp32 and bf16, runs interleaved, best of `--repeats`:
   generated tokens after the first per second (the engine: the steps after its one prefill step;
   `generate()`: a full run minus a one-token run), and the prefill time of both.
3. Time to first token of a warm conversation turn on the same model (fp32): a first turn of
   `--turn-prompt` tokens generates `--new-tokens`, then the next turn (that conversation plus 32 new
   tokens) runs on an engine with prefix caching (it resumes from the state checkpoint the first turn's
   release saved), on a restarted engine whose tiers hold the first turn on disk (empty device and host
   rows: it loads the attention pages and the checkpoint image, checked, from files) and on one without
   prefix caching (it computes the whole conversation again); interleaved, best of `--repeats`, each
   engine's first turn untimed.
"""

from __future__ import annotations

import argparse
import copy
import shutil
import time
from typing import Any

from pagedkv.bench import report
from pagedkv.core import memory
from pagedkv.core.context import TextContext
from pagedkv.dtype import DeviceRef, DType
from pagedkv.interface import FullAttentionSpec, KVCacheSpec, MambaSpec, get_kv_cache_config
from pagedkv.manager.hybrid import make_block_manager
from pagedkv.params.kv import KVCacheParams
from pagedkv.params.multi import MultiKVCacheParams
from pagedkv.params.state import StateCacheParams

__all__ = [
    "add_arguments", "command", "format_state_report", "memory_figures", "run_state_bench", "throughput", "warm_turn",
]  # fmt: skip

TOKENS = (1024, 8192, 32768)
LAYERS = 32
GDN_CONV = (2 * 16 * 128 + 32 * 128, 3)  # (conv channels q|k|v, K - 1)
GDN_STATE = (32, 128, 128)  # (value heads, key dim, value dim)


def _specs(hybrid: bool) -> dict[str, KVCacheSpec]:
    attention = FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=256, dtype=DType.bfloat16)
    state = MambaSpec(block_size=16, shapes=(GDN_CONV, GDN_STATE), dtypes=(DType.bfloat16, DType.float32),
                      mamba_type="gdn_attn")  # fmt: skip
    return {f"layer{i}": state if hybrid and i % 4 != 3 else attention for i in range(LAYERS)}


def _pagedkv_request_bytes(tokens: int) -> tuple[int, int]:
    """(bytes pagedkv's pools give one request of `tokens` tokens of the hybrid, state rows it holds): pages
    of 16 tokens for the 8 attention layers, one state row for the 24 GDN layers."""
    specs = _specs(True)
    attention = specs["layer3"]
    state = specs["layer0"]
    assert isinstance(attention, FullAttentionSpec) and isinstance(state, MambaSpec)
    devices = [DeviceRef.META()]
    tree = MultiKVCacheParams({
        "attention": KVCacheParams(dtype=DType.bfloat16, n_kv_heads=4, head_dim=256, num_layers=LAYERS // 4,
                                   devices=devices, page_size=16),
        "state": StateCacheParams.from_spec(state, LAYERS - LAYERS // 4, devices, page_size=16),
    })  # fmt: skip
    bookkeeping = make_block_manager(tree, -(-tokens // 16), max_batch_size=1)
    bookkeeping.claim("r")
    bookkeeping.alloc(TextContext("r", list(range(tokens))))
    rows = memory.state_slots_per_request(tree)
    used = bookkeeping.metrics.used_pages * memory.pool_page_bytes(tree) + rows * memory.state_row_bytes(tree)
    return used, rows


def _request_bytes(specs: dict[str, KVCacheSpec], tokens: int) -> tuple[int, int, int]:
    """(bytes vLLM's layout gives one request of `tokens` tokens, attention block in tokens, pages it holds):
    `get_kv_cache_config`'s groups, one page per state group and ceil(tokens / block) per attention group,
    each page id costing `bytes_per_block` (every group's page side by side)."""
    config = get_kv_cache_config(specs, 1 << 50)
    block = next(g.kv_cache_spec.block_size for g in config.kv_cache_groups)
    pages = sum(1 if isinstance(g.kv_cache_spec, MambaSpec) else -(-tokens // block) for g in config.kv_cache_groups)
    return pages * config.bytes_per_block, block, pages


def memory_figures() -> list[dict[str, Any]]:
    """Per context length: the hybrid's and the all-full model's bytes per request, and the content."""
    rows = []
    state_content = sum(s.state_content_size_bytes for s in _specs(True).values() if isinstance(s, MambaSpec))
    for tokens in TOKENS:
        hybrid, state_rows = _pagedkv_request_bytes(tokens)
        vllm, block, pages = _request_bytes(_specs(True), tokens)
        full, _, _ = _request_bytes(_specs(False), tokens)
        content = state_content + (LAYERS // 4) * tokens * 4 * 256 * 2 * 2
        rows.append({"tokens": tokens, "hybrid_bytes": hybrid, "state_rows": state_rows, "vllm_layout_bytes": vllm,
                     "all_full_bytes": full, "hybrid_content_bytes": content, "vllm_attention_block": block,
                     "vllm_pages": pages, "ratio": hybrid / full})  # fmt: skip
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


def warm_turn(hidden: int, turn_prompt: int, new: int, repeats: int) -> dict[str, Any]:
    """TTFT of a conversation's second turn, resumed from a state checkpoint on the device, resumed from one
    a restarted engine loads from disk (attention pages and the checkpoint image), and computed again (fp32)."""
    import tempfile

    import torch

    from pagedkv import KVConnectorConfig
    from pagedkv.engine import LLMEngine

    base = _model(hidden, torch.float32)
    g = torch.Generator().manual_seed(2)
    first = torch.randint(3, 1024, (turn_prompt,), generator=g).tolist()
    extra = torch.randint(3, 1024, (32,), generator=g).tolist()
    size: dict[str, Any] = dict(page_size=16, num_pages=4 * (turn_prompt + new + 64) // 16, max_batch_size=2,
                max_num_batched_tokens=turn_prompt + new + 64)  # fmt: skip
    directory = tempfile.mkdtemp(prefix="pagedkv-state-bench-")
    disk: dict[str, Any] = dict(kv_connector="tiered", host_kvcache_swap_space_gb=0.5,
                kv_connector_config=KVConnectorConfig(model_id="state-bench", disk_offload_dir=directory))  # fmt: skip
    engines = {
        "device": LLMEngine.from_hf(copy.deepcopy(base), **size),
        "recompute": LLMEngine.from_hf(copy.deepcopy(base), **size, enable_prefix_caching=False),
        "disk": LLMEngine.from_hf(copy.deepcopy(base), **size, **disk),  # writes the first turns down
    }
    best = dict.fromkeys(engines, float("inf"))
    cached, outputs = {}, {}
    try:
        for r in range(repeats):
            for kind, engine in engines.items():
                opening = engine.add_request(first + [3 + r], new, stop_token_ids=[])  # (a new conversation per repeat)
                engine.run()
                prompt = first + [3 + r] + opening.output + extra
                if kind == "disk":  # the next turn on a restarted engine: empty device and host rows
                    engine.manager.sync_tiers()
                    engine = LLMEngine.from_hf(copy.deepcopy(base), **size, **disk)
                turn = engine.add_request(prompt, 4, stop_token_ids=[])
                engine.run()
                if kind == "disk":
                    engine.manager.close()
                assert turn.ttft is not None
                best[kind] = min(best[kind], turn.ttft)
                cached[kind], outputs[kind] = turn.cached_tokens, turn.output
    finally:
        engines["disk"].manager.close()
        shutil.rmtree(directory, ignore_errors=True)
    return {"turn_prompt_tokens": turn_prompt + 1 + new + len(extra), "cached_tokens": cached["device"],
            "disk_cached_tokens": cached["disk"], "warm_ttft_seconds": best["device"],
            "disk_ttft_seconds": best["disk"], "recompute_ttft_seconds": best["recompute"],
            "ttft_ratio": best["device"] / best["recompute"], "disk_ratio": best["disk"] / best["recompute"],
            "same_outputs": outputs["device"] == outputs["recompute"] == outputs["disk"]}  # fmt: skip


def run_state_bench(hidden: int = 256, batch: int = 8, prompt: int = 64, new: int = 32, repeats: int = 3,
                    dtypes: tuple[str, ...] = ("fp32", "bf16"), turn_prompt: int = 1024) -> dict[str, Any]:  # fmt: skip
    """All three parts: the memory rows, one throughput row per dtype and the warm turn."""
    return {
        "memory": memory_figures(),
        "throughput": [throughput(hidden, batch, prompt, new, repeats, d) for d in dtypes],
        "warm_turn": warm_turn(hidden, turn_prompt, new, repeats),
        "setup": {"hidden": hidden, "batch": batch, "prompt": prompt, "new_tokens": new, "repeats": repeats,
                  "turn_prompt": turn_prompt},
    }  # fmt: skip


def format_state_report(r: dict[str, Any]) -> str:
    """Markdown tables of both parts."""
    mib = 1024**2
    lines = [
        "KV + state bytes per request, Qwen3.5-9B-shaped hybrid (24 GDN + 8 full layers) vs all 32 layers full:",
        "",
        *report.table(
            [
                "tokens",
                "hybrid (pagedkv)",
                "hybrid content",
                "hybrid (vLLM's layout)",
                "all full",
                "pagedkv hybrid / all full",
            ],
            [
                (
                    f"{m['tokens']:,}",
                    f"{m['hybrid_bytes'] / mib:.1f} MiB",
                    f"{m['hybrid_content_bytes'] / mib:.1f} MiB",
                    f"{m['vllm_layout_bytes'] / mib:.1f} MiB ({m['vllm_attention_block']}-token blocks)",
                    f"{m['all_full_bytes'] / mib:.1f} MiB",
                    f"{m['ratio']:.3f}",
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
        "",
        f"Time to first token of a warm conversation turn (same model, fp32, a first turn of "
        f"{r['setup']['turn_prompt'] + 1} prompt tokens + {r['setup']['new_tokens']} generated, then 32 more "
        f"tokens), best of {r['setup']['repeats']}:",
        "",
        *report.table(
            [
                "turn prompt tokens",
                "resumed (device / disk)",
                "TTFT, device checkpoint",
                "TTFT, disk checkpoint (restarted engine)",
                "TTFT, recompute",
                "device / recompute",
                "disk / recompute",
                "same outputs",
            ],
            [
                (
                    w["turn_prompt_tokens"],
                    f"{w['cached_tokens']} / {w['disk_cached_tokens']}",
                    f"{1e3 * w['warm_ttft_seconds']:.1f} ms",
                    f"{1e3 * w['disk_ttft_seconds']:.1f} ms",
                    f"{1e3 * w['recompute_ttft_seconds']:.1f} ms",
                    f"{w['ttft_ratio']:.3f}",
                    f"{w['disk_ratio']:.3f}",
                    w["same_outputs"],
                )
                for w in [r["warm_turn"]]
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
    p.add_argument("--turn-prompt", type=int, default=1024, help="first-turn prompt tokens of the warm-turn TTFT")


def command(args: argparse.Namespace) -> int:
    """`pagedkv bench state`: print both tables, write --json / --plots."""
    result = run_state_bench(args.hidden, args.batch, args.prompt, args.new_tokens, args.repeats, tuple(args.dtypes),
                             args.turn_prompt)  # fmt: skip
    report.finish(args, format_state_report(result), result, plots)
    return 0
