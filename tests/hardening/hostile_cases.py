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

Generated from `tests/hardening/hostile_cases.py` (`render_markdown()`); each message is the one the
case really raised, cut at {width} characters. `tests/hardening/test_hostile_inputs.py` runs every row
and checks this file; `PAGEDKV_WRITE_DOCS=1 pytest tests/hardening/test_hostile_inputs.py` rewrites it.

{count} cases over {entries} entry points and {classes} input classes ({class_list}).

| entry point | input class | example | error | message |
|---|---|---|---|---|
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
    return "".join(out)
