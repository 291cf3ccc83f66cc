"""Every architecture of `architectures.PARITY` on the engine equals transformers; `REFUSED` is refused untouched.

Per model type: greedy tokens equal transformers' own `generate()`, and the fp32
logits are within 1e-4 of generate()'s and of a teacher-forced full forward of
the model with no cache. Prompts share a 21-token prefix (not page-aligned at
page size 4); the first wave runs in the smallest pool any one request fits (so it preempts, windowed
models too), a second wave reuses the cached prefix. A refused model raises ValueError naming its type
and the reason, keeps its attention implementation, and generates as before.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from architectures import PARITY, REFUSED, build, render_markdown

from hf_models import hf_greedy
from pagedkv.core.groups import manager_for, min_request_pages
from pagedkv.engine import LLMEngine
from pagedkv.hf.config import kv_layout

NEW_TOKENS = 6
TOLERANCE = 1e-4
DOCS = Path(__file__).resolve().parents[2] / "docs" / "MODELS.md"


def waves() -> tuple[list[list[int]], list[list[int]]]:
    g = torch.Generator().manual_seed(7)
    shared = torch.randint(3, 256, (21,), generator=g).tolist()
    tails = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (5, 11, 2, 9, 3)]
    return [shared + t for t in tails[:3]], [shared + t for t in tails[3:]]


def teacher_forced(model: torch.nn.Module, prompt: list[int], output: list[int]) -> list[torch.Tensor]:
    """Logits [V] of each generated position from one full forward of prompt + output (no cache)."""
    ids = torch.tensor([prompt + output[:-1]])
    with torch.inference_mode():
        logits = model(ids, use_cache=False).logits[0].float()  # [L, V]
    return [logits[len(prompt) - 1 + j] for j in range(len(output))]


def pool_pages(model: torch.nn.Module, prompts: list[list[int]]) -> int:
    """Pages of 4 in a pool that holds any one request alone, also when it comes back from a recompute
    preemption with its whole context as prompt, and no more: the true minimum
    (`pagedkv.core.groups.min_request_pages` over the model's page-table groups, windows counted at their
    peak), far below what a wave of three needs, so the first wave preempts, windowed models too."""
    leaves = kv_layout(model.config, model=model, page_size=4).params.leaves()
    groups = [manager_for(g, leaf.kv_cache_spec) for g, leaf in enumerate(leaves)]
    return max(
        max(min_request_pages(groups, len(p), NEW_TOKENS), min_request_pages(groups, len(p) + NEW_TOKENS - 1, 1))
        for p in prompts
    )


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    assert len(a) == len(b)
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("model_type", list(PARITY))
def test_engine_matches_transformers(model_type: str) -> None:
    reference = build(model_type)
    first, second = waves()
    model = build(model_type)
    num_pages = pool_pages(model, first + second)
    engine = LLMEngine.from_hf(
        model, page_size=4, num_pages=num_pages, max_batch_size=4, max_num_batched_tokens=24,
        record_logits=True,
    )  # fmt: skip
    worst = 0.0
    for wave, prompts in enumerate((first, second)):
        requests = [engine.add_request(p, NEW_TOKENS) for p in prompts]
        cached_before, preempted_before = engine.summary["prompt_tokens_cached"], engine.summary["preemptions"]
        engine.run()
        for i, (prompt, request) in enumerate(zip(prompts, requests, strict=True)):
            tokens, logits = hf_greedy(reference, prompt, NEW_TOKENS)
            where = f"{model_type} wave {wave} prompt {i}"
            assert request.output == tokens, f"{where}: engine {request.output} != transformers {tokens}"
            worst = max(worst, max_diff(request.logits, logits))
            worst = max(worst, max_diff(request.logits, teacher_forced(reference, prompt, tokens)))
            assert worst < TOLERANCE, f"{where}: logits differ by {worst}"
        summary = engine.summary
        if wave == 0:
            assert summary["preemptions"] > preempted_before, summary  # the pool is tight enough to preempt
        assert summary["prompt_tokens_cached"] > cached_before, summary  # the shared prefix was reused
        assert summary["used_pages"] == 0 and engine.manager.check_integrity() is None
    print(f"{model_type}: worst logit difference {worst:.2e}")


@pytest.mark.parametrize(
    "model_type,overrides,reason", REFUSED, ids=[f"{t}-{i}" for i, (t, _, _) in enumerate(REFUSED)]
)
def test_unsupported_models_are_refused_untouched(model_type: str, overrides: dict, reason: str) -> None:
    model = build(model_type, overrides)
    prompt = list(range(3, 15))
    before, _ = hf_greedy(model, prompt, 4)
    implementation = model.config._attn_implementation
    with pytest.raises(ValueError, match=f"model_type='{model_type}' cannot run on pagedkv: .*{reason}"):
        LLMEngine.from_hf(model, num_pages=32)
    assert model.config._attn_implementation == implementation
    assert hf_greedy(model, prompt, 4)[0] == before


def test_models_page_is_current() -> None:
    text = render_markdown()
    if os.environ.get("PAGEDKV_WRITE_DOCS") == "1":
        DOCS.write_text(text)
    assert DOCS.exists(), "docs/MODELS.md is missing: run with PAGEDKV_WRITE_DOCS=1"
    assert DOCS.read_text() == text, "docs/MODELS.md is stale: run with PAGEDKV_WRITE_DOCS=1"


@pytest.mark.parametrize("model_type", ["bloom", "stablelm"])
def test_model_runs_its_own_forward_outside_the_engine(model_type: str) -> None:
    """ALiBi models keep their attention implementation and their wrapped attention modules fall back to
    the original forward outside an engine step; models reached through the current context (StableLM)
    raise a clear error on a plain forward under ``"pagedkv"``."""
    model = build(model_type)
    prompt = list(range(3, 15))
    before, _ = hf_greedy(model, prompt, 4)
    engine = LLMEngine.from_hf(model, page_size=4, num_pages=32)
    assert engine.generate([prompt], 4)[0] == before
    if model_type == "bloom":
        assert model.config._attn_implementation == "eager"
        assert hf_greedy(model, prompt, 4)[0] == before
        return
    with pytest.raises(ValueError, match="needs model"):
        model(torch.tensor([prompt]), use_cache=False)


def test_falcon_alibi_follows_its_attention_implementation() -> None:
    """Falcon's eager path adds its ALiBi bias twice (once more through the mask), SDPA once: the engine
    follows the implementation the model was loaded with (`pagedkv.hf.alibi.slopes`)."""
    import transformers as tf
    from architectures import COMMON

    config = tf.AutoConfig.for_model("falcon", **COMMON, alibi=True)
    prompt = list(range(3, 30))
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    tokens, logits = hf_greedy(model, prompt, NEW_TOKENS)
    engine = LLMEngine.from_hf(model, page_size=4, num_pages=40, record_logits=True)
    request = engine.add_request(prompt, NEW_TOKENS)
    engine.run()
    assert request.output == tokens
    assert max_diff(request.logits, logits) < TOLERANCE
