"""Prefix hits on models with recurrent state: a request that resumes from a state checkpoint gives the
tokens and logits of one computed from scratch (one full forward of transformers, no cache), for a gated
delta net hybrid, a Mamba2 hybrid and a short-convolution hybrid: shared system prompts of lengths that are
multiples of nothing, multi-turn conversations (each turn resumes where the last one stopped) and
preemption in between (a preempted request resumes from its own checkpoint)."""

from __future__ import annotations

import copy

import pytest
import torch
from state_models import build_state_model
from test_state_models import check_parity

from pagedkv.engine import LLMEngine
from pagedkv.engine.request import Request

MODELS = ["qwen3_5_text", "bamba", "lfm2"]  # gated delta net, Mamba2, short convolutions (each beside attention)
NEW = 5
PS = 4


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def serve(engine: LLMEngine, prompt: list[int]) -> Request:
    request = engine.add_request(prompt, NEW, stop_token_ids=[])
    engine.run()
    return request


@pytest.mark.parametrize("model_type", MODELS)
def test_a_shared_system_prompt_hits_from_the_third_user_on(model_type: str) -> None:
    """37 system tokens: the first user saves its prompt's end, the second finds the system prompt's pages
    but no state at 36 (its page boundary), ends a chunk there and saves it; every later user resumes at 36."""
    model = build_state_model(model_type, seed=21)
    ref = copy.deepcopy(model)
    engine = LLMEngine.from_hf(model, page_size=PS, num_pages=256, max_num_batched_tokens=64, record_logits=True)
    system = tokens(37, 1)
    batch = [system + tokens(n, 10 + n) for n in (3, 5, 11, 2, 7)]
    requests = [serve(engine, prompt) for prompt in batch]
    assert [r.cached_tokens for r in requests] == [0, 0, 36, 36, 36]
    check_parity(model_type, ref, batch, requests)


@pytest.mark.parametrize("model_type", MODELS)
def test_each_turn_of_a_conversation_resumes_where_the_last_one_stopped(model_type: str) -> None:
    model = build_state_model(model_type, seed=22)
    ref = copy.deepcopy(model)
    engine = LLMEngine.from_hf(model, page_size=PS, num_pages=256, max_num_batched_tokens=16, record_logits=True)
    prompt, batch, requests = tokens(13, 2), [], []
    for turn in range(3):
        request = serve(engine, prompt)
        batch.append(prompt)
        requests.append(request)
        # the finished request's state covers its prompt and every output token but the last (never fed back)
        prompt = prompt + request.output + tokens(3 + 2 * turn, 30 + turn)
    assert [r.cached_tokens for r in requests] == [0, 13 + NEW - 1, 13 + NEW + 3 + NEW - 1]
    check_parity(model_type, ref, batch, requests)
    assert engine.summary["checkpoint_pages"] > 0 and engine.summary["used_pages"] == 0  # the checkpoints stay


@pytest.mark.parametrize("model_type", MODELS)
def test_preempted_requests_resume_from_their_own_checkpoints(model_type: str) -> None:
    """13 pages admit the three prompts but not their growth: after two decode steps the newest request (22
    prompt tokens, 24 processed) is preempted. Its live state is kept as a checkpoint at 24 (a page boundary),
    its partial page was private (freed to the fresh stack, taken first) and its six full pages stay cached, so
    its readmission resumes at 24 instead of computing 24 tokens again."""
    model = build_state_model(model_type, seed=23)
    ref = copy.deepcopy(model)
    batch = [tokens(n, 40 + n) for n in (7, 10, 22)]
    engine = LLMEngine.from_hf(model, page_size=PS, num_pages=13, max_num_batched_tokens=64, record_logits=True)
    requests = [engine.add_request(p, NEW, stop_token_ids=[]) for p in batch]
    engine.run()
    assert engine.summary["preemptions"] == 1 and requests[2].preemptions == 1
    assert [r.cached_tokens for r in requests] == [0, 0, 24]  # the readmission resumed from its checkpoint
    check_parity(model_type, ref, batch, requests)


def test_prefix_caching_off_keeps_no_checkpoint() -> None:
    model = build_state_model("lfm2", seed=24)
    engine = LLMEngine.from_hf(model, page_size=PS, num_pages=64, enable_prefix_caching=False)
    system = tokens(21, 3)
    requests = [serve(engine, system + tokens(4, 50 + i)) for i in range(3)]
    assert [r.cached_tokens for r in requests] == [0, 0, 0]
    assert engine.manager.num_free_blocks() == engine.manager.total_num_pages


@pytest.mark.parametrize("model_type", ["lfm2", "qwen3_5_text"])
def test_a_weights_update_midway_never_resumes_from_a_state_of_the_old_weights(model_type: str) -> None:
    """Two steps (the prefill, ended before its last token where the prompt-end checkpoint is saved) under the old
    weights, then `update_weights`: the running request is released and recomputed, and no checkpoint of
    old-weights state (prompt end, release) is a hit under the new version, so its tokens are those of the new
    model on its prompt and the first token the old one produced."""
    model = build_state_model(model_type, seed=25)
    new = build_state_model(model_type, seed=26)
    engine = LLMEngine.from_hf(model, page_size=16, num_pages=64, record_logits=True)
    prompt = tokens(10, 5)
    request = engine.add_request(prompt, NEW, stop_token_ids=[])
    engine.step()  # the prompt's state before its last token, under the old weights: a prompt-end checkpoint at 9
    assert request.output == [] and engine.summary["state_checkpoints"] == 1
    engine.step()  # its last token: the first output token
    first = request.output[:1]
    assert first
    assert engine.update_weights(new.state_dict(), "v2") == 1
    engine.run()
    assert request.cached_tokens == 0  # nothing of the old weights resumed
    ref = copy.deepcopy(new)
    fresh = LLMEngine.from_hf(ref, page_size=16, num_pages=64, enable_prefix_caching=False)
    (expected,) = fresh.generate([prompt + first], max_new_tokens=NEW - 1, stop_token_ids=[])
    assert request.output == first + expected


def test_with_no_checkpoint_rows_the_next_turn_adopts_the_finished_requests_row() -> None:
    """max_state_checkpoints=0 and one batch slot: one state row in all. A finished request's live row stays as a
    checkpoint until a row is needed; its next turn takes that row as its own live state (no copy) and
    resumes where it stopped, at parity."""
    model = build_state_model("lfm2", seed=27)
    ref = copy.deepcopy(model)
    engine = LLMEngine.from_hf(model, page_size=PS, num_pages=64, max_batch_size=1, max_state_checkpoints=0,
                               record_logits=True)  # fmt: skip
    assert engine.summary["state_rows"] == 1
    first = serve(engine, tokens(13, 8))
    prompt = tokens(13, 8) + first.output + tokens(3, 9)
    second = serve(engine, prompt)
    assert second.cached_tokens == 13 + NEW - 1
    check_parity("lfm2", ref, [tokens(13, 8), prompt], [first, second])


def serve_all(engine: LLMEngine, batch: list[list[int]]) -> list[Request]:
    requests = [engine.add_request(prompt, NEW, stop_token_ids=[]) for prompt in batch]
    engine.run()
    return requests


@pytest.mark.parametrize("model_type", ["mamba", "mamba2"])
def test_a_model_of_state_layers_only_resumes_the_same_prompts_before_their_last_token(model_type: str) -> None:
    """No attention page, so no divergence point to cut at: each prompt's state is saved before its last token
    (the prompt's prefill ends a chunk there; the last token's logits are computed at the next step), so the same
    prompts sent again compute their last token only, at parity with transformers and with no caching."""
    model = build_state_model(model_type, seed=28)
    ref, plain = copy.deepcopy(model), copy.deepcopy(model)
    engine = LLMEngine.from_hf(model, page_size=PS, num_pages=64, record_logits=True)
    batch = [tokens(n, 60 + n) for n in (4, 9, 17, 25, 36)]
    first = serve_all(engine, batch)
    again = serve_all(engine, batch)
    assert [r.cached_tokens for r in first] == [0, 0, 0, 0, 0]
    assert [r.cached_tokens for r in again] == [3, 8, 16, 24, 35]
    assert engine.summary["prompt_tokens_cached"] == 86 and engine.summary["state_rows"] == 32 + 64
    check_parity(model_type, ref, batch + batch, first + again)
    uncached = LLMEngine.from_hf(plain, page_size=PS, num_pages=64, enable_prefix_caching=False)
    assert [r.output for r in again] == uncached.generate(batch, max_new_tokens=NEW, stop_token_ids=[])


@pytest.mark.parametrize("model_type", MODELS)
def test_a_prompt_sent_again_resumes_before_its_last_token(model_type: str) -> None:
    """Five prompts of 4 to 36 tokens sharing their first 3. The first round: the 4-token prompt saves its state at
    3 (before its last token, the end of the shared prefix), which the others resume from. The second round: every
    prompt resumes from its own prompt-end checkpoint, all 86 reusable tokens (each prompt but its last token)."""
    model = build_state_model(model_type, seed=29)
    ref = copy.deepcopy(model)  # (512 pages: room for the 10 checkpoints, in runs of up to 31 pages for bamba)
    engine = LLMEngine.from_hf(model, page_size=PS, num_pages=512, max_num_batched_tokens=64, record_logits=True)
    shared = tokens(3, 7)
    batch = [shared + tokens(n - 3, 70 + n) for n in (4, 9, 17, 25, 36)]
    first = [serve(engine, prompt) for prompt in batch]
    again = serve_all(engine, batch)
    assert [r.cached_tokens for r in first] == [0, 3, 3, 3, 3]
    assert [r.cached_tokens for r in again] == [len(prompt) - 1 for prompt in batch] == [3, 8, 16, 24, 35]
    assert engine.summary["prompt_tokens_cached"] == 12 + 86
    check_parity(model_type, ref, batch + batch, first + again)
