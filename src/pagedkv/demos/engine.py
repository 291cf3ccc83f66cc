"""`pagedkv demo`: a small Llama-style model served by `LLMEngine`, checked against HF `generate()`.

Builds the model from a config with a fixed seed (no download), serves
requests in groups that share a system prompt, prints throughput, time to
first token, prefix hit rate, pages and preemptions, then runs transformers'
own `generate()` (eager attention, its own cache) on every prompt and checks
that each output is the same, token for token.
`--manager-only` runs the bookkeeping demo of the core instead.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pagedkv.testing import build_demo_model
from pagedkv.workloads.progress import Progress

__all__ = ["DemoWorkload", "hf_reference", "load_model", "run_demo", "run_engine"]


@dataclass(frozen=True)
class DemoWorkload:
    """Requests in groups sharing a system prompt, each with its own question."""

    num_requests: int = 48
    num_groups: int = 6
    prefix_len: int = 96
    suffix_range: tuple[int, int] = (8, 40)
    max_new_tokens: int = 24
    seed: int = 0

    def prompts(self, vocab: int) -> list[list[int]]:
        """Seeded prompts: a group's system prompt, then random question tokens."""
        rng = np.random.default_rng(self.seed)
        prefixes = rng.integers(3, vocab, size=(self.num_groups, self.prefix_len))
        prompts = []
        for i in range(self.num_requests):
            suffix = rng.integers(3, vocab, size=int(rng.integers(*self.suffix_range)))
            prompts.append([*prefixes[i % self.num_groups].tolist(), *suffix.tolist()])
        return prompts


def load_model(path: str | None, seed: int = 0, attn_implementation: str = "eager") -> Any:
    """The demo model, or a local transformers checkpoint directory (fp32, no download)."""
    if path is None:
        return build_demo_model(seed, attn_implementation)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path, local_files_only=True, dtype=torch.float32, attn_implementation=attn_implementation
    )
    model.generation_config.eos_token_id = None  # every request generates max_new_tokens
    return model.eval()


def run_engine(
    workload: DemoWorkload, *, enable_prefix_caching: bool = True, progress: bool = False, model_path: str | None = None
) -> dict[str, Any]:
    """Serve the workload on a fresh model; returns outputs, timings and counters."""
    from pagedkv.engine import LLMEngine

    model = load_model(model_path, workload.seed)
    engine = LLMEngine.from_hf(
        model, page_size=16, num_pages=64, enable_prefix_caching=enable_prefix_caching, max_batch_size=16,
        max_num_batched_tokens=256,
    )  # fmt: skip
    prompts = workload.prompts(vocab=model.config.vocab_size)
    requests = [engine.add_request(p, workload.max_new_tokens) for p in prompts]
    start = time.perf_counter()
    with Progress("requests") as bar:
        engine.run(progress=bar if progress else None)
    wall = time.perf_counter() - start
    ttfts = [r.ttft for r in requests if r.ttft is not None]
    return {
        **engine.summary, "outputs": [r.output for r in requests], "prompts": prompts, "wall_seconds": wall,
        "tokens_per_second": sum(len(r.output) for r in requests) / wall, "ttft_mean": statistics.mean(ttfts),
        "ttft_p50": statistics.median(ttfts), "free_pages": engine.manager.num_free_blocks(),
    }  # fmt: skip


def hf_reference(
    prompts: list[list[int]], max_new_tokens: int, seed: int, model_path: str | None = None
) -> list[list[int]]:
    """transformers' own greedy `generate()` (eager attention, DynamicCache), one prompt at a time."""
    model = load_model(model_path, seed)
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(
                ids, max_new_tokens=max_new_tokens, do_sample=False, attention_mask=torch.ones_like(ids)
            )
            outputs.append(out[0, len(prompt) :].tolist())
    return outputs


def run_demo(num_requests: int = 48, seed: int = 0, manager_only: bool = False, model_path: str | None = None) -> int:
    """Serve, report, verify; returns 0 when every output equals transformers' `generate()`.

    `model_path`: a local transformers checkpoint directory to use instead of the demo model.
    """
    if manager_only:
        from pagedkv.demos.manager import run_manager_demo

        return run_manager_demo(num_requests=num_requests * 5, seed=seed)
    workload = DemoWorkload(num_requests=num_requests, seed=seed)
    torch.set_num_threads(1)  # a model this small runs faster on one thread than split over two
    print(f"pagedkv demo: {workload.num_requests} requests, {workload.num_groups} groups sharing a "
          f"{workload.prefix_len}-token system prompt, {workload.max_new_tokens} new tokens each; "
          f"{model_path or 'Llama-style model (4 layers, hidden 128, GQA 8:2)'}, 64 pages of 16 tokens")  # fmt: skip
    r = run_engine(workload, progress=True, model_path=model_path)
    print(f"  throughput {r['tokens_per_second']:.0f} generated tok/s ({r['generated_tokens']} tokens in "
          f"{r['wall_seconds']:.2f} s, {r['steps']} steps); time to first token mean {1e3 * r['ttft_mean']:.0f} ms, "
          f"median {1e3 * r['ttft_p50']:.0f} ms")  # fmt: skip
    print(f"  prefix cache: {r['prompt_tokens_cached']} of {r['prompt_tokens']} prompt tokens reused "
          f"(hit rate {r['prompt_tokens_cached'] / r['prompt_tokens']:.3f}); pages used {r['used_pages']}, "
          f"free {r['free_pages']} of {r['total_pages']}; preemptions {r['preemptions']}")  # fmt: skip
    t0 = time.perf_counter()
    expected = hf_reference(r["prompts"], workload.max_new_tokens, seed, model_path)
    same = sum(a == b for a, b in zip(r["outputs"], expected, strict=True))
    print(f"  checked against transformers generate() ({time.perf_counter() - t0:.1f} s): "
          f"{same}/{len(expected)} outputs identical")  # fmt: skip
    if same != len(expected):
        print("  FAIL: outputs differ from transformers")
        return 1
    print("  OK: every output equals transformers' own greedy generate()")
    return 0
