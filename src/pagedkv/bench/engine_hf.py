"""`pagedkv bench engine --compare-hf`: the engine side by side with transformers' own generation.

The same Llama-style model with random weights (same seed, so the same weights every run) serves the
same prompts three ways, each timed from the call to the last token, interleaved, best of `repeats`:

* pagedkv: `LLMEngine` on pagedkv pages (no prefix caching: the prompts share nothing);
* generate(): transformers' `model.generate` on the whole batch in one call (SDPA, DynamicCache);
* generate_batch(): transformers' continuous batching, `model.generate_batch` with
  ``attn_implementation="paged|sdpa"`` (its paged cache), whose wall includes its manager's start-up.

Every request generates exactly `max_new_tokens` (no EOS), greedy; greedy tokens are compared.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["CompareConfig", "compare_hf", "format_compare_report", "WAYS"]

WAYS = ("pagedkv", "generate", "generate_batch")


@dataclass(frozen=True)
class CompareConfig:
    """The model and workload of the comparison (defaults: the issue's 8-layer Llama, 16 x 256 prompts, 64 new)."""

    layers: int = 8
    hidden: int = 768
    heads: int = 12
    kv_heads: int = 4
    intermediate: int = 2048
    vocab: int = 32000
    prompts: int = 16
    prompt_len: int = 256
    new_tokens: int = 64
    page_size: int = 16
    seed: int = 0


def _model(cfg: CompareConfig, dtype: torch.dtype, attn: str) -> Any:
    """The Llama-style model of `cfg` with random weights from `cfg.seed`, in `dtype`, eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config: Any = LlamaConfig(
        num_hidden_layers=cfg.layers, hidden_size=cfg.hidden, num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.kv_heads, intermediate_size=cfg.intermediate, vocab_size=cfg.vocab,
        max_position_embeddings=cfg.prompt_len + cfg.new_tokens,
    )  # fmt: skip
    config._attn_implementation = attn
    torch.manual_seed(cfg.seed)
    model: Any = LlamaForCausalLM(config)
    model = model.to(dtype).eval()
    model.generation_config.eos_token_id = None  # every request generates new_tokens
    return model


def _prompts(cfg: CompareConfig) -> list[list[int]]:
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    return torch.randint(0, cfg.vocab, (cfg.prompts, cfg.prompt_len), generator=gen).tolist()


def _run_pagedkv(cfg: CompareConfig, dtype: torch.dtype, prompts: list[list[int]]) -> tuple[float, list[list[int]]]:
    from pagedkv.engine import LLMEngine

    model = _model(cfg, dtype, "eager")
    pages = len(prompts) * -(-(cfg.prompt_len + cfg.new_tokens) // cfg.page_size) + 1
    engine = LLMEngine.from_hf(
        model, page_size=cfg.page_size, num_pages=pages, enable_prefix_caching=False, max_batch_size=len(prompts),
        max_num_batched_tokens=len(prompts) * cfg.prompt_len,
    )  # fmt: skip
    start = time.perf_counter()
    requests = [engine.add_request(p, cfg.new_tokens) for p in prompts]
    with torch.inference_mode():
        engine.run()
    return time.perf_counter() - start, [list(r.output) for r in requests]


def _run_generate(cfg: CompareConfig, dtype: torch.dtype, prompts: list[list[int]]) -> tuple[float, list[list[int]]]:
    model = _model(cfg, dtype, "sdpa")
    start = time.perf_counter()
    ids = torch.tensor(prompts)  # [B, S]: same length, no padding
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=cfg.new_tokens, min_new_tokens=cfg.new_tokens,
            do_sample=False, pad_token_id=0,
        )  # fmt: skip  # [B, S + new]
    return time.perf_counter() - start, out[:, ids.shape[1] :].tolist()


def _run_generate_batch(
    cfg: CompareConfig, dtype: torch.dtype, prompts: list[list[int]]
) -> tuple[float, list[list[int]]]:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    model = _model(cfg, dtype, "sdpa")
    with warnings.catch_warnings():  # transformers 5 says the "paged|" prefix is no longer needed
        warnings.simplefilter("ignore", FutureWarning)
        model.set_attn_implementation("paged|sdpa")
    gen = GenerationConfig(max_new_tokens=cfg.new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    page = 256  # its default page size; the cache sized for the workload, as pagedkv's (not from free memory)
    blocks = len(prompts) * -(-(cfg.prompt_len + cfg.new_tokens) // page) + 1
    batching = ContinuousBatchingConfig(
        page_size=page, num_blocks=blocks, max_batch_tokens=len(prompts) * cfg.prompt_len
    )
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate_batch(
            inputs=prompts, generation_config=gen, continuous_batching_config=batching
        )  # {request id: GenerationOutput}
    wall = time.perf_counter() - start
    by_prompt = sorted(out.values(), key=lambda r: int(str(r.request_id).rsplit("_", 1)[-1]))  # req_0, req_1, ...
    return wall, [list(r.generated_tokens) for r in by_prompt]


RUNNERS: dict[str, Callable[[CompareConfig, torch.dtype, list[list[int]]], tuple[float, list[list[int]]]]] = {
    "pagedkv": _run_pagedkv,
    "generate": _run_generate,
    "generate_batch": _run_generate_batch,
}


def compare_hf(
    cfg: CompareConfig | None = None, dtypes: tuple[str, ...] = ("float32", "bfloat16"), repeats: int = 2,
    ways: tuple[str, ...] = WAYS,
) -> dict[str, Any]:  # fmt: skip
    """Best-of-`repeats` generated tok/s of each of `ways` per dtype, interleaved; tokens compared to pagedkv's.

    A way that raises is reported with its error (``error_<way>``) instead of a figure.
    """
    cfg = cfg or CompareConfig()
    prompts = _prompts(cfg)
    tokens = cfg.prompts * cfg.new_tokens
    result: dict[str, Any] = {"config": vars(cfg).copy(), "repeats": repeats, "ways": list(ways), "dtypes": {}}
    for name in dtypes:
        dtype = getattr(torch, name)
        walls: dict[str, list[float]] = {w: [] for w in ways}
        outputs: dict[str, list[list[int]]] = {}
        errors: dict[str, str] = {}
        for _ in range(repeats):
            for way in ways:
                if way in errors:
                    continue
                try:
                    wall, out = RUNNERS[way](cfg, dtype, prompts)
                except Exception as exc:  # noqa: BLE001  # reported, not fatal: the other ways still run
                    errors[way] = f"{type(exc).__name__}: {exc}"
                    continue
                walls[way].append(wall)
                outputs.setdefault(way, out)
        row: dict[str, Any] = {"errors": errors}
        for way in ways:
            if walls[way]:
                row[f"wall_{way}"] = min(walls[way])
                row[f"tok_s_{way}"] = tokens / min(walls[way])
        base = row.get("tok_s_pagedkv")
        for way in ways[1:]:
            if base and row.get(f"tok_s_{way}"):
                row[f"ratio_over_{way}"] = base / row[f"tok_s_{way}"]
            if "pagedkv" in outputs and way in outputs:
                row[f"same_tokens_{way}"] = outputs["pagedkv"] == outputs[way]
        result["dtypes"][name] = row
    return result


def format_compare_report(r: dict[str, Any]) -> str:
    """A markdown table: tok/s of each way per dtype, pagedkv's ratio over each, identical greedy tokens."""
    c = r["config"]
    lines = [
        f"Llama-style model, random weights: {c['layers']} layers, hidden {c['hidden']}, {c['heads']} heads, "
        f"{c['kv_heads']} KV heads, vocab {c['vocab']}; {c['prompts']} prompts of {c['prompt_len']} tokens, "
        f"{c['new_tokens']} new tokens each, greedy; best of {r['repeats']}, interleaved",
        "",
        "| dtype | " + " | ".join(f"{w} tok/s" for w in r["ways"]) + " | "
        + " | ".join(f"pagedkv / {w}" for w in r["ways"][1:]) + " | "
        + " | ".join(f"same tokens as {w}" for w in r["ways"][1:]) + " |",
        "|---" * (2 * len(r["ways"]) - 1 + len(r["ways"])) + "|",
    ]  # fmt: skip
    for name, row in r["dtypes"].items():
        rates = [f"{row[f'tok_s_{w}']:.0f}" if f"tok_s_{w}" in row else "error" for w in r["ways"]]
        ratios = [f"{row[f'ratio_over_{w}']:.2f}x" if f"ratio_over_{w}" in row else "-" for w in r["ways"][1:]]
        same = [str(row.get(f"same_tokens_{w}", "-")) for w in r["ways"][1:]]
        lines.append(f"| {name} | " + " | ".join(rates + ratios + same) + " |")
    for name, row in r["dtypes"].items():
        lines.extend(f"\n{name} {way} failed: {err}" for way, err in row["errors"].items())
    return "\n".join(lines)
