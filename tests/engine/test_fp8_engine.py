"""FP8 pages through the engine: logits stay within a stated tolerance of the bf16 run.

Measured with `pagedkv bench fp8` on the demo model (logit std ~1.1): an FP8
e4m3 cache with one scale per token and head moves logits by ~0.07 on average
(max ~0.6-0.8) against the all-bf16 run. The bounds below are about twice that.
"""

from __future__ import annotations

import torch

from pagedkv.bench.fp8_bench import SETTINGS, teacher_forced_logits
from pagedkv.demos.engine import DemoWorkload
from pagedkv.engine import LLMEngine
from pagedkv.testing import build_demo_model


def test_fp8_cache_stays_close_to_bf16() -> None:
    prompts = DemoWorkload(num_requests=4, seed=3).prompts(vocab=512)
    continuations = LLMEngine.from_hf(build_demo_model(), page_size=16, num_pages=128).generate(prompts, 6)
    bf16 = teacher_forced_logits(prompts, continuations, *SETTINGS["bf16 model, bf16 cache"])
    fp8 = teacher_forced_logits(prompts, continuations, *SETTINGS["bf16 model, fp8 cache"])
    fp32 = teacher_forced_logits(prompts, continuations, *SETTINGS["fp32 model, fp32 cache"])
    diff = torch.cat([(a - b).abs().flatten() for a, b in zip(fp8, bf16, strict=True)])
    assert float(diff.mean()) < 0.15 and float(diff.max()) < 1.5, (float(diff.mean()), float(diff.max()))
    agree = sum(int((a.argmax(-1) == b.argmax(-1)).sum()) for a, b in zip(fp8, bf16, strict=True)) / 28
    assert agree >= 0.7
    bf16_err = torch.cat([(a - b).abs().flatten() for a, b in zip(bf16, fp32, strict=True)]).mean()
    assert float(diff.mean()) > float(bf16_err) / 2  # the FP8 path really quantizes (not a bf16 pass-through)
