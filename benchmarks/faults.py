"""`python -m benchmarks.faults`: real faults under the disk and Redis tiers while `LLMEngine`s serve.

Each case, on a tiny seeded Llama, greedy, in rounds: fill (an engine serves prompts in groups sharing a
prefix; its pages go down to the tier), the fault for real (redis-server SIGKILLed mid-run, the disk full
by RLIMIT_FSIZE in a child process, stored pages corrupted or truncated, Redis slowed by ``CLIENT PAUSE``
from a second connection past ``redis_timeout_s``), serve (the same prompts, tier faulty), recover (fault
gone: a fresh engine). Measured over every round: requests completed of submitted, wrong tokens (against a
recompute-only engine), pages lost (`DEFINITIONS`), refused / errors / skipped writes, wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from importlib.util import find_spec
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks import faults_cases as fc
from benchmarks.faults_inject import DAMAGING, run_case
from benchmarks.processes import child_env
from pagedkv.bench import report

if TYPE_CHECKING:
    from pagedkv.bench.tiers_redis import RedisServer

__all__ = [
    "CASES",
    "DEFINITIONS",
    "add_arguments",
    "command",
    "format_faults_report",
    "plots",
    "run_faults",
    "summarize",
]

CASES = {
    "none-disk": "no fault (tiered: host + disk)",
    "none-redis": "no fault (Redis)",
    "redis-killed": "redis-server SIGKILLed after the serving engine's first step, then restarted (empty)",
    "disk-full": "disk full from half-way through the fill on (RLIMIT_FSIZE below a page file)",
    "corrupt-disk": "a byte flipped in one page file per prefix group (last quarter, magic, middle, last)",
    "corrupt-redis": "a byte flipped in one Redis value per prefix group (last quarter, magic, middle, last)",
    "truncated-disk": "one page file per prefix group truncated: to half, to the header, to 0 bytes, by 1 byte",
    "slow-redis": "Redis paused (CLIENT PAUSE ALL) 600 ms of every 750 ms (timeout 0.2 s); steps paced at 30 ms",
}
REDIS_CASES = {"none-redis", "redis-killed", "corrupt-redis", "slow-redis"}
OWN_SERVER = {"redis-killed", "slow-redis"}  # they kill / pause the server: never a --redis-url one
DEFINITIONS = {
    "pages_lost": "leaked_device_pages + unaccounted_pages + missing_in_tier + damaged_not_refused",
    "leaked_device_pages": "device pages in use once every request of a round finished (check_integrity() must pass)",
    "unaccounted_pages": "per round, |prompt tokens - computed (counted at the model's input) - cached at admission| "
    "plus tier-loaded tokens (tier_stats pages_loaded) beyond the cached ones, in pages",
    "missing_in_tier": "full pages of the served sequences not stored intact (full size) after the last round",
    "damaged_not_refused": "damaged pages - pages the tier refused (each must be refused, recomputed, written over)",
}
Progress = Callable[[int, int, str], None]


def _observed(name: str, c: dict[str, Any]) -> bool:
    """The fault really happened (and the tier gives hits again after it)."""
    if name.startswith("none"):
        return c["errors"] == c["refused"] == 0 and c["tier_pages_loaded"] > 0
    if name in DAMAGING:
        return c["refused"] == len(c["damaged"]) > 0 and c["recovery_tier_hits"] > 0
    writes_lost = c["skipped_writes"] > 0 or name == "slow-redis"
    return bool(c["errors"] > 0 and writes_lost and c["recovery_tier_hits"] > 0)


def summarize(name: str, raw: dict[str, Any]) -> dict[str, Any]:
    """One case's figures: summed over its rounds, lower tier (disk / Redis) counters, pages lost."""
    rounds = raw["rounds"]

    def lower(counter: str, rs: Sequence[dict[str, Any]] = rounds) -> int:
        return sum(t[counter] for r in rs for n, t in r["tiers"].items() if n != "host")

    refused = lower("refused")
    lost = {"leaked_device_pages": sum(r["leaked_device_pages"] for r in rounds),
            "unaccounted_pages": sum(r["unaccounted_pages"] for r in rounds), "missing_in_tier": raw["audit"]["missing"],
            "damaged_not_refused": max(0, len(raw["damaged"]) - refused)}  # fmt: skip
    c = {"fault": CASES[name], "connector": raw["connector"], "submitted": sum(r["submitted"] for r in rounds),
         "completed": sum(r["completed"] for r in rounds), "wrong_tokens": sum(r["wrong_tokens"] for r in rounds),
         "pages_lost": sum(lost.values()), "lost": lost, "refused": refused, "errors": lower("errors"),
         "skipped_writes": lower("skipped_writes"), "tier_pages_loaded": lower("pages_loaded"),
         "tier_pages_stored": lower("pages_stored"), "recovery_tier_hits": lower("pages_loaded", rounds[-1:]),
         "deleted_from_tier": raw["deleted"], "damaged": raw["damaged"], "audit": raw["audit"],
         "integrity_ok": all(r["integrity_error"] is None for r in rounds),
         "round_errors": [r["error"] for r in rounds if r["error"]], "preemptions": sum(r["preemptions"] for r in rounds),
         "fault_round_wall_s": sum(r["wall_s"] for r in rounds if r["faulty"]), "wall_s": raw["wall_s"],
         **({"pauses": raw["pauses"]} if "pauses" in raw else {}), "warnings": raw["warnings"], "rounds": rounds}  # fmt: skip
    c["fault_observed"] = _observed(name, c)
    c["ok"] = bool(c["completed"] == c["submitted"] and c["wrong_tokens"] == c["pages_lost"] == 0
                   and c["integrity_ok"] and c["fault_observed"])  # fmt: skip
    return c


def _unavailable(name: str, redis_url: str | None) -> str | None:
    if name not in REDIS_CASES:
        return None
    if find_spec("redis") is None:
        return "redis-py is not installed (pip install 'pagedkv[tiers]')"
    own = name in OWN_SERVER or not redis_url
    return "needs redis-server (the bench starts its own)" if own and shutil.which("redis-server") is None else None


def run_faults(
    requests_per_case: int = 32, redis_url: str | None = None, progress: Progress | None = None, *,
    cases: Sequence[str] | None = None, seed: int = 0,
) -> dict[str, Any]:  # fmt: skip
    """Run the fault `cases` (default: all of `CASES`), each round serving `requests_per_case` requests.
    `redis_url`: a server for none-redis / corrupt-redis (the killed and slow cases always use a
    redis-server this bench starts). Cases that cannot run are listed under "skipped" with the reason."""
    import torch

    from pagedkv.bench.tiers_redis import start_redis
    from pagedkv.offload.format import HEADER_SIZE

    names = list(cases or CASES)
    if unknown := [n for n in names if n not in CASES]:
        raise ValueError(f"unknown fault cases {unknown}; choose from {list(CASES)}")
    workload, model, start = (
        fc.Workload(requests=requests_per_case, seed=seed),
        fc.build_model(seed),
        time.perf_counter(),
    )
    reference = fc.make_engine(model, prefix_caching=False).generate(workload.prompts(), workload.new_tokens)
    result: dict[str, Any] = {
        "workload": asdict(workload), "model": fc.MODEL, "page_size": fc.PAGE_SIZE, "redis_timeout_s": fc.TIMEOUT_S,
        "redis_retry_s": fc.RETRY_S, "reference_s": time.perf_counter() - start, "definitions": DEFINITIONS,
        "cases": {}, "skipped": {},
    }  # fmt: skip
    server: RedisServer | None = None
    with tempfile.TemporaryDirectory(prefix="pagedkv-faults-") as tmp:
        try:
            for i, name in enumerate(names):
                if progress:
                    progress(i, len(names), name)
                if why := _unavailable(name, redis_url):
                    result["skipped"][name] = why
                    continue
                directory, own = Path(tmp) / name, name in OWN_SERVER or not redis_url
                if name == "disk-full":  # lowers RLIMIT_FSIZE: in a child process; no page file (header + 4 KiB) fits
                    spec = {"dir": str(directory), "workload": asdict(workload), "reference": reference,
                            "fsize_limit": HEADER_SIZE, "threads": torch.get_num_threads()}  # fmt: skip
                    proc = subprocess.run([sys.executable, "-m", "benchmarks.faults_child"], input=json.dumps(spec),
                                          capture_output=True, text=True, timeout=900, check=False,
                                          env=child_env())  # fmt: skip
                    if proc.returncode != 0:
                        raise RuntimeError(f"the disk-full case's process failed:\n{proc.stderr[-4000:]}")
                    raw = json.loads(proc.stdout.strip().splitlines()[-1])
                elif name in REDIS_CASES:
                    server = server or (start_redis() if own else None)
                    url = server.url if own and server else str(redis_url)
                    prefix = f"pagedkv-bench-faults-{os.getpid()}-{os.urandom(3).hex()}-{name}:"
                    config = {"redis_url": url, "redis_key_prefix": prefix}
                    raw = run_case(name, fc.Recorder(model, workload, reference, "redis", config), server)
                else:
                    config = {"disk_offload_dir": str(directory)}
                    raw = run_case(name, fc.Recorder(model, workload, reference, "tiered", config))
                result["cases"][name] = summarize(name, raw)
            if progress:
                progress(len(names), len(names), "done")
        finally:
            if server is not None:
                server.stop()
    return result


def format_faults_report(result: dict[str, Any]) -> str:
    """A markdown table of the fault figures, then what "pages lost" counts."""
    w = result["workload"]
    header = ("case", "fault", "submitted", "completed", "wrong tokens", "pages lost", "refused", "errors",
              "skipped writes", "tier hits (pages)", "fault round s", "case s")  # fmt: skip
    rows = [(name, c["fault"], c["submitted"], c["completed"], c["wrong_tokens"], c["pages_lost"], c["refused"],
             c["errors"], c["skipped_writes"], c["tier_pages_loaded"], f"{c['fault_round_wall_s']:.2f}",
             f"{c['wall_s']:.2f}") for name, c in result["cases"].items()]  # fmt: skip
    lines = [
        f"Faults under the tiers: rounds of {w['requests']} requests ({w['groups']} groups sharing a {w['prefix_len']}"
        f"-token prefix, {w['new_tokens']} greedy tokens each; tiny Llama, pages of {result['page_size']}): fill, "
        "serve under the fault, recover; every token compared with a recompute-only engine",
        "",
        *report.table(header, rows),
    ]  # fmt: skip
    lines += [f"| {name} | skipped: {why} |" for name, why in result["skipped"].items()]
    lines += ["", f"pages lost = {DEFINITIONS['pages_lost']}:"]
    lines += [f"- {k}: {v}" for k, v in DEFINITIONS.items() if k != "pages_lost"]
    bad = [n for n, c in result["cases"].items() if not c["ok"]]
    lines.append(f"FAILED: {', '.join(bad)}" if bad else "OK: every case completed, 0 wrong tokens, 0 pages lost")
    return "\n".join(lines)


def plots(result: dict[str, Any]) -> list[report.Plot]:
    """Per case: requests submitted and completed, wrong tokens, pages lost, pages the tier refused."""
    cases = result["cases"]
    keys = {"submitted": "submitted", "completed": "completed", "wrong tokens": "wrong_tokens",
            "pages lost": "pages_lost", "refused": "refused"}  # fmt: skip
    return [report.Plot("faults_cases", "requests and pages under each fault", "count", list(cases),
                        {label: [c[key] for c in cases.values()] for label, key in keys.items()})]  # fmt: skip


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `python -m benchmarks.faults`."""
    p.add_argument("--requests", type=int, default=32, help="requests per round (3 rounds in most cases)")
    p.add_argument("--cases", default=",".join(CASES), help="comma-separated cases")
    p.add_argument("--redis-url", help="server for none-redis / corrupt-redis (default: start redis-server)")
    p.add_argument("--seed", type=int, default=0, help="seed of the model and the prompts")


def command(args: argparse.Namespace) -> int:
    """`python -m benchmarks.faults`: run, print the table, write --json / --plots; 0 when every case is ok."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the model is tiny: one thread is faster and steadier
    try:
        cases = [c for c in args.cases.split(",") if c]
        with report.Progress("cases") as progress:
            result = run_faults(args.requests, args.redis_url, progress, cases=cases, seed=args.seed)
    finally:
        torch.set_num_threads(threads)
    report.finish(args, format_faults_report(result), result, plots)
    return 0 if all(c["ok"] for c in result["cases"].values()) else 1


if __name__ == "__main__":  # python -m benchmarks.faults
    from benchmarks.command import main

    sys.exit(main("benchmarks.faults", sys.modules[__name__]))
