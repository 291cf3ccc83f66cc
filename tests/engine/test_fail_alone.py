"""A request ends alone: its sampling fails (it is finished with its error, its pages released) or it is
aborted (`LLMEngine.abort_request`) while waiting, running or swapped out; the engine serves the others
and every later request as if nothing happened."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hf_models import build
from pagedkv.engine import LLMEngine, SamplingParams
from pagedkv.engine.sampling import sample_batch

POISON = 101  # a token whose embedding is NaN: every logit of a prompt holding it is NaN (no prompt here samples it)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [5, 6, 7, 8, 20], [30, 31]]
HOT = SamplingParams(temperature=0.8, seed=7)


def engine(poison: bool = False, **kwargs: object) -> LLMEngine:
    model = build("llama")
    if poison:
        with torch.no_grad():
            model.model.embed_tokens.weight[POISON] = float("nan")
    kwargs.setdefault("num_pages", 64)
    eng = LLMEngine.from_hf(model, page_size=4, **kwargs)  # type: ignore[arg-type]
    eng.manager.enable_runtime_checks = True  # check_integrity after every mutating call
    return eng


def test_a_tiny_temperature_is_raised_to_vllms_floor() -> None:
    """vLLM raises a positive temperature below 0.01 to 0.01: logits / 1e-40 overflow to inf (NaN probabilities)."""
    for tiny in (1e-40, 5e-324, 1e-3):
        assert SamplingParams(temperature=tiny) == SamplingParams(temperature=0.01)
    eng = engine()
    tiny = eng.generate(PROMPTS, 6, sampling=SamplingParams(temperature=1e-40, seed=3))
    assert tiny == engine().generate(PROMPTS, 6, sampling=SamplingParams(temperature=0.01, seed=3))
    assert eng.generate(PROMPTS, 6) == engine().generate(PROMPTS, 6)  # and the engine serves on


def test_a_request_whose_sampling_fails_fails_alone() -> None:
    eng = engine(poison=True)
    bad = eng.add_request([5, 6, POISON, 8, 9], 5, HOT)
    good = [eng.add_request(PROMPTS[0], 5), eng.add_request(PROMPTS[1], 5, HOT)]
    ended = []
    while eng.has_unfinished():
        ended += eng.step()
    assert ended[0] is bad and bad.finished and bad.finish_reason == "error" and bad.output == []
    assert isinstance(bad.error, RuntimeError) and "probability tensor contains" in str(bad.error)
    alone = engine()
    want = [alone.add_request(PROMPTS[0], 5), alone.add_request(PROMPTS[1], 5, HOT)]
    alone.run()
    assert [r.output for r in good] == [r.output for r in want] and all(len(r.output) == 5 for r in good)
    assert [r.finish_reason for r in good] == ["length", "length"]
    assert eng.summary["used_pages"] == 0 and not eng.scheduler.running and not eng.scheduler.waiting
    eng.manager.check_integrity()
    # generate: the failed prompt's list is what it generated before (nothing), the others are served in full
    out = eng.generate([PROMPTS[0], [POISON, 3], PROMPTS[1]], 4, sampling=HOT)
    assert out[1] == [] and out[0] == engine().generate([PROMPTS[0]], 4, sampling=HOT)[0] and len(out[2]) == 4
    assert eng.generate(PROMPTS, 6) == engine().generate(PROMPTS, 6)


def test_sample_batch_records_a_failing_row_and_draws_the_others() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))  # [B, V]
    poisoned = logits.clone()
    poisoned[1] = float("nan")
    params = [SamplingParams(), HOT, HOT, SamplingParams(temperature=1.0, top_k=3, seed=1)]

    def gens() -> list[torch.Generator | None]:
        return [None, *(torch.Generator().manual_seed(i) for i in range(3))]

    errors: dict[int, Exception] = {}
    got = sample_batch(poisoned, params, gens(), [True] * 4, errors)
    want = sample_batch(logits, params, gens(), [True] * 4)
    assert got[1] is None and list(errors) == [1] and isinstance(errors[1], RuntimeError)
    assert [got[i] for i in (0, 2, 3)] == [want[i] for i in (0, 2, 3)]
    with pytest.raises(RuntimeError, match="probability tensor contains"):
        sample_batch(poisoned, params, gens(), [True] * 4)  # without `errors`: raised as before


def test_abort_a_waiting_or_a_running_request() -> None:
    eng = engine()
    waiting, running, other = (eng.add_request(p, 6) for p in PROMPTS)
    assert eng.abort_request(waiting.request_id) == [waiting] and waiting.finish_reason == "abort"
    eng.step()  # prefills the other two
    used = eng.summary["used_pages"]
    assert used > 0 and eng.manager.contains(running.request_id)
    assert eng.abort_request([running.request_id, 999, running.request_id]) == [running]
    assert not eng.manager.contains(running.request_id) and eng.summary["used_pages"] < used
    assert running.finished and running.finish_reason == "abort" and len(running.output) == 1 and running.error is None
    eng.run()
    assert other.output == engine().generate([PROMPTS[2]], 6)[0] and other.finish_reason == "length"
    assert eng.abort_request(other.request_id) == []  # finished already: ignored, as vLLM does
    assert eng.summary["used_pages"] == 0
    eng.manager.check_integrity()


def test_abort_checks_every_id_first() -> None:
    eng = engine()
    request = eng.add_request(PROMPTS[0], 2)
    for bad in ("0", True, None, [request.request_id, 1.0], request):
        with pytest.raises(TypeError, match="must be an int"):
            eng.abort_request(bad)  # type: ignore[arg-type]
    assert eng.scheduler.waiting[0] is request and not request.finished
    assert eng.abort_request(iter([request.request_id])) == [request]


def test_abort_a_swapped_out_request_gives_its_host_rows_back() -> None:
    from pagedkv.testing import build_demo_model

    eng = LLMEngine.from_hf(build_demo_model(), page_size=8, num_pages=40, max_num_batched_tokens=128,
                            kv_connector="local", host_kvcache_swap_space_gb=0.01, total_num_host_pages=64)  # fmt: skip
    eng.manager.enable_runtime_checks = True
    rng = np.random.default_rng(0)
    requests = [eng.add_request(rng.integers(3, 500, size=int(rng.integers(20, 60))).tolist(), 40) for _ in range(8)]
    swapped = []
    while eng.has_unfinished() and not swapped:
        eng.step()
        swapped = [r for r in requests if eng.manager.is_swapped(r.request_id)]
    assert swapped, "the pool is small enough to swap"
    spaces = eng.manager.tiers.swap_spaces[0]
    lent = spaces.rows_lent
    assert eng.abort_request(swapped[0].request_id) == [swapped[0]]
    assert not eng.manager.is_swapped(swapped[0].request_id) and spaces.rows_lent < lent
    eng.run()
    assert spaces.rows_lent == 0 and eng.summary["used_pages"] == 0
    assert all(r.finish_reason == "length" for r in requests if r is not swapped[0])
    eng.manager.check_integrity()


def test_a_failed_request_of_a_state_model_leaves_no_wrong_checkpoint() -> None:
    """A recurrent model moves a request's state in the forward pass; a request that then fails its sampling is
    released without being stepped, so no checkpoint of that moved-on state is kept: a later prompt sharing
    its prefix gets exactly the tokens of a fresh engine."""
    from state_models import build_state_model

    def state_engine(poison: bool) -> LLMEngine:
        model = build_state_model("lfm2")
        if poison:
            with torch.no_grad():
                model.get_input_embeddings().weight[POISON] = float("nan")
        eng = LLMEngine.from_hf(model, page_size=4, num_pages=64, max_num_batched_tokens=8)
        eng.manager.enable_runtime_checks = True
        return eng

    eng, fresh = state_engine(True), state_engine(False)
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [5, 6, 7, 8, 20, 21, 22, 23, 24]]
    bad = eng.add_request([5, 6, 7, 8, 9, 10, 11, 12, POISON, 3], 4, HOT)
    good = [eng.add_request(p, 6, HOT) for p in prompts]
    eng.run()
    assert bad.finish_reason == "error" and [r.output for r in good] == fresh.generate(prompts, 6, sampling=HOT)
    shared = [5, 6, 7, 8, 9, 10, 11, 12, 13, 3, 4, 5]
    before = eng.summary["prompt_tokens_cached"]
    assert eng.generate([shared], 6) == fresh.generate([shared], 6)
    assert eng.summary["prompt_tokens_cached"] - before == 8  # its two full pages the earlier prompts hold
    eng.manager.check_integrity()
