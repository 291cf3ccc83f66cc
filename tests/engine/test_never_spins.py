"""The engine never spins and never lies.

- A request the pool can never hold alone is refused by `add_request` / `generate`
  (`InsufficientBlocksError` naming its pages and the pool), hybrid models included (Gemma 2/3
  sliding + full, Llama 4 chunked + full: these used to preempt themselves forever, 0 tokens);
  at exactly its minimum (`pagedkv.core.groups.min_request_pages`) it is served with
  transformers' greedy tokens, whatever the step budget.
- `step` refuses to run once the model's attention implementation was switched away.
- Misuse names the user's own argument; `step()` on an empty engine returns [].
- Seeds are per request (vLLM's semantics); top_k and min_p.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from hf_models import ARCHS, COMMON, hf_greedy
from pagedkv.core.errors import InsufficientBlocksError
from pagedkv.core.groups import manager_for, min_request_pages
from pagedkv.engine import LLMEngine, SamplingParams


def tiny(arch: str, **overrides: Any) -> Any:
    import transformers as tf

    config_cls, model_cls, extra = ARCHS[arch](tf)
    config = config_cls(**{**COMMON, **extra, **overrides})
    torch.manual_seed(0)
    model = model_cls._from_config(copy.deepcopy(config), attn_implementation="eager", dtype=torch.float32)
    model.generation_config.eos_token_id = None
    return model.eval()


# (arch, config overrides, page_size, pool sizes of the report, prompt length, new tokens)
CASES = {
    "gemma3-sw3": ("gemma3", {"sliding_window": 3}, 5, (8, 12), 30, 10),
    "gemma2": ("gemma2", {}, 4, (5,), 20, 10),
    "llama4-c5": ("llama4", {"attention_chunk_size": 5}, 3, (9,), 20, 10),
}
PROMPT = list(range(3, 60))


def need(engine: LLMEngine, prompt: int, new: int) -> int:
    leaves = engine.manager.params.leaves()
    return min_request_pages([manager_for(g, leaf.kv_cache_spec) for g, leaf in enumerate(leaves)], prompt, new)


@pytest.mark.parametrize("case", list(CASES))
def test_a_request_that_never_fits_is_refused_up_front(case: str) -> None:
    arch, overrides, ps, pools, prompt, new = CASES[case]
    model = tiny(arch, **overrides)
    for pool in pools:
        engine = LLMEngine.from_hf(model, page_size=ps, num_pages=pool)
        pages = need(engine, prompt, new)
        if pages <= pool:
            continue  # (gemma3 on 12 pages fits: served below)
        with pytest.raises(InsufficientBlocksError, match=rf"needs {pages} pages of {ps} .* holds {pool} pages") as e:
            engine.add_request(PROMPT[:prompt], new)
        assert (e.value.needed, e.value.available) == (pages, pool)
        with pytest.raises(InsufficientBlocksError, match=rf"needs {pages} pages"):
            engine.generate([PROMPT[:prompt]], new)
        assert not engine.has_unfinished() and engine.step() == []


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("budget", [1, 7, 256])
def test_a_request_at_its_true_minimum_is_served_exactly(case: str, budget: int) -> None:
    arch, overrides, ps, _, prompt, new = CASES[case]
    model = tiny(arch, **overrides)
    expected, _ = hf_greedy(model, PROMPT[:prompt], new)
    probe = LLMEngine.from_hf(model, page_size=ps, num_pages=64)
    pages = need(probe, prompt, new)
    engine = LLMEngine.from_hf(model, page_size=ps, num_pages=pages, max_num_batched_tokens=budget)
    request = engine.add_request(PROMPT[:prompt], new)
    for _ in range(prompt + new + 5):  # one token a step at worst: a bounded number of steps
        if not engine.has_unfinished():
            break
        engine.step()
    assert request.output == expected
    assert engine.summary["preemptions"] == 0 and engine.summary["used_pages"] == 0
    with pytest.raises(InsufficientBlocksError):  # one page fewer: refused
        LLMEngine.from_hf(model, page_size=ps, num_pages=pages - 1).add_request(PROMPT[:prompt], new)


def test_several_requests_on_a_minimal_pool_all_finish() -> None:
    """Preemption among requests that each fit alone: every request finishes with its own tokens."""
    model = tiny("llama4", attention_chunk_size=5)
    prompts = [PROMPT[:12], PROMPT[5:15], PROMPT[:9]]
    expected = [hf_greedy(model, p, 6)[0] for p in prompts]
    probe = LLMEngine.from_hf(model, page_size=3, num_pages=64)
    pages = max(need(probe, len(p), 6) for p in prompts)
    engine = LLMEngine.from_hf(model, page_size=3, num_pages=pages, max_num_batched_tokens=16)
    requests = [engine.add_request(p, 6) for p in prompts]
    for _ in range(200):
        if not engine.has_unfinished():
            break
        engine.step()
    assert not engine.has_unfinished()
    assert [r.output for r in requests] == expected


def test_a_stuck_request_fails_loudly_and_leaves_the_engine() -> None:
    """The safety net: a request that cannot take one token with the whole pool (here the check was
    bypassed) is dropped with an error naming it; the requests behind it then run."""
    model = tiny("llama4", attention_chunk_size=5)
    expected = hf_greedy(model, PROMPT[:4], 3)[0]
    engine = LLMEngine.from_hf(model, page_size=3, num_pages=9)
    big = engine._enqueue(torch.arange(3, 23, dtype=torch.int32).numpy(), 10, SamplingParams(), None, None)
    small = engine.add_request(PROMPT[:4], 3)
    steps = 0
    with pytest.raises(
        InsufficientBlocksError, match=rf"request {big.request_id!r} .* cannot run one more token alone"
    ):
        while engine.has_unfinished() and steps < 100:
            engine.step()
            steps += 1
    assert steps < 100
    engine.run()
    assert small.output == expected
    assert engine.summary["used_pages"] == 0


def test_switching_the_attention_away_is_refused_at_step() -> None:
    model = tiny("llama")
    engine = LLMEngine.from_hf(model, page_size=4, num_pages=32)
    expected = engine.generate([PROMPT[:5]], 4)
    model.set_attn_implementation("eager")  # e.g. to call model.generate
    hf = hf_greedy(model, PROMPT[:5], 4)[0]
    request = engine.add_request(PROMPT[:5], 4)
    with pytest.raises(RuntimeError, match=r"'eager', not 'pagedkv'.*set_attn_implementation\('pagedkv'\)"):
        engine.step()
    assert request.output == [] and engine.summary["used_pages"] == 0  # nothing ran
    model.config._attn_implementation = "sdpa"
    with pytest.raises(RuntimeError, match="'sdpa', not 'pagedkv'"):
        engine.step()
    model.set_attn_implementation("pagedkv")
    engine.run()
    assert request.output == expected[0] == hf


def test_step_on_an_empty_engine_returns_nothing() -> None:
    engine = LLMEngine.from_hf(tiny("llama"), page_size=4, num_pages=8)
    assert engine.step() == [] and engine.stats.steps == 0


BAD_FROM_HF = [
    ({"page_size": 0, "num_pages": 8}, ValueError, "page_size=0 must be at least 1"),
    ({"page_size": 2.5, "num_pages": 8}, TypeError, "page_size=2.5 must be an int"),
    ({"num_pages": 0}, ValueError, "num_pages=0 must be at least 1"),
    ({"num_pages": -3}, ValueError, "num_pages=-3 must be at least 1"),
    ({"num_pages": True}, TypeError, "num_pages=True must be an int"),
    ({"memory_budget": 0}, ValueError, "memory_budget=0 must be at least 1"),
    ({"memory_budget": 10}, InsufficientBlocksError, "memory_budget=10 bytes holds no page"),
    ({"num_pages": 8, "memory_budget": 10**6}, ValueError, "give exactly one of num_pages or memory_budget"),
    ({}, ValueError, "give exactly one of num_pages or memory_budget"),
    ({"num_pages": 8, "max_batch_size": 0}, ValueError, "max_batch_size=0 must be at least 1"),
    ({"num_pages": 8, "max_num_batched_tokens": 0}, ValueError, "max_num_batched_tokens=0 must be at least 1"),
    ({"num_pages": 8, "max_num_batched_tokens": -5}, ValueError, "max_num_batched_tokens=-5 must be at least 1"),
    ({"num_pages": 8, "total_num_host_pages": -1}, ValueError, "total_num_host_pages=-1 must be at least 0"),
    ({"num_pages": 8, "enable_prefix_caching": "yes"}, TypeError, "enable_prefix_caching='yes' must be a bool"),
    ({"num_pages": 8, "record_logits": 1}, TypeError, "record_logits=1 must be a bool"),
    ({"num_pages": 8, "preemption_mode": "drop"}, ValueError, "preemption_mode='drop' must be"),
    ({"num_pages": 8, "preemption_mode": "swap"}, ValueError, "preemption_mode='swap' needs a host tier"),
]


@pytest.mark.parametrize("kwargs,error,message", BAD_FROM_HF)
def test_from_hf_names_the_users_argument_and_leaves_no_trace(kwargs: dict, error: type, message: str) -> None:
    model = tiny("llama")
    with pytest.raises(error, match=message):
        LLMEngine.from_hf(model, **kwargs)
    assert model.config._attn_implementation == "eager"  # the model is untouched


def test_seeds_are_per_request() -> None:
    params = SamplingParams(temperature=1.0, seed=7)
    model = tiny("llama")
    first = LLMEngine.from_hf(model, page_size=4, num_pages=64)
    a = PROMPT[:6]
    together = first.generate([PROMPT[10:14], a, a, PROMPT[20:23]], 8, sampling=params)
    assert together[1] == together[2]  # two identical prompts, one seed: the same tokens
    first.generate([PROMPT[30:40]], 5, sampling=params)  # requests before it change nothing
    later = first.generate([a], 8, sampling=params)[0]
    alone = LLMEngine.from_hf(model, page_size=4, num_pages=64, max_num_batched_tokens=3).generate(
        [a], 8, sampling=params
    )
    assert later == alone[0] == together[1]
    other = first.generate([a], 8, sampling=SamplingParams(temperature=1.0, seed=8))[0]
    assert other != later


def test_top_k_and_min_p() -> None:
    model = tiny("llama")
    engine = LLMEngine.from_hf(model, page_size=4, num_pages=64)
    greedy = engine.generate([PROMPT[:5], PROMPT[7:12]], 6)
    for params in (
        SamplingParams(temperature=5.0, top_k=1, seed=1),
        SamplingParams(temperature=5.0, min_p=1.0, seed=1),
    ):
        assert engine.generate([PROMPT[:5], PROMPT[7:12]], 6, sampling=params) == greedy
    hot = SamplingParams(temperature=5.0, seed=3)
    assert engine.generate([PROMPT[:5]], 6, sampling=SamplingParams(temperature=5.0, top_k=0, seed=3)) == \
        engine.generate([PROMPT[:5]], 6, sampling=SamplingParams(temperature=5.0, top_k=-1, seed=3)) == \
        engine.generate([PROMPT[:5]], 6, sampling=hot)  # fmt: skip
    logits = torch.tensor([2.0, 1.9, 0.0, -1.0])
    from pagedkv.engine.sampling import sample

    drawn = {
        sample(logits, SamplingParams(temperature=1.0, top_k=2), torch.Generator().manual_seed(i)) for i in range(64)
    }
    assert drawn == {0, 1}
    drawn = {
        sample(logits, SamplingParams(temperature=1.0, min_p=0.5), torch.Generator().manual_seed(i)) for i in range(64)
    }
    assert drawn == {0, 1}  # p(2)/p(0) = e^-2 < 0.5


@pytest.mark.parametrize(
    "kwargs,error,message",
    [
        ({"top_k": -2}, ValueError, "top_k=-2 must be 0 or -1"),
        ({"top_k": 1.5}, TypeError, "top_k=1.5 must be an int"),
        ({"top_k": True}, TypeError, "top_k=True must be an int"),
        ({"min_p": 1.5}, ValueError, r"min_p=1.5 must be in \[0, 1\]"),
        ({"min_p": -0.1}, ValueError, r"min_p=-0.1 must be in \[0, 1\]"),
        ({"min_p": "0.1"}, TypeError, "min_p='0.1' must be a number"),
        ({"seed": 1 << 64}, ValueError, "must fit in 64 bits"),
    ],
)
def test_sampling_params_are_validated(kwargs: dict, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        SamplingParams(**kwargs)
