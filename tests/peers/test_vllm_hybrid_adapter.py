"""vLLM's real hybrid `KVCacheManager` in Mamba align mode (`VllmHybridAdapter`), Qwen3.5-shaped.

Run in `.venv-peers` (`make test-peers`); the tests skip where vLLM does not import, and fail instead under
PAGEDKV_REQUIRE_PEERS=1. Every expected value is derived by hand in the docstrings from vLLM 0.33's rules
(paths under ``vllm/``):

- Sizes. GDN state per layer: conv (3, 8192) bf16 = 49,152 B + recurrent (32, 128, 128) fp32 = 2,097,152 B =
  2,146,304 B. One attention token: K and V x 4 heads x 256 x 2 B = 4,096 B. The block is
  16 * ceil(2,146,304 / (16 * 4,096)) = 16 * ceil(32.75) = 528 tokens, the unified page 528 * 4,096 =
  2,162,688 B. 24 GDN + 8 attention layers make 4 groups of 8 layers (3 GDN, 1 attention); a block has one
  page per layer of a group: 8 * 2,162,688 = 17,301,504 B.
- Hits. Only full 528-token blocks are hashed, the hit is capped at num_tokens - 1 (the last prompt token is
  recomputed), and a GDN group can only resume where a state was saved: at a block boundary where a prefill
  chunk ended (the scheduler's split, ``v1/core/sched/scheduler.py:546-662``). With vLLM's default
  ``prefix_cache_retention_interval=0`` a finished chunk keeps its GDN state only at the prompt's replay
  boundary, floor((prompt - 1) / 528) * 528, and at a detected shared-prefix junction.
- The split of a chunk [start, end) of a prompt P (no EAGLE, no prefill checkpoints): stop at
  floor((P - 1) / 528) * 528 (the last cacheable boundary) and at a junction, if strictly inside; a chunk
  that does not reach P is cut down to a block boundary (to 0 if that is start: the request waits).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest

from benchmarks.compare.peers import PeerUnavailable, load_peer
from benchmarks.compare.sim import SimConfig, simulate
from pagedkv.workloads.traces import TraceRequest

BLOCK = 528
PAGE_BYTES = 2_162_688
BLOCK_BYTES = 8 * PAGE_BYTES


def _adapter(**kwargs: Any) -> Any:
    """The adapter, or skip (fail under PAGEDKV_REQUIRE_PEERS=1) when vLLM does not import."""
    kwargs.setdefault("num_pages", 200)
    try:
        return load_peer("vllm-hybrid", **kwargs)
    except PeerUnavailable as exc:
        if os.environ.get("PAGEDKV_REQUIRE_PEERS") == "1":
            pytest.fail(f"{exc}, and PAGEDKV_REQUIRE_PEERS=1")
        pytest.skip(str(exc))


def _tokens(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(0, 32_000, size=n, dtype=np.int32)


def _req(rid: int, prompt: np.ndarray, output: int, rng: np.random.Generator, after: int | None = None) -> TraceRequest:
    return TraceRequest(rid, np.concatenate([prompt, _tokens(rng, output)]), len(prompt), after=after)


def _step(adapter: Any, req: TraceRequest, budget: int = 8192) -> tuple[int, int] | None:
    """One scheduler step that admits `req` and runs its first chunk (nothing else running)."""
    adapter.new_step()
    got = adapter.admit(req, budget)
    if got is not None:
        hit, n = got
        req.num_computed = hit + n
        adapter.advance([(req, n)])
    return got


def test_block_size_page_and_bytes() -> None:
    """528-token blocks, a 2,162,688 B page, 4 groups of 8 layers, 17,301,504 B per block (module docstring)."""
    a = _adapter(num_pages=10)
    assert (a.page_size, a.hash_block_size, a.plan.block_size) == (BLOCK, BLOCK, BLOCK)
    assert a.plan.mamba_state_bytes == 3 * 8192 * 2 + 32 * 128 * 128 * 4 == 2_146_304
    assert a.plan.page_bytes == PAGE_BYTES
    kinds = [(type(g.kv_cache_spec).__name__, len(g.layer_names)) for g in a.kv_cache_config.kv_cache_groups]
    assert kinds == [("MambaSpec", 8)] * 3 + [("FullAttentionSpec", 8)]
    assert all(g.kv_cache_spec.page_size_bytes == PAGE_BYTES for g in a.kv_cache_config.kv_cache_groups)
    assert all(g.kv_cache_spec.mamba_cache_mode == "align" for g in a.kv_cache_config.kv_cache_groups[:3])
    assert a.plan.bytes_per_block == BLOCK_BYTES
    assert a.kv_cache_config.num_blocks == 11  # num_pages + vLLM's null block
    # 10 GiB: 10,737,418,240 // 17,301,504 = 620 vLLM blocks (620.6), 619 usable.
    gib10 = 10 * 2**30
    assert type(a).blocks_for_bytes(gib10) == 620
    b = type(a).from_bytes(gib10)
    assert (b.num_pages, b.kv_cache_config.num_blocks) == (619, 620)
    with pytest.raises(ValueError):
        _adapter(num_pages=10, page_size=16)  # `benchmarks.compare`'s 16-token pages are not this model's blocks


def test_flashinfer_gdn_prefill_sizes() -> None:
    """SM90's FlashInfer GDN prefill exports checkpoints every 64 tokens: the alignment becomes lcm(16, 64) = 64,
    the block 64 * ceil(2,146,304 / (64 * 4,096)) = 64 * ceil(8.19) = 576, the page 576 * 4,096 = 2,359,296 B."""
    a = _adapter(num_pages=10, gdn_prefill_backend="flashinfer")
    assert (a.page_size, a.plan.page_bytes, a.plan.bytes_per_block) == (576, 2_359_296, 8 * 2_359_296)
    spec = a.kv_cache_config.kv_cache_groups[0].kv_cache_spec
    assert (spec.num_prefill_checkpoint_blocks, spec.prefill_checkpoint_alignment) == (1, 576)


@pytest.mark.parametrize(
    ("kv_heads", "value_heads", "ssm_dtype", "alignment", "expected"),
    [
        (4, 32, "float32", None, 528),  # Qwen3.5 (vllm#40696 logs 528)
        (4, 32, "float32", 64, 576),  # the same with FlashInfer GDN prefill checkpoints
        (4, 48, "float32", None, 784),  # Qwen3.6-27B: (61,440 + 3,145,728) / 65,536 = 48.9 -> 49 * 16 (vllm#47430)
        (2, 32, "bfloat16", None, 544),  # Qwen3-Next: (49,152 + 1,048,576) / 32,768 = 33.5 -> 34 * 16
    ],
)
def test_block_size_is_vllms_align_hybrid_block_size(
    monkeypatch: pytest.MonkeyPatch, kv_heads: int, value_heads: int, ssm_dtype: str, alignment: int | None,
    expected: int,
) -> None:  # fmt: skip
    """`align_hybrid_block_size` (reproduced) against vLLM's own `Platform._align_hybrid_block_size`.

    vLLM's function runs on a config whose model class it resolves, after the model's layers exist. Here the
    model class is vLLM's `Qwen3_5ForCausalLM` where it imports (it needs einops, not in the CPU peer install),
    else a stand-in with the same two classmethods (the calculators it calls); the layer-derived inputs are
    patched: FLASH_ATTN as the only attention backend (kernel blocks MultipleOf(16), identity customize_spec)
    and the GDN layers' prefill checkpoint alignment (None for Triton, 64 for FlashInfer).
    """
    _adapter(num_pages=1)
    import torch
    import vllm.model_executor.layers.mamba.abstract as mamba_abstract
    from vllm.config import CacheConfig, ParallelConfig
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateDtypeCalculator, MambaStateShapeCalculator
    from vllm.model_executor.models import ModelRegistry
    from vllm.platforms.interface import Platform
    from vllm.v1.attention.backend import MultipleOf

    from benchmarks.compare.peer_vllm_hybrid import HybridShape, _plan, align_hybrid_block_size

    model_cls: Any
    try:
        from vllm.model_executor.models.qwen3_5 import Qwen3_5ForCausalLM as model_cls
    except ImportError:

        class model_cls:  # noqa: N801 - Qwen3_5ForCausalLM's classmethods (models/qwen3_5.py:609-640)
            @classmethod
            def get_mamba_state_dtype_from_config(cls, vc: Any) -> Any:
                cc = vc.cache_config
                return MambaStateDtypeCalculator.gated_delta_net_state_dtype(
                    vc.model_config.dtype, cc.mamba_cache_dtype, cc.mamba_ssm_cache_dtype
                )

            @classmethod
            def get_mamba_state_shape_from_config(cls, vc: Any) -> Any:
                hf = vc.model_config.hf_text_config
                return MambaStateShapeCalculator.gated_delta_net_state_shape(
                    vc.parallel_config.tensor_parallel_size, hf.linear_num_key_heads, hf.linear_num_value_heads,
                    hf.linear_key_head_dim, hf.linear_value_head_dim, hf.linear_conv_kernel_dim, 0,
                )  # fmt: skip

    class FlashAttn:
        @classmethod
        def customize_spec(cls, spec: Any) -> Any:
            return spec

        @classmethod
        def get_supported_kernel_block_sizes(cls) -> list[Any]:
            return [MultipleOf(16)]

    hf = type("HF", (), dict(linear_num_key_heads=16, linear_num_value_heads=value_heads, linear_key_head_dim=128,
                              linear_value_head_dim=128, linear_conv_kernel_dim=4))  # fmt: skip
    model_config = type("MC", (), dict(dtype=torch.bfloat16, use_mla=False, architecture="Qwen3_5ForCausalLM",
                                       hf_text_config=hf, get_num_kv_heads=staticmethod(lambda pc: kv_heads),
                                       get_head_size=staticmethod(lambda: 256)))  # fmt: skip
    cache_config = CacheConfig(block_size=16, enable_prefix_caching=True, mamba_cache_mode="align",
                               mamba_ssm_cache_dtype=ssm_dtype)  # fmt: skip
    vllm_config = type("VC", (), dict(cache_config=cache_config, model_config=model_config, speculative_config=None,
                                      parallel_config=ParallelConfig()))  # fmt: skip
    monkeypatch.setattr(ModelRegistry, "resolve_model_cls", lambda *args, **kwargs: (model_cls, "Qwen3_5ForCausalLM"))
    monkeypatch.setattr(Platform, "_find_non_ssm_backends", classmethod(lambda cls, vc: [FlashAttn]))
    monkeypatch.setattr(mamba_abstract, "get_mamba_prefill_checkpoint_alignment", lambda vc: alignment)
    Platform._align_hybrid_block_size(vllm_config, FlashAttn)
    assert (cache_config.block_size, cache_config.mamba_block_size) == (expected, expected)

    shape = HybridShape(num_kv_heads=kv_heads, linear_num_value_heads=value_heads, mamba_ssm_dtype=ssm_dtype)
    plan = _plan(shape, "flashinfer" if alignment else "triton", 65536, 8192, 0, "sha256")
    assert plan.block_size == align_hybrid_block_size(plan.mamba_state_bytes, 2 * kv_heads * 256 * 2, 16, alignment)
    assert plan.block_size == expected
    assert plan.page_bytes == cache_config.mamba_page_size_padded == expected * 2 * kv_heads * 256 * 2


@pytest.mark.parametrize(("prompt", "hit"), [(500, 0), (528, 0), (529, 528), (1056, 528), (1057, 1056)])
def test_identical_prompt_hits_whole_blocks_below_the_last_token(prompt: int, hit: int) -> None:
    """A resend of the same prompt, one request at a time. The first run's chunks end at
    floor((P - 1) / 528) * 528, whose state is kept (the replay boundary); the resend may hit at most P - 1
    tokens in whole blocks: 500 and 528 tokens -> 0 (the known below-one-block limitation, and the last-token
    rule), 529 -> 528, 1056 -> 528 (1055 allowed), 1057 -> 1056."""
    rng = np.random.default_rng(prompt)
    p = _tokens(rng, prompt)
    a = _adapter()
    res = simulate(a, [_req(0, p, 4, rng), _req(1, p, 4, rng)], SimConfig(max_num_seqs=1))
    assert res.first_hit_tokens == hit
    assert a.prefix_cache_stats() == (2 * prompt, hit, 0, 0)
    assert a.used_pages() == 0


def test_shared_1000_token_system_prompt() -> None:
    """Two requests = the same 1000-token system prompt + 50 own tokens (prompt 1050), 8 generated.

    Request 0's first chunk stops at floor(1049 / 528) * 528 = 528 and its GDN state there is kept (replay
    boundary 1049 -> block 0); tokens 528..1055 mix system prompt and own tokens, so request 1 hits 528 of its
    1000 shared tokens. Admitted together, request 1 is refused in step 1 (vLLM cannot use a GDN block cached
    by another request in the same step) and admitted in step 2 with the hit; steps: 1 (528 of request 0),
    2 (522 + 522, both sample), then 7 decode steps = 9, request-steps 1 + 2 + 14 = 17.

    Pinned blocks peak in the last step (KV for 1057 tokens): each request holds 3 attention blocks (block 0
    shared: 5 in all) and, per GDN group, its state blocks at positions 1 and 2 (the running state and the
    one it copies from): 2 * 3 * 2 = 12; 17 in all.
    """
    rng = np.random.default_rng(0)
    system = _tokens(rng, 1000)
    trace = [_req(i, np.concatenate([system, _tokens(rng, 50)]), 8, rng) for i in range(2)]
    a = _adapter()
    res = simulate(a, trace)
    assert (res.first_hit_tokens, res.steps, res.request_steps, res.peak_used_pages) == (528, 9, 17, 17)
    assert a.prefix_cache_stats() == (2100, 528, 0, 0)
    assert a.used_pages() == 0
    one = simulate(_adapter(), trace, SimConfig(max_num_seqs=1))
    assert (one.first_hit_tokens, one.steps) == (528, 9 + 8)  # request 1: hit, one chunk of 522, 7 decode


def test_refused_same_step_hit_changes_nothing() -> None:
    """The same-step rule directly: request 0 (1050-token prompt) caches block 0 while taking its first chunk;
    request 1 sharing it is refused in that step with nothing allocated, and admitted next step with the hit
    (528, 1050 - 528 = 522: the chunk ends at the prompt's end, past the last cacheable boundary 528)."""
    rng = np.random.default_rng(1)
    system = _tokens(rng, 1000)
    r0, r1 = (_req(i, np.concatenate([system, _tokens(rng, 50)]), 4, rng) for i in range(2))
    a = _adapter()
    a.new_step()
    assert a.admit(r0, 8192) == (0, 528)
    used = a.used_pages()
    assert used == 4  # one attention block + one state block per GDN group
    assert a.admit(r1, 8192 - 528) is None
    assert a.used_pages() == used
    r0.num_computed = 528
    a.advance([(r0, 528)])
    assert _step(a, r1) == (528, 522)


def test_multi_turn_conversation() -> None:
    """Turn 1: 600-token prompt + 500 generated (1100 tokens); turn 2: those 1100 + 200 (prompt 1300) + 10
    generated; turn 3: turn 2's 1310 tokens + 300 (prompt 1610) + 10 generated.

    vLLM's default retention: turn 1's first chunk stops at floor(599 / 528) * 528 = 528, the state kept there;
    its answer completes attention block 1 (at 1056) but that GDN state is not kept. Turn 2: attention hits
    1056, GDN 528: hit 528 and a junction at 1056; its chunks [528, 1056) (the junction, also floor(1299 / 528)
    * 528) and [1056, 1300), the state at 1056 kept. Turn 3 hits 1056 (block 2 never filled: 1310 < 1584).
    Hits 0 + 528 + 1056 = 1584 of 600 + 1300 + 1610 = 3510. Steps: turn 1 2 + 499, turn 2 2 + 9, turn 3
    [1056, 1584) (floor(1609 / 528) * 528) and [1584, 1610), + 9: 501 + 11 + 11 = 523.

    retention_interval=None keeps every GDN block state: turn 1's state at 1056 (written while decoding)
    too, so turn 2 hits 1056 and runs one chunk: 0 + 1056 + 1056 = 2112, steps 501 + 10 + 11 = 522.
    """
    rng = np.random.default_rng(2)
    t1 = _req(0, _tokens(rng, 600), 500, rng)
    t2 = _req(1, np.concatenate([t1.tokens, _tokens(rng, 200)]), 10, rng, after=0)
    t3 = _req(2, np.concatenate([t2.tokens, _tokens(rng, 300)]), 10, rng, after=1)
    a = _adapter()
    res = simulate(a, [t1, t2, t3])
    assert (res.first_prompt_tokens, res.first_hit_tokens, res.steps) == (3510, 1584, 523)
    assert a.prefix_cache_stats() == (3510, 1584, 0, 0)
    dense = simulate(_adapter(retention_interval=None), [t1, t2, t3])
    assert (dense.first_hit_tokens, dense.steps) == (2112, 522)


def test_shared_prefix_junction_is_checkpointed() -> None:
    """Sparse retention and the junction stop, one request at a time, 4 generated each.

    A = S (1200) + 100 own (prompt 1300): chunks stop at floor(1299 / 528) * 528 = 1056, so its GDN state is
    kept at 1056 only; attention caches blocks 0 and 1. B = S[:700] + 900 own (prompt 1600): attention hits
    block 0 (528) but no GDN state exists at 528: hit 0, and get_computed_blocks reports the shared prefix
    528 as a junction. The split stops B's first chunk there (scheduler.py:632-662) and the junction's state is
    kept; then [528, 1584) (floor(1599 / 528) * 528) and [1584, 1600). C = S[:700] + 100 own (prompt 800) hits
    528 thanks to B. Steps: A 2 + 3, B 3 + 3, C 1 + 3 = 15.

    retention_interval=None (keep every GDN block state) changes nothing here: A's first chunk ran through
    528, so no state at 528 ever existed for it to keep.
    """
    rng = np.random.default_rng(3)
    s = _tokens(rng, 1200)
    trace = [_req(0, np.concatenate([s, _tokens(rng, 100)]), 4, rng),
             _req(1, np.concatenate([s[:700], _tokens(rng, 900)]), 4, rng),
             _req(2, np.concatenate([s[:700], _tokens(rng, 100)]), 4, rng)]  # fmt: skip
    one = SimConfig(max_num_seqs=1)
    res = simulate(_adapter(), trace, one)
    assert (res.first_hit_tokens, res.steps) == (528, 15)
    dense = simulate(_adapter(retention_interval=None), trace, one)
    assert (dense.first_hit_tokens, dense.steps) == (528, 15)


def test_running_chunks_are_clipped_to_block_boundaries() -> None:
    """`clip_chunk` is vLLM's split for a running request. A 1300-token prompt admitted under a 600-token
    budget runs [0, 528) (600 cut to a boundary). Then: offered 100 -> 0 (628 is not a boundary and 528 is
    where it starts), 600 -> 528 (1128 cut to 1056), 772 -> 528 (the prompt's end, but the last cacheable
    boundary floor(1299 / 528) * 528 = 1056 is inside); at 1056, 244 -> 244; in decode 1 -> 1. Admitted with
    the whole budget, the first chunk stops at that boundary: [0, 1056)."""
    rng = np.random.default_rng(4)
    r = _req(0, _tokens(rng, 1300), 2, rng)
    a = _adapter()
    assert _step(a, r, budget=600) == (0, 528)
    assert [a.clip_chunk(r, n) for n in (100, 600, 772)] == [0, 528, 528]
    a.new_step()
    assert a.extend(r, 528)
    r.num_computed = 1056
    a.advance([(r, 528)])
    assert a.clip_chunk(r, 244) == 244
    a.new_step()
    assert a.extend(r, 244)
    r.num_computed, r.num_output = 1300, 1
    a.advance([(r, 244)])
    assert a.clip_chunk(r, 1) == 1
    assert _step(_adapter(), _req(1, r.tokens[:1300], 2, rng)) == (0, 1056)


def test_small_token_budget() -> None:
    """A 1300-token prompt under a 600-token step budget: 600 -> 528 (cut to a boundary), 600 -> 528
    (1128 cut to 1056), 244 (the end). Then 1 decode step: 4 steps."""
    rng = np.random.default_rng(5)
    res = simulate(_adapter(max_num_batched_tokens=600), [_req(0, _tokens(rng, 1300), 2, rng)],
                   SimConfig(max_num_batched_tokens=600))  # fmt: skip
    assert (res.steps, res.prefill_tokens_computed) == (4, 1300)


def test_running_request_skipped_when_budget_is_short() -> None:
    """The driver skips a running request whose chunk vLLM clips to 0 (scheduler.py:871-887).

    R (prompt S (1200) + 100 own, 2 generated) finishes in 3 steps and leaves attention blocks 0 and 1 and a
    GDN state at 1056 only. X = S[:700] + 9300 own (prompt 10,000) and B (20,000 own tokens) follow it.
    Step 4: X hits 0 with a junction at 528: its chunk stops there; B gets 8192 - 528 = 7664 -> 7392 (14
    blocks). Step 5: X gets 8192, cut to 8448 - 528 = 7920; B is offered 272 -> 0 and skipped. Step 6: X
    runs [8448, 9504) (the last cacheable boundary, floor(9999 / 528) * 528) = 1056; B gets 7136 -> 6864.
    """
    rng = np.random.default_rng(6)
    s = _tokens(rng, 1200)
    trace = [_req(0, np.concatenate([s, _tokens(rng, 100)]), 2, rng),
             _req(1, np.concatenate([s[:700], _tokens(rng, 9300)]), 2, rng, after=0),
             _req(2, _tokens(rng, 20_000), 2, rng, after=0)]  # fmt: skip
    a = _adapter(num_pages=400)
    calls: list[tuple[int, int, int]] = []
    clip = a.clip_chunk

    def recording_clip(req: TraceRequest, n: int) -> int:
        got = int(clip(req, n))
        calls.append((req.rid, n, got))
        return got

    a.clip_chunk = recording_clip
    res = simulate(a, trace)
    assert res.first_hit_tokens == 0
    after_r = [c for c in calls if c[0] != 0]
    assert after_r[:4] == [(1, 8192, 7920), (2, 272, 0), (1, 1552, 1056), (2, 7136, 6864)]
    assert a.used_pages() == 0


def test_flashinfer_checkpoints_inside_one_chunk() -> None:
    """With FlashInfer GDN prefill (block 576) the backend exports the state at floor(1049 / 576) * 576 = 576
    from inside the chunk, so the 1050-token prompt runs in one chunk (scheduler.py:587-606), and the next
    request sharing the 1000-token system prompt hits 576."""
    rng = np.random.default_rng(7)
    system = _tokens(rng, 1000)
    r0, r1 = (_req(i, np.concatenate([system, _tokens(rng, 50)]), 4, rng) for i in range(2))
    a = _adapter(gdn_prefill_backend="flashinfer")
    assert _step(a, r0) == (0, 1050)
    assert _step(a, r1) == (576, 474)


def test_few_pages_preempt_and_complete() -> None:
    """Two requests of 1000 own tokens, 100 generated, 12 blocks (pinned counts are after each step).

    Step 1: both take their first chunk (stop at floor(999 / 528) * 528 = 528): 1 attention block and 1 state
    block per GDN group each, 8. Step 2: request 0's [528, 1000) takes attention block 1 and a state block per
    group: 12; request 1 needs as many: preempted, its blocks back in the free queue, still cached (attention
    block 0, states at 528: its replay boundary). Step 3 on: request 0 decodes holding 5 (its states at 528
    released); request 1 with its 528 hit needs its 4 cached blocks back plus 4 new, 8 > 7 free: it waits.
    Step 59: request 0 (KV for 1057 tokens) takes attention block 2 and a state block per group from the head
    of the free queue, request 1's cached blocks (freed first): 9. Step 60: request 0 releases its states at
    1056 (not kept): 6; request 1, no hit now, needs 4: admitted, 10 (the peak). Step 61: request 1 needs 4
    more, 2 are free: preempted again, its first chunk cached again. Request 0 finishes in step 101 (2 chunks
    + 99 decode, allocating nothing more); request 1 returns in step 102, hits 528 and runs [528, 1000) + 99
    decode: 201 steps, 2 preemptions, re-admissions 2 x 1000 tokens queried, 0 + 528 hit.
    """
    rng = np.random.default_rng(8)
    trace = [_req(i, _tokens(rng, 1000), 100, rng) for i in range(2)]
    a = _adapter(num_pages=12)
    res = simulate(a, trace)
    assert (res.preemptions, res.steps, res.first_hit_tokens, res.peak_used_pages) == (2, 201, 0, 10)
    assert a.prefix_cache_stats() == (2000, 0, 2000, 528)
    assert a.used_pages() == 0
