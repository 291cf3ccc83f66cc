"""The router's `/metrics` page: Prometheus text exposition of decisions, hit predictions and streams."""

from __future__ import annotations

from pagedkv.router.policy import Router

__all__ = ["render_metrics"]


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render_metrics(router: Router) -> str:
    """The exposition text (version 0.0.4) for `router` and its index. Reads counters only."""
    lines: list[str] = []

    def family(name: str, kind: str, help_text: str, samples: list[tuple[dict[str, str], float]]) -> None:
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            text = ",".join(f'{k}="{_label(v)}"' for k, v in labels.items())
            lines.append(f"{name}{{{text}}} {value}" if text else f"{name} {value}")

    s = router.stats
    family("pagedkv_router_decisions_total", "counter", "Requests routed, by engine and reason.",
           [({"engine": e, "reason": r}, n) for (e, r), n in sorted(s.decisions.items())])  # fmt: skip
    family(
        "pagedkv_router_prompt_tokens_total", "counter", "Prompt tokens of routed requests.", [({}, s.prompt_tokens)]
    )
    family("pagedkv_router_predicted_hit_tokens_total", "counter",
           "Leading tokens the chosen engine was predicted to hold.",
           [({"engine": e}, n) for e, n in sorted(s.predicted_tokens.items())])  # fmt: skip
    family("pagedkv_router_reported_hit_tokens_total", "counter",
           "Cached prompt tokens the engines reported for proxied requests.",
           [({"engine": e}, n) for e, n in sorted(s.actual_tokens.items())])  # fmt: skip
    family("pagedkv_router_predictions_total", "counter", "Proxied requests whose hit the engine reported.",
           [({}, s.outcomes)])  # fmt: skip
    family("pagedkv_router_predictions_exact_total", "counter", "Of those, predicted hit == reported hit.",
           [({}, s.exact)])  # fmt: skip
    count = sum(s.decisions.values())
    family("pagedkv_router_decision_seconds", "summary", "Time to choose an engine (hashing included).", [])
    lines.append(f"pagedkv_router_decision_seconds_sum {s.decision_seconds}")
    lines.append(f"pagedkv_router_decision_seconds_count {count}")
    family("pagedkv_router_engine_failures_total", "counter", "Failed requests or load scrapes, by engine.",
           [({"engine": e}, n) for e, n in sorted(s.failures.items())])  # fmt: skip

    loads = router.loads()
    index = router.index
    family("pagedkv_router_engine_live", "gauge", "1 while the engine is routed to (heard from, not failed).",
           [({"engine": e}, int(router.is_live(e))) for e in router.engines])  # fmt: skip
    family("pagedkv_router_engine_load", "gauge", "Running + waiting requests the engine last reported.",
           [({"engine": e}, load.running + load.waiting) for e, load in loads.items()])  # fmt: skip
    family("pagedkv_router_engine_in_flight", "gauge", "Requests the router has in flight on the engine.",
           [({"engine": e}, load.in_flight) for e, load in loads.items()])  # fmt: skip
    family("pagedkv_router_engine_blocks", "gauge", "Blocks the engine holds, by medium (from its KV events).",
           [({"engine": e, "medium": m}, n) for e in router.engines for m, n in sorted(index.num_blocks(e).items())])  # fmt: skip
    stream_fields = ("batches", "events", "removals", "gaps", "replays", "replayed", "unrecovered", "restarts",
                     "malformed", "clears", "other_topics")  # fmt: skip
    stats = {e: index.stats(e) for e in router.engines}
    for f in stream_fields:
        family(f"pagedkv_router_stream_{f}_total", "counter", f"KV event stream: {f} (see StreamStats).",
               [({"engine": e}, getattr(st, f)) for e, st in stats.items()])  # fmt: skip
    return "\n".join(lines) + "\n"
