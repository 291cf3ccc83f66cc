"""BART on pagedkv equals transformers' own greedy generate(): tokens, and logits within 1e-4 (fp32).

Decoder self-attention K/V live in a paged full-attention group, the encoder's
cross-attention K/V in a cross-attention group written once per admission.
Requests run in two waves on one engine: the second wave repeats encoder and
decoder prompts of the first (decoder pages come back from the prefix cache)
and pairs a decoder prefix of the first wave with another encoder (no page may
be shared: the decoder's K/V depend on the encoder). Every step checks the
cross pages: ceil(encoder_len / page_size) of them, fixed while the request
holds them, never prefix-cached. Small pools evict and preempt.
"""

from __future__ import annotations

import copy
import functools
import math
from typing import Any

import pytest
import torch

from pagedkv.engine import EncoderDecoderEngine, EncoderDecoderRequest
from pagedkv.engine.encoder_decoder import encoder_salt

NEW_TOKENS = 10
START = 2  # decoder_start_token_id
Workload = list[tuple[list[int], list[int] | None]]  # (encoder prompt, decoder prompt)


def build(seed: int = 0, overrides: dict[str, Any] | None = None) -> Any:
    """A tiny fp32 BART (2 + 2 layers, d_model 64, 4 heads) with seeded random weights; eos and forced tokens off.
    `overrides`: more config keywords."""
    import transformers as tf

    config = tf.BartConfig(
        vocab_size=256, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=512,
        init_std=0.2, pad_token_id=1, bos_token_id=0, eos_token_id=None, decoder_start_token_id=START,
        forced_bos_token_id=None, forced_eos_token_id=None, **(overrides or {}),
    )  # fmt: skip
    torch.manual_seed(seed)
    model = tf.BartForConditionalGeneration._from_config(
        copy.deepcopy(config), attn_implementation="eager", dtype=torch.float32
    )
    model.generation_config.eos_token_id = None
    return model.eval()


def waves() -> tuple[Workload, Workload]:
    g = torch.Generator().manual_seed(5)
    enc = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (23, 9, 30, 17, 12)]
    shared = torch.randint(3, 256, (20,), generator=g).tolist()  # a decoder prefix
    first: Workload = [(enc[0], None), (enc[1], shared), (enc[2], None), (enc[3], shared[:7])]
    # again (enc 1, shared): cache hits; (new enc 4, shared): same decoder prefix, other encoder; again (enc 3, ...)
    second: Workload = [(enc[1], shared), (enc[4], shared), (enc[3], shared[:7])]
    return first, second


def hf_greedy(model: Any, encoder: list[int], decoder: list[int] | None) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' generate(): the tokens after the decoder prompt (start token included), per-step logits [V]."""
    ids = torch.tensor([encoder])
    kwargs: dict[str, Any] = {}
    if decoder is not None:
        kwargs["decoder_input_ids"] = torch.tensor([[START, *decoder]])
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
            return_dict_in_generate=True, **kwargs,
        )  # fmt: skip
    prompt = 1 + (0 if decoder is None else len(decoder))
    return out.sequences[0, prompt:].tolist(), [step[0].float() for step in out.logits]


@functools.cache
def reference() -> tuple[tuple[list[int], list[torch.Tensor]], ...]:
    model = build()
    first, second = waves()
    return tuple(hf_greedy(model, e, d) for e, d in first + second)


class Watch:
    """Steps an engine to the end, checking cross pages and decoder page sharing after every step."""

    def __init__(self, engine: EncoderDecoderEngine) -> None:
        self.engine = engine
        self.cross: dict[tuple[object, int], list[int]] = {}  # (request, admission) -> its cross pages
        self.first_hit: dict[object, int] = {}  # request -> prompt tokens from the prefix cache at first admission
        self.steps = 0

    def run(self, requests: list[EncoderDecoderRequest]) -> None:
        engine = self.engine
        pool, ps = engine.manager._managers[0].pool, engine.manager.page_size
        while engine.has_unfinished():
            engine.step()
            self.steps += 1
            running = [r for r in requests if r in engine.scheduler.running]
            for r in running:
                if r.preemptions == 0:
                    self.first_hit.setdefault(r.request_id, r.ctx.cached_prefix_length)
                pages = engine.cross_pages(r)
                assert len(pages) == math.ceil(len(r.encoder_prompt) / ps), (r.request_id, pages)
                assert all(pool.block_hash(p) is None and pool.ref_count(p) == 1 for p in pages), pages
                assert self.cross.setdefault((r.request_id, r.preemptions), pages) == pages, "cross pages moved"
            self_pages = {r: set(engine.manager.get_req_blocks(r.request_id, group=0)) for r in running}
            for a in running:
                for b in running:
                    if a is not b and a.encoder_prompt.tolist() != b.encoder_prompt.tolist():
                        assert not self_pages[a] & self_pages[b], "decoder pages shared across encoder inputs"


# (page_size, num_pages, expect preemption)
CONFIGS = [(16, 64, False), (1, 600, False), (16, 6, True), (1, 66, True)]


@pytest.mark.parametrize("page_size,num_pages,preempts", CONFIGS)
def test_bart_matches_transformers(page_size: int, num_pages: int, preempts: bool) -> None:
    engine = EncoderDecoderEngine.from_hf(
        build(), page_size=page_size, num_pages=num_pages, enable_prefix_caching=True, max_batch_size=8,
        max_num_batched_tokens=32, record_logits=True,
    )  # fmt: skip
    watch = Watch(engine)
    first, second = waves()
    requests = []
    for wave in (first, second):  # the second wave starts once the first has finished: its pages are cached
        batch = [engine.add_request(e, NEW_TOKENS, decoder_prompt=d) for e, d in wave]
        watch.run(batch)
        requests += batch
    for i, (request, (tokens, logits)) in enumerate(zip(requests, reference(), strict=True)):
        assert request.output == tokens, f"request {i}: engine {request.output} != transformers {tokens}"
        diff = max(float((a - b).abs().max()) for a, b in zip(request.logits, logits, strict=True))
        assert diff < 1e-4, f"request {i}: logits differ by {diff}"
    summary = engine.summary
    assert (summary["preemptions"] > 0) == preempts, summary
    assert summary["encoder_runs"] == len(requests) + summary["preemptions"], summary  # once per admission
    assert summary["used_pages"] == 0, summary
    engine.manager.check_integrity()
    again, other_encoder, again_short = requests[len(first) :]
    # same decoder prefix as `again`, other encoder: nothing shared (after a preemption it may hit its own pages)
    assert watch.first_hit[other_encoder.request_id] == 0
    if not preempts:  # (a tight pool may have evicted the first wave's pages)
        assert again.cached_tokens >= 16, again.cached_tokens  # start + 20 shared tokens: one 16-token page
        assert again_short.cached_tokens == (7 if page_size == 1 else 0), again_short.cached_tokens


def test_cross_pages_written_once_per_admission() -> None:
    """Decode steps neither allocate nor rewrite cross pages; K/V in them are the encoder's projections."""
    engine = EncoderDecoderEngine.from_hf(build(), page_size=4, num_pages=64)
    encoder = list(range(3, 26))  # 23 tokens: 6 pages of 4
    request = engine.add_request(encoder, 6)
    engine.step()
    pages = engine.cross_pages(request)
    assert len(pages) == 6 and engine.encoder_runs == 1
    blocks = engine.manager.get_device_buffer().children["cross"].values[0]  # [P + 1, 2, L, ps, H, D]
    stored = blocks[pages].clone()
    while engine.has_unfinished():
        if request in engine.scheduler.running:
            assert engine.cross_pages(request) == pages
        engine.step()
    assert engine.encoder_runs == 1
    model = engine.model
    with torch.inference_mode():
        hidden = model.get_encoder()(input_ids=torch.tensor([encoder]), pagedkv=_no_pages()).last_hidden_state[0]
        attn = model.get_decoder().layers[1].encoder_attn
        key = attn.k_proj(hidden).view(len(encoder), 4, 16)  # [S, H, D]
    paged_key = stored[:, 0, 1].reshape(-1, 4, 16)[: len(encoder)]  # layer 1's K, positions 0..S-1
    torch.testing.assert_close(paged_key, key)


def _no_pages() -> Any:
    from pagedkv.hf.attention import ForwardContext

    return ForwardContext([], torch.zeros(1, dtype=torch.int64))


def test_encoder_salt() -> None:
    assert encoder_salt([5, 6, 7]) == encoder_salt([5, 6, 7])
    assert encoder_salt([5, 6, 7]) != encoder_salt([5, 6, 8])
    assert encoder_salt([5, 6, 7], "tenant") != encoder_salt([5, 6, 7])


def test_decoder_prompt_gets_the_start_token() -> None:
    engine = EncoderDecoderEngine.from_hf(build(), page_size=4, num_pages=32)
    assert engine.add_request([9, 10], 2, decoder_prompt=[7, 8]).ctx.tokens.all.tolist() == [START, 7, 8]
    assert engine.add_request([9, 10], 2, decoder_prompt=[START, 8]).ctx.tokens.all.tolist() == [START, 8]
    assert engine.add_request([9, 10], 2).ctx.tokens.all.tolist() == [START]
    with pytest.raises(ValueError, match=r"prompt must be a non-empty 1-D sequence, got shape \(0,\)"):
        engine.add_request([], 2)
    with pytest.raises(TypeError, match=r"decoder_prompt\[1\]=True is not a token id"):
        engine.add_request([9, 10], 2, decoder_prompt=[START, True])  # (was read as token 1)
    with pytest.raises(TypeError, match="prompt must be integers, got dtype float64"):
        engine.add_request([9.7, 10.2], 2)  # (was truncated to [9, 10])
    with pytest.raises(ValueError, match="cache_salt='' is empty"):
        engine.add_request([9, 10], 2, cache_salt="")  # (was the unsalted chain)
    assert len(engine.scheduler.waiting) == 3


def test_rejects_unsupported_models() -> None:
    from hf_models import build as build_decoder_only

    with pytest.raises(ValueError, match="not a supported encoder-decoder"):
        EncoderDecoderEngine.from_hf(build_decoder_only("llama"), num_pages=8)
