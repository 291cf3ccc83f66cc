"""Hostile inputs: every row of `hostile_cases.CASES` gets exactly its error, and changes nothing.

Per row: the exception type is exact (not a subclass), its message holds the expected fragment, and the
observable state after the call equals the state before (for a manager: every replica's pool, prefix
cache, tables, metrics and contexts, the counters, the host tier, the bytes of every page). Rows that are
accepted on purpose (NaN/inf KV under "pass", a tier holding another layout's pages) check their outcome
instead. `docs/HOSTILE_INPUTS.md` must be `render_markdown()` (PAGEDKV_WRITE_DOCS=1 rewrites it).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hostile_cases import CASES, Case, render_markdown, run_case, tier_miss

DOCS = Path(__file__).resolve().parents[2] / "docs" / "HOSTILE_INPUTS.md"


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_hostile_input(case: Case) -> None:
    outcome = run_case(case)
    if case.error is None:
        assert outcome.error is None, f"{case.id}: expected no error, got {outcome.error!r}"
    else:
        assert type(outcome.error) is case.error, f"{case.id}: expected {case.error.__name__}, got {outcome.error!r}"
        assert case.fragment in str(outcome.error), f"{case.id}: {str(outcome.error)!r} lacks {case.fragment!r}"
    if case.unchanged:
        assert outcome.after == outcome.before, f"{case.id}: the failing call changed the state"


def test_every_entry_point_and_input_class_is_covered() -> None:
    entries = {c.entry if c.entry.startswith("ops.") else c.entry.split(".")[0] for c in CASES}
    for name in ("KVCacheParams", "MultiKVCacheParams", "KVConnectorConfig", "KVCacheBuffer", "PagedKVCacheManager",
                 "TextContext", "BlockManager", "hash_tokens", "ops.store_kv", "ops.paged_attention", "LLMEngine",
                 "KVConnector", "kv_connector=tiered"):  # fmt: skip
        assert name in entries, name
    methods = {c.entry for c in CASES}
    for method in ("claim", "alloc", "step", "release", "runtime_inputs", "pin_prefix", "reset_prefix_cache",
                   "swap_out", "swap_in", "get_req_blocks"):  # fmt: skip
        assert f"PagedKVCacheManager.{method}" in methods, method
    kinds = {c.kind for c in CASES}
    assert len(kinds) >= 15 and len(CASES) >= 150, (len(kinds), len(CASES))


def test_tier_control_loads_the_pages_of_the_same_layout() -> None:
    """The tier rows' control: a reader with the writer's layout and model loads every hashed page (3 of
    4 tokens), so the rows' misses come from the mismatch, not from a tier that never loads."""
    trial = tier_miss()()
    try:
        reader = trial.call()
        assert reader.cached_prefix_length == 12 and reader.tokens.processed_length == 12
    finally:
        trial.close()


def test_docs_table_is_current() -> None:
    text = render_markdown()
    if os.environ.get("PAGEDKV_WRITE_DOCS") == "1":
        DOCS.write_text(text)
    assert DOCS.exists(), "docs/HOSTILE_INPUTS.md is missing: run with PAGEDKV_WRITE_DOCS=1"
    assert DOCS.read_text() == text, "docs/HOSTILE_INPUTS.md is stale: run with PAGEDKV_WRITE_DOCS=1"
