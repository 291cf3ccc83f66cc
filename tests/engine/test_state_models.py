"""Models with recurrent state (gated delta net, Mamba2, Mamba1, short conv) run exactly on pagedkv's state slots.

The reference is the model's own definition: one full forward of transformers over prompt + output, with
no cache (transformers' incremental decode drifts from it on some of these models). Per model type:
prompts of 1 to 60 tokens, a token budget of 13 per step (prefills cut at odd places, steps mixing
prefill chunks and decodes), fp32 logits within 1e-3 of the reference at every generated position
(measured: ~1e-5) and greedy tokens equal to its argmax; then the same in the smallest pool any one
request fits, so requests are preempted and their state recomputed.
"""

from __future__ import annotations

import copy
import dataclasses
import os

import pytest
import torch
from state_models import STATE_MODELS, build_state_model

from pagedkv.core import memory
from pagedkv.core.errors import InsufficientBlocksError
from pagedkv.core.groups import manager_for, min_request_pages
from pagedkv.engine import LLMEngine
from pagedkv.engine.request import Request
from pagedkv.hf.config import kv_layout
from pagedkv.manager.paged import PagedKVCacheManager
from pagedkv.params.multi import MultiKVCacheParams
from pagedkv.params.state import StateCacheParams

NEW_TOKENS = 5
TOLERANCE = 1e-3
LENGTHS = (1, 2, 3, 7, 16, 29, 44, 60)
WORST: dict[str, float] = {}  # model type -> worst logit difference (printed with PAGEDKV_PRINT_WORST=1)


def prompts(seed: int = 7) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (n,), generator=g).tolist() for n in LENGTHS]


def reference(model: torch.nn.Module, prompt: list[int], output: list[int]) -> torch.Tensor:
    """[N, V]: the logits of each generated position from one full forward over prompt + output (no cache)."""
    ids = torch.tensor([prompt + output[:-1]])
    with torch.inference_mode():
        logits = model(input_ids=ids, use_cache=False).logits[0].float()  # [L, V]
    return logits[len(prompt) - 1 :]


def run(engine: LLMEngine, batch: list[list[int]]) -> list[Request]:
    requests = [engine.add_request(p, NEW_TOKENS, stop_token_ids=[]) for p in batch]
    engine.run()
    return requests


def check_parity(model_type: str, ref: torch.nn.Module, batch: list[list[int]], requests: list[Request]) -> float:
    worst = 0.0
    for prompt, request in zip(batch, requests, strict=True):
        assert len(request.output) == NEW_TOKENS
        expected = reference(ref, prompt, request.output)  # [N, V]
        got = torch.stack(request.logits)  # [N, V]
        worst = max(worst, float((got - expected).abs().max()))
        assert request.output == expected.argmax(-1).tolist(), (model_type, len(prompt))
    assert worst <= TOLERANCE, (model_type, worst)
    WORST[model_type] = max(WORST.get(model_type, 0.0), worst)
    if os.environ.get("PAGEDKV_PRINT_WORST"):
        print(f"\n{model_type}: worst logit difference {worst:.2e}")
    return worst


@pytest.mark.parametrize("model_type", sorted(STATE_MODELS))
def test_state_model_matches_one_full_forward(model_type: str) -> None:
    model = build_state_model(model_type, seed=1)
    ref = copy.deepcopy(model)
    engine = LLMEngine.from_hf(model, page_size=4, num_pages=512, max_num_batched_tokens=13, record_logits=True)
    batch = prompts()
    requests = run(engine, batch)
    check_parity(model_type, ref, batch, requests)
    summary = engine.summary
    leaves = engine.manager.params.leaves()
    state_leaves = [leaf for leaf in leaves if type(leaf).__name__ == "StateCacheParams"]
    assert summary["state_layers"] == sum(leaf.num_layers for leaf in state_leaves) > 0
    expected = sum(leaf.num_layers * leaf.spec.state_content_size_bytes for leaf in state_leaves)
    assert summary["state_bytes_per_request"] == expected  # one slot per layer, no draft slots
    assert summary["state_rows_per_request"] == 1  # one row holds every state layer's state
    states = engine.manager._managers[0].states
    runs = memory.checkpoint_pages(engine.manager.params)
    # a live row per batch slot; checkpoints take runs of attention pages, or (state layers only) 2 rows per slot
    assert summary["state_rows"] == 32 + (0 if runs else 64) and states.run_pages == runs
    ends = sum(len(p) > 1 for p in batch)  # each prompt's end, before its last token (none for a 1-token prompt)
    assert states.num_saved == ends + len(batch)  # and each release
    assert summary["state_checkpoints"] == len(states) <= 2 * len(batch)  # (runs: the pool's LRU evicts some)
    assert not runs or engine.manager._managers[0].pool.num_cached >= len(states) * runs
    assert summary["preemptions"] == 0 and summary["used_pages"] == 0  # (checkpoints' pages are cached, not used)
    assert engine.manager.num_free_blocks() == engine.manager.total_num_pages


@pytest.mark.parametrize("model_type", sorted(STATE_MODELS))
def test_state_model_recomputes_its_state_after_preemption(model_type: str) -> None:
    """A pool that admits the first two requests but not their growth: the first one's next page preempts
    the other (recompute: its state slot is released and its state computed again from its tokens)."""
    model = build_state_model(model_type, seed=2)
    ref = copy.deepcopy(model)
    leaves = kv_layout(model.config, model=model, page_size=4).params.leaves()
    groups = [manager_for(g, leaf.kv_cache_spec) for g, leaf in enumerate(leaves)]
    ps = leaves[0].page_size
    g = torch.Generator().manual_seed(11)
    lengths = [ps - 2, 2 * ps - 1, ps + 1, 2 * ps - 2]  # the first one fills its page after two tokens
    batch = [torch.randint(3, 128, (n,), generator=g).tolist() for n in lengths]
    single = max(
        max(min_request_pages(groups, len(p), NEW_TOKENS), min_request_pages(groups, len(p) + NEW_TOKENS - 1, 1))
        for p in batch
    )
    admitted = sum(min_request_pages(groups, n, 1) for n in lengths[:2])
    engine = LLMEngine.from_hf(
        model, page_size=4, num_pages=max(1, single, admitted), max_num_batched_tokens=4 * ps, record_logits=True
    )  # (a model of state layers only takes no attention page: one placeholder)
    requests = run(engine, batch)
    check_parity(model_type, ref, batch, requests)
    if any(manager.state_slots == 0 for manager in groups):  # attention pages grow: someone was preempted
        assert engine.summary["preemptions"] > 0, model_type


def test_state_models_take_tiers_below_the_device_but_are_never_swapped() -> None:
    """A host tier serves a model with recurrent state by hash (pages and state checkpoints, a third of the rows
    for checkpoint images); preemption recomputes from the checkpoint its release saves, never swaps."""
    model = build_state_model("bamba")
    engine = LLMEngine.from_hf(model, page_size=4, num_pages=32, kv_connector="local", host_kvcache_swap_space_gb=0.01)
    manager = engine.manager
    assert engine.preemption_mode == "recompute" and not manager.can_swap
    stats = manager.tier_stats()
    assert sorted(stats) == ["host", "host_states"]
    pages = manager.tiers.connectors[0]
    images = manager.tiers.state_connectors[0]
    row = pages.mover.row_bytes
    page_bytes = pages.num_host_blocks * row
    image_bytes = images.num_host_blocks * images.mover.row_bytes
    total = int(0.01 * 2**30) // row * row  # the swap space in whole pages
    assert images.num_host_blocks == total // 3 // images.mover.row_bytes > 0
    assert page_bytes + image_bytes <= total < page_bytes + image_bytes + row
    with pytest.raises(ValueError, match="a model with recurrent state is not swapped"):
        LLMEngine.from_hf(build_state_model("bamba"), page_size=4, num_pages=32, kv_connector="local",
                          host_kvcache_swap_space_gb=0.01, preemption_mode="swap")  # fmt: skip


def test_a_state_spec_that_does_not_match_the_model_is_refused_untouched() -> None:
    model = build_state_model("bamba")
    layout = kv_layout(model.config, model=model, page_size=4)
    leaves = layout.params.leaves()
    group, _ = layout.state_map[0]
    bad = dataclasses.replace(leaves[group].spec, shapes=((5, 3), (4, 32, 16)))
    children = dict(layout.params.children)
    name = list(children)[group]
    children[name] = StateCacheParams.from_spec(bad, leaves[group].num_layers, leaves[group].devices,
                                                page_size=leaves[group].page_size)  # fmt: skip
    manager = PagedKVCacheManager(MultiKVCacheParams(children), None, 64, max_batch_size=4)
    forwards = {name: m.forward for name, m in model.named_modules()}
    with pytest.raises(ValueError, match=r"state group \d+ \(layer 0, model.layers.0.mamba\) has state shapes"):
        LLMEngine(model, manager, layer_map=layout.layer_map, state_map=layout.state_map)
    with pytest.raises(ValueError, match=r"state_map has layers \[0, 1\] but the model's recurrent mixers are at"):
        LLMEngine(
            model, manager, layer_map=layout.layer_map, state_map={0: layout.state_map[0], 1: layout.state_map[1]}
        )
    assert {name: m.forward for name, m in model.named_modules()} == forwards  # nothing was wrapped


def test_a_request_whose_state_slot_was_released_gets_a_clear_error() -> None:
    model = build_state_model("mamba")
    engine = LLMEngine.from_hf(model, page_size=4, num_pages=8)
    request = engine.add_request([5, 6, 7], 2)
    engine.step()  # prefill: the request holds its slot
    engine.manager.release(request.ctx.request_id)
    with pytest.raises(ValueError, match="not claimed"):
        engine.manager.runtime_inputs([[request.ctx]])
    assert engine.manager.num_free_blocks() == 8


@pytest.mark.parametrize("model_type", ["mamba", "qwen3_5_text"])
def test_a_step_that_fails_midway_is_recomputed_not_replayed_on_moved_states(model_type: str) -> None:
    """A forward that raises after some layers updated their slots in place: the engine releases and
    recomputes every request, so retrying gives the tokens and logits of a run that never failed."""
    model = build_state_model(model_type, seed=4)
    ref = copy.deepcopy(model)
    engine = LLMEngine.from_hf(model, page_size=4, num_pages=64, record_logits=True)
    batch = prompts(seed=5)[2:5]
    requests = [engine.add_request(p, NEW_TOKENS, stop_token_ids=[]) for p in batch]
    engine.step()
    engine.step()
    layers = model.backbone.layers if model_type == "mamba" else model.model.layers
    failing = {"left": 1}

    def fail_once(module: torch.nn.Module, args: object, output: object) -> None:
        if failing["left"]:
            failing["left"] -= 1
            raise RuntimeError("device lost")

    handle = layers[-1].register_forward_hook(fail_once)
    with pytest.raises(RuntimeError, match="device lost"):
        engine.step()  # every layer but the last has moved its states on by one token
    handle.remove()
    assert not engine.scheduler.running and all(r.ctx.tokens.processed_length == 0 for r in requests)
    pool = engine.manager._managers[0].pool  # prompt-end checkpoints hold their tails (cached, not used)
    assert pool.num_used == len(engine.manager._managers[0].states.tail_refs())  # every slot released
    assert engine.manager.num_free_blocks() == engine.manager.total_num_pages and engine.summary["used_pages"] == 0
    engine.run()
    check_parity(model_type, ref, batch, requests)


def test_a_memory_budget_pays_for_the_state_rows_then_buys_attention_pages() -> None:
    """The attention page keeps its size; a budget first pays for the state rows (a live row per batch slot),
    then buys budget // page attention pages; checkpoints take runs of those pages (`max_state_checkpoints`
    caps how many)."""
    model = build_state_model("qwen3_5_text")
    params = kv_layout(model.config, model=model, page_size=4).params
    assert params.page_size == 4  # no growth to a state's size
    page = memory.pool_page_bytes(params)
    row = memory.state_row_bytes(params)
    assert row == sum(-(-leaf.bytes_per_block_per_device // 8) * 8 for leaf in params.leaves()
                      if isinstance(leaf, StateCacheParams))  # fmt: skip
    engine = LLMEngine.from_hf(model, page_size=4, memory_budget=4 * row + 100 * page + 5, max_batch_size=4,
                               max_state_checkpoints=3)  # fmt: skip
    assert engine.manager.total_num_pages == 100 and engine.manager.num_state_rows == 4
    (arena,) = engine.manager.get_device_buffer(0).to_memory()  # one TP shard: one attention arena
    assert arena.buffer.shape == (101, page)  # 100 pages + the null page
    assert engine.manager.get_device_buffer(0).state_arenas[0].shape == (5, row)  # 4 rows + the null row
    states = engine.manager._managers[0].states
    assert states.run_pages == -(-row // page) and states.max_checkpoints == 3
    with pytest.raises(InsufficientBlocksError, match="cannot hold the 4 state rows"):
        LLMEngine.from_hf(build_state_model("qwen3_5_text"), page_size=4, memory_budget=4 * row - 1,
                          max_batch_size=4, max_state_checkpoints=3)  # fmt: skip


def test_a_copy_of_a_served_model_runs_its_own_mixers() -> None:
    """The mixers' forwards are bound to their modules: a deep copy calls the copy's mixers, inside an
    engine step and outside one."""
    model = build_state_model("mamba")
    LLMEngine.from_hf(model, page_size=4, num_pages=8)
    twin = copy.deepcopy(model)
    mixers = [m for m in twin.modules() if type(m).__name__ == "MambaMixer"]
    assert mixers and all(m.forward.__self__ is m for m in mixers)
    with torch.no_grad():
        for mixer in mixers:
            mixer.out_proj.weight.zero_()  # the copy's mixers add nothing to the residual stream
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.inference_mode():
        plain = twin.backbone.embeddings(ids)
        for layer in twin.backbone.layers:
            assert torch.equal(layer.mixer(layer.norm(plain)), torch.zeros_like(plain))
    engine = LLMEngine.from_hf(twin, page_size=4, num_pages=8, record_logits=True)
    (request,) = run(engine, [[5, 6, 7, 8]])
    assert torch.allclose(torch.stack(request.logits), reference(twin, [5, 6, 7, 8], request.output), atol=1e-5)


def test_the_step_context_gives_the_scans_host_offsets() -> None:
    """The scans read a step's request offsets on the host: a CUDA step must not synchronise once per layer."""
    from pagedkv.hf.context import StateContext

    model = build_state_model("bamba")
    engine = LLMEngine.from_hf(model, page_size=4, num_pages=32)
    a, b = engine.add_request([5, 6, 7], 2), engine.add_request([8, 9], 2)
    for r in (a, b):
        engine.scheduler.waiting.remove(r)
        engine.manager.claim(r.request_id)
        engine.manager.alloc(r.ctx)
    tree = engine.manager.runtime_inputs([[a.ctx, b.ctx]])
    records = {g: list(tree.children.values())[g].inputs[0] for g in engine._state_groups}
    context = StateContext.build(records, torch.tensor([0, 3, 5]), engine.state_map)
    for batch in context.batches.values():
        assert batch.host_offsets is not None and batch.host_offsets.device.type == "cpu"
        assert batch.scan_offsets.tolist() == [0, 3, 5] == batch.input_row_offsets.tolist()
        assert batch.lengths == [3, 2] and not batch.decode
    assert context.positions.tolist() == [0, 1, 2, 0, 1]
