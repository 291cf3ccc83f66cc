"""Pages that only hold recurrent-state checkpoints are cached pages, not used ones: an idle engine of a hybrid
model reads 0 used pages and reports its checkpoints' pages apart (`checkpoint_pages`: in the summary, the
manager's metrics and the Prometheus exporter), and a request that needs every page of a pool the checkpoints
fill is admitted (they are evicted) and runs at parity."""

from __future__ import annotations

import copy

import pytest
import torch
from state_models import build_state_model
from test_state_models import NEW_TOKENS, check_parity

from pagedkv.engine import LLMEngine

PS = 4
HYBRIDS = ["qwen3_5_text", "olmo_hybrid", "lfm2", "falcon_h1"]  # gated delta net, short convolutions, Mamba2


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def checkpoint_pages_by_hand(engine: LLMEngine) -> tuple[int, int]:
    """(pages the attention pool counts as referenced, pages checkpoints take) of an idle engine, counted from
    the checkpoints themselves: every run's pages plus every distinct tail page (which only they reference)."""
    states = engine.manager._managers[0].states
    entries = list(states._entries.values())
    tails = {page for e in entries for page in e.pages}
    return engine.manager._managers[0].pool.num_used, sum(len(e.run) for e in entries) + len(tails)


@pytest.mark.parametrize("model_type", HYBRIDS)
def test_an_idle_engine_uses_no_page_and_counts_its_checkpoints_pages_apart(model_type: str) -> None:
    engine = LLMEngine.from_hf(build_state_model(model_type, seed=5), page_size=PS, num_pages=256)
    for n in (4, 9, 17, 25, 36):  # prompt ends inside pages and on a boundary, releases likewise
        engine.generate([tokens(n, n)], max_new_tokens=3, stop_token_ids=[])
    referenced, held = checkpoint_pages_by_hand(engine)
    summary, metrics = engine.summary, engine.manager.get_metrics()
    assert referenced > 0 and summary["state_checkpoints"] == 10  # the tail pages the pool counts as referenced
    assert summary["used_pages"] == metrics.used_pages == engine.manager.get_num_used_pages() == 0
    assert summary["checkpoint_pages"] == metrics.checkpoint_pages == held > referenced
    assert engine.manager.get_metrics_aggregated().checkpoint_pages == held
    assert engine.manager.num_free_blocks() == engine.manager.total_num_pages == 256
    engine.manager.check_integrity()


def test_the_prometheus_exporter_reports_checkpoint_pages() -> None:
    prometheus_client = pytest.importorskip("prometheus_client")
    from prometheus_client.parser import text_string_to_metric_families

    from pagedkv.observability import PagedKVCollector

    engine = LLMEngine.from_hf(build_state_model("lfm2", seed=5), page_size=PS, num_pages=64)
    engine.generate([tokens(9, 1), tokens(14, 2)], max_new_tokens=3, stop_token_ids=[])
    registry = prometheus_client.CollectorRegistry()
    registry.register(PagedKVCollector(engine.manager))
    text = prometheus_client.generate_latest(registry).decode()
    device = {
        s.name: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.labels == {"tier": "device", "replica": "0"} and s.name.startswith("pagedkv_pages_")
    }
    held = checkpoint_pages_by_hand(engine)[1]
    assert held == engine.summary["checkpoint_pages"] > 0
    assert device == {"pagedkv_pages_used": 0, "pagedkv_pages_free": 64, "pagedkv_pages_capacity": 64,
                      "pagedkv_pages_cached": engine.manager.get_metrics().cached_pages,
                      "pagedkv_pages_checkpoint": held}  # fmt: skip


def test_a_request_that_needs_every_page_evicts_the_checkpoints_that_fill_the_pool() -> None:
    """42 pages of 4 tokens; a checkpoint of this model takes a run of 10. Two requests leave three checkpoints
    (31 pages: three runs and one tail page) and cached prefix pages: nothing is used. A request of 164 + 5
    tokens needs all 42 pages: its admission evicts the checkpoints (runs by the pool's policy, the tail by
    `reclaim`) and it runs at parity with one full forward of transformers."""
    model = build_state_model("qwen3_5_text", seed=3)
    ref = copy.deepcopy(model)
    engine = LLMEngine.from_hf(model, page_size=PS, num_pages=42, max_num_batched_tokens=32, record_logits=True)
    states = engine.manager._managers[0].states
    assert states.run_pages == 10
    for i, n in enumerate((6, 9)):
        engine.generate([tokens(n, i)], max_new_tokens=3, stop_token_ids=[])
    summary = engine.summary
    assert (summary["used_pages"], summary["checkpoint_pages"], summary["state_checkpoints"]) == (0, 31, 3)
    assert engine.manager.num_free_blocks() == 42
    dropped = states.num_dropped
    big = tokens(42 * PS - NEW_TOKENS + 1, 99)  # its last token is never fed back: 168 slots, 42 pages
    request = engine.add_request(big, NEW_TOKENS, stop_token_ids=[])
    engine.run()
    assert len(request.output) == NEW_TOKENS and engine.summary["preemptions"] == 0
    assert states.num_dropped >= dropped + 3  # every checkpoint that held a page was evicted
    check_parity("qwen3_5_text", ref, [big], [request])
    assert engine.summary["used_pages"] == 0
    engine.manager.check_integrity()
