"""Hostile inputs: every public entry point, each class of bad input, and what it gets.

`CASES` is the table, one `Case` per (entry point, input class). A case's `setup()` builds fresh
objects and returns a `Trial`: the bad call, and a function returning everything observable that the
call must leave as it was (a manager's pools, prefix caches, tables and page bytes; a context's
tokens; a buffer's bytes). `run_case` runs a case once per process: state, call, state again.
`render_markdown()` renders the table with the message each case really got: it is
docs/HOSTILE_INPUTS.md (`test_hostile_inputs.py` checks that; PAGEDKV_WRITE_DOCS=1 rewrites it).

Rows whose `error` is None are inputs that are accepted on purpose: NaN/inf KV under
``nonfinite_kv="pass"`` (stored as is), and pages a tier directory holds for another layout or model
(never loaded: a miss). Their `check` asserts that outcome.

The rows live in `hostile_rows_params`, `hostile_rows_manager` and `hostile_rows_ops_engine` (in that
order); the types, `run_case` and the builders in `hostile_support` and `hostile_beds`.
"""

from __future__ import annotations

from hostile_beds import tier_miss
from hostile_rows_manager import MANAGER_ROWS
from hostile_rows_ops_engine import OPS_ENGINE_ROWS
from hostile_rows_params import PARAMS_ROWS
from hostile_support import Case, Outcome, Trial, run_case

__all__ = ["CASES", "Case", "Outcome", "Trial", "message_of", "render_markdown", "run_case", "tier_miss"]

# ----------------------------------------------------------------- the table
CASES: list[Case] = [*PARAMS_ROWS, *MANAGER_ROWS, *OPS_ENGINE_ROWS]


# ----------------------------------------------------------------- docs
DOCS_HEADER = """# Hostile inputs

Every public entry point rejects bad input with a clear error and changes nothing: the exception type
is exact, the message names the argument, the value and the limit, and the state after the call (pool,
prefix cache, request tables, contexts, page bytes, host tier) equals the state before. `InsufficientBlocksError`
is for capacity, `TypeError` for a wrong type, `ValueError` for a bad value. NaN/inf KV is a policy:
`KVCacheParams(nonfinite_kv="reject")` makes `ops.store_kv` (every backend, and so the engine) raise
before writing anything; `"pass"` (the default) stores it as is and costs nothing.

`ops.store_kv` writes a request's rows only into that request's own pages: it needs a value exactly when
the pages hold one (K+V, not MLA), and reads the row offsets on the host (a sync on a GPU): 1-D, one more
entry than requests, starting at 0, never decreasing, ending at the key's rows, no request longer than
the batch's longest (`max_lengths`), and every new token's position on a page of its lookup-table row,
never on the null page. The engine's per-step path (`ops.PagedStep.store`) checks the model's K/V
against the pages' `[H_kv, D]` once per step, and `LLMEngine.from_hf` takes the page layout from what the
attention modules compute, never from config attributes the model does not use (docs/MODELS.md).

Generated from `tests/hardening/hostile_cases.py` (`render_markdown()`); each message is the one the
case really raised, cut at {width} characters. `tests/hardening/test_hostile_inputs.py` runs every row
and checks this file; `PAGEDKV_WRITE_DOCS=1 pytest tests/hardening/test_hostile_inputs.py` rewrites it.

{count} cases over {entries} entry points and {classes} input classes ({class_list}).

| entry point | input class | example | error | message |
|---|---|---|---|---|
"""
DOCS_FOOTER = """
## Beyond one argument: models, tiers, processes and the wire

The table above checks one bad argument at a time. These cases come from using pagedkv as a user or an
attacker would; each row has a test that failed before the fix it names.

| case | what pagedkv does | test |
|---|---|---|
| a config attribute the model does not use (`num_key_value_heads` on GPT-2, GPT-NeoX, GPT-J, CodeGen, Persimmon, OPT; `head_dim`) | the page layout is what the attention modules compute, observed in one 2-token forward that leaves the model as it was: tokens and logits equal transformers' `generate()` | `tests/engine/test_stray_config.py` |
| a config `sliding_window` / `layer_types` the model's attention does not apply | `from_hf` refuses, naming the layer, both windows and the attribute to change: transformers' own cache keeps the config's window, so the model has two answers | `tests/engine/test_stray_config.py`, `test_layout_from_modules.py` |
| K/V of another `[H_kv, D]` than the pages (an engine built over pages of another layout) | `PagedStep.store` refuses at the step's first store, once per step, before a byte is written | `tests/engine/test_layout_from_modules.py`, `tests/ops/test_store_checks.py` |
| `ops.store_kv(key, None, ...)` on K+V pages; a value on MLA pages; offsets of the wrong shape, not starting at 0, decreasing, not ending at the key's rows, or putting a row past its request's pages or on the null page | `ValueError` naming `value` or `input_row_offsets`, every page unchanged | `tests/ops/test_store_checks.py` |
| a tier reader with another `tier_hmac_key` (or none) on a deployment's disk directory or Redis | each key has a namespace of its own (a one-way key id in the page names): the reader misses, the deployment's pages stay and keep hitting | `tests/hardening/test_untrusted_tiers.py` |
| a page a reader cannot verify (damaged, another key, a checksum it cannot compute) | a miss for that reader, counted in `refused`, never deleted by it | `tests/hardening/test_untrusted_tiers.py`, `tests/offload/test_redis_tier.py` |
| several processes writing one disk directory, each with the same cap | one LRU index per directory, shared through a locked journal: 3 writers with a 20-page cap leave 20 pages | `tests/offload/test_disk_tier.py`, `test_disk_index.py` |
| a FIFO, directory or link at a page's path; a read that never returns | only a regular file is a page; every disk read runs on reader threads and gives up after `disk_timeout_s` (a miss); `alloc` returns | `tests/hardening/test_untrusted_tiers.py`, `tests/offload/test_disk_tier.py` |
| `SamplingParams(temperature=1e-40)` or `5e-324` | raised to 0.01 with a warning, as vLLM does | `tests/engine/test_fail_alone.py` |
| a request whose sampling raises (NaN logits, a multinomial error) | it alone fails (`finish_reason="error"`, `request.error`), its pages are released, the others of its step get their tokens and the engine serves on; `LLMEngine.abort_request` ends waiting, running and swapped-out requests | `tests/engine/test_fail_alone.py` |
| `pagedkv engine` HTTP: `max_tokens` of `Infinity`, `2.7`, `"3"`, `true`; a prompt or `max_tokens` past the whole KV cache; a prompt of bools or outside the vocabulary | 400 with `{"error", "param"}` naming the field, the value and the limit; a request that fails in the engine answers 500 alone and the server serves on | `tests/router/test_engine_server.py` |
| prompts `[5, True, 7]`, object-dtype arrays | a bool anywhere is a `TypeError` naming its index; an object array of ints is token ids (never `StopIteration`) | `tests/core/test_context.py` |
| KV events of topic `kvX` or `kv-metrics` reaching a router subscribed to `kv` (ZMQ subscriptions match prefixes) | the topic frame is compared exactly: other topics are counted in `other_topics` and skipped, live and in replays | `tests/router/test_streams.py` |
| `cache_salt=""` | refused with `ValueError` wherever a salt enters (it would otherwise share the unsalted chain) | `tests/core/test_context.py`, `tests/core/test_hashing.py` |
| a hybrid or state model gone idle | `used_pages` is 0; pages only state checkpoints hold are `checkpoint_pages` (summary, metrics, Prometheus) and evictable | `tests/engine/test_state_checkpoint_pages.py` |
| the same prompts again on `mamba` / `mamba2` with prefix caching; a repeated prompt on a hybrid | a checkpoint is saved before each prompt's last token: a repeat resumes there | `tests/engine/test_state_model_prefix_hits.py` |
| a staged tier-to-device copy that fails | every request holding the failed pages is rolled back (table and context consistent at once, `check_integrity` clean) and its next `alloc` computes or loads them again | `tests/offload/test_staged_loads.py`, `tests/manager/test_state_tiers.py` |
"""

MESSAGE_WIDTH = 80


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def message_of(case: Case) -> str:
    """The first `MESSAGE_WIDTH` characters of the case's real message (or its accepted outcome)."""
    error = run_case(case).error
    text = case.outcome if error is None else str(error)
    return text if len(text) <= MESSAGE_WIDTH else text[: MESSAGE_WIDTH - 1] + "…"


def render_markdown() -> str:
    """docs/HOSTILE_INPUTS.md: the table, with the message each case really got."""
    kinds = sorted({c.kind for c in CASES})
    out = [DOCS_HEADER.format(width=MESSAGE_WIDTH, count=len(CASES), entries=len({c.entry for c in CASES}),
                              classes=len(kinds), class_list=", ".join(kinds))]  # fmt: skip
    for case in CASES:
        error = "—" if case.error is None else f"`{case.error.__name__}`"
        detail = case.input_class.split(": ", 1)
        label = detail[0] if len(detail) == 1 else f"{detail[0]} ({detail[1]})"
        out.append(
            f"| `{case.entry}` | {_cell(label)} | `{_cell(case.example)}` | {error} | {_cell(message_of(case))} |\n"
        )
    out.append(DOCS_FOOTER)
    return "".join(out)
