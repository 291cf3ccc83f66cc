"""Modular MAX 26.3.0's own `PagedKVCacheManager` as a compare peer, replayed in MAX's own environment.

MAX pins transformers < 5.13, so it cannot share `.venv-peers` with vLLM and SGLang: `make peers` builds it
in `.venv-max`. The compare run (any environment) starts one worker process there (`MaxWorker`:
``python -m benchmarks.compare.peer_max``) and sends it one replay per line on stdin; the worker
replays the trace through the same driver (`sim.simulate`, garbage collector frozen) with `MaxAdapter`,
so the bookkeeping seconds are measured inside the MAX process around the same adapter calls as every
other manager, and answers one JSON line per replay (`SimResult`'s counters). The interpreter is
``$PAGEDKV_MAX_PYTHON``, else ``.venv-max/bin/python`` of the checkout this package was imported from.

The lifecycle is MAX's scheduler's (`TextBatchConstructor`), on MAX's real classes: admission =
``claim`` + ``alloc`` (prefix hits skip the context's processed window, then pages for the whole
sequence are reserved) + ``chunk``; a refused ``alloc`` (`InsufficientBlocksError`) is released and
the request waits; every later step of a running request ``alloc`` again (a decode token, or the next
chunk); after the forward pass ``update`` each context and one ``step`` commits full pages to the
prefix cache (pages are hittable from the next step on, as pagedkv's default `pagedkv-lru-step`).
``runtime_inputs`` (the tables turned into buffers) is not called: the pagedkv row does not time its
equivalent either. MAX allocates its page buffers at construction, so the model is tiny (1 layer, 1
KV head, head_dim 8, fp32); the bookkeeping does not depend on it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace
from typing import IO, Any

import numpy as np

from benchmarks.compare.sim import SimConfig, SimResult, simulate
from benchmarks.processes import ROOT, child_env
from pagedkv.bench.timing import gc_frozen
from pagedkv.workloads.traces import TraceRequest, make_trace

__all__ = ["MaxAdapter", "MaxWorker", "max_python", "trace_to_json", "trace_from_json", "main"]


def _max() -> SimpleNamespace:
    """MAX's classes used here (raises ImportError outside an environment with MAX 26.3)."""
    from max.driver import CPU
    from max.dtype import DType
    from max.engine import InferenceSession
    from max.graph import DeviceRef
    from max.interfaces.request.base import RequestID
    from max.interfaces.tokens import TokenBuffer
    from max.kv_cache import InsufficientBlocksError, PagedKVCacheManager
    from max.nn.kv_cache import KVCacheParams
    from max.pipelines.core.context import TextContext

    return SimpleNamespace(CPU=CPU, DType=DType, InferenceSession=InferenceSession, DeviceRef=DeviceRef,
                           RequestID=RequestID, TokenBuffer=TokenBuffer, InsufficientBlocksError=InsufficientBlocksError,
                           PagedKVCacheManager=PagedKVCacheManager, KVCacheParams=KVCacheParams,
                           TextContext=TextContext)  # fmt: skip


def max_version() -> str:
    from importlib.metadata import version

    return version("max")


class MaxAdapter:
    """`CacheAdapter` over one MAX `PagedKVCacheManager` replica (prefix caching on).

    `mid_prefill_hit_tokens` counts tokens a later chunk's ``alloc`` found cached (MAX looks the
    prefix up again on every chunk); the driver's progress then moves up to MAX's.
    """

    name = "max"

    def __init__(self, num_pages: int, page_size: int = 16, max_num_seqs: int = 256) -> None:
        m = self._m = _max()
        params = m.KVCacheParams(dtype=m.DType.float32, n_kv_heads=1, head_dim=8, num_layers=1,
                                 devices=[m.DeviceRef.CPU()], enable_prefix_caching=True, page_size=page_size)  # fmt: skip
        session = m.InferenceSession(devices=[m.CPU()])
        self.mgr = m.PagedKVCacheManager(params, session, num_pages, max_batch_size=max_num_seqs)
        self.num_pages, self.page_size = num_pages, page_size
        self.mid_prefill_hit_tokens = 0

    def new_step(self) -> None:
        pass

    def _context(self, req: TraceRequest) -> Any:
        m, live = self._m, req.live_tokens
        tokens = m.TokenBuffer(np.asarray(live, dtype=np.int64))
        return m.TextContext(max_length=len(req.tokens) + 1, tokens=tokens, request_id=m.RequestID(str(req.rid)))

    def admit(self, req: TraceRequest, budget: int) -> tuple[int, int] | None:
        ctx = req.handle
        if ctx is None:
            ctx = req.handle = self._context(req)
        self.mgr.claim(ctx.request_id, 0)
        try:
            self.mgr.alloc(ctx, 0)
        except self._m.InsufficientBlocksError:
            self.mgr.release(ctx.request_id, 0)  # MAX's alloc is not atomic: its hits are handed back
            req.handle = None  # (the lookup moved the context's window; the next try starts afresh)
            return None
        tokens = ctx.tokens
        n = min(tokens.active_length, budget)
        if n < tokens.active_length:
            tokens.chunk(n)
        return tokens.processed_length, n

    def extend(self, req: TraceRequest, n: int) -> bool:
        ctx = req.handle
        tokens = ctx.tokens
        try:
            self.mgr.alloc(ctx, 0)  # a later chunk may hit pages committed since its admission
        except self._m.InsufficientBlocksError:
            return False
        skipped = tokens.processed_length - req.num_computed
        if skipped > 0:  # the driver's progress follows MAX's: the window MAX runs ends where the driver's does
            self.mid_prefill_hit_tokens += skipped
            req.num_computed = tokens.processed_length + min(n, tokens.active_length) - n
        if n < tokens.active_length:
            tokens.chunk(n)
        return True

    def advance(self, batch: Sequence[tuple[TraceRequest, int]]) -> None:
        ctxs = []
        for req, _ in batch:
            ctx = req.handle
            ctx.update(req.tokens.item(req.num_tokens - 1))  # ends the chunk mid-prompt (the token is not kept)
            ctxs.append(ctx)
        self.mgr.step([ctxs])

    def free(self, req: TraceRequest, preempted: bool) -> None:
        self.mgr.release(req.handle.request_id, 0)
        req.handle = None  # a preempted request restarts as a prompt of every token so far

    def used_pages(self) -> int:
        return int(self.mgr.get_num_used_pages(0))


# -- the worker protocol ---------------------------------------------------------------------------


def trace_to_json(trace: Sequence[TraceRequest]) -> list[dict[str, Any]]:
    """A hand-made trace as JSON (workload traces travel as their `make_trace` arguments instead)."""
    return [{"rid": r.rid, "tokens": np.asarray(r.tokens).tolist(), "prompt_len": r.prompt_len, "after": r.after}
            for r in trace]  # fmt: skip


def trace_from_json(items: list[dict[str, Any]]) -> list[TraceRequest]:
    return [TraceRequest(d["rid"], np.asarray(d["tokens"], dtype=np.int32), d["prompt_len"], d["after"])
            for d in items]  # fmt: skip


def _result_json(res: SimResult, adapter: MaxAdapter) -> dict[str, Any]:
    out = asdict(res)
    out["mid_prefill_hit_tokens"] = adapter.mid_prefill_hit_tokens
    return out


def _serve(job: dict[str, Any], traces: dict[tuple[Any, ...], list[TraceRequest]]) -> dict[str, Any]:
    if "requests" in job:
        trace = trace_from_json(job["requests"])
    else:
        key = (job["workload"], job["num_requests"], job["seed"])
        if key not in traces:
            traces.clear()  # one workload at a time
            traces[key] = make_trace(*key)
        trace = traces[key]
    config = SimConfig(job["max_num_seqs"], job["max_num_batched_tokens"], job.get("decode_page_size"))
    adapter = MaxAdapter(job["num_pages"], job["page_size"], config.max_num_seqs)
    with gc_frozen():
        res = simulate(adapter, trace, config)
    return _result_json(res, adapter)


def main(stdin: IO[str] | None = None, stdout: IO[str] | None = None) -> int:
    """The worker: a hello line ({"version"} or {"error"}), then one answer line per job line."""
    if stdout is None:  # answers on the real stdout; anything MAX prints goes to stderr
        stdout = os.fdopen(os.dup(1), "w")
        os.dup2(2, 1)
    stdin = stdin or sys.stdin
    try:
        _max()
        hello: dict[str, Any] = {"version": max_version()}
    except Exception as exc:  # noqa: BLE001 - reported to the parent as the reason MAX is skipped
        hello = {"error": f"MAX is not importable: {type(exc).__name__}: {exc}"}
    print(json.dumps(hello), file=stdout, flush=True)
    if "error" in hello:
        return 1
    traces: dict[tuple[Any, ...], list[TraceRequest]] = {}
    for line in stdin:
        if not line.strip():
            continue
        try:
            answer = _serve(json.loads(line), traces)
        except Exception as exc:  # noqa: BLE001 - the parent raises it
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(answer), file=stdout, flush=True)
    return 0


def max_python() -> str:
    """``$PAGEDKV_MAX_PYTHON``, else ``.venv-max/bin/python`` at the root of the checkout holding this package."""
    env = os.environ.get("PAGEDKV_MAX_PYTHON")
    if env:
        return env
    return str(ROOT / ".venv-max" / "bin" / "python")


class MaxWorker:
    """A worker process in MAX's environment; `replay` sends it one trace and returns its `SimResult`.

    It imports pagedkv from the same source tree as the caller (PYTHONPATH), so a checkout's changes
    are measured even where `.venv-max` holds an editable install of another checkout. Raises
    `PeerUnavailable` when the interpreter is missing or MAX does not import there.
    """

    def __init__(self, python: str | None = None) -> None:
        from benchmarks.compare.peers import PeerUnavailable

        self.python = python or max_python()
        if not Path(self.python).exists():
            raise PeerUnavailable(f"MAX's interpreter {self.python} does not exist (`make peers` builds .venv-max, "
                                  "or set PAGEDKV_MAX_PYTHON)")  # fmt: skip
        env = child_env()
        self.proc = subprocess.Popen([self.python, "-m", "benchmarks.compare.peer_max"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)  # fmt: skip
        hello = self._read()
        if hello is None or "error" in hello:
            self.close()
            raise PeerUnavailable((hello or {}).get("error", f"MAX's worker ({self.python}) exited at start"))
        self.version: str = hello["version"]

    def _read(self) -> dict[str, Any] | None:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        return json.loads(line) if line else None

    def replay(self, num_pages: int, page_size: int, config: SimConfig, *, trace: Sequence[TraceRequest] | None = None,
               workload: str | None = None, num_requests: int = 0, seed: int = 0) -> SimResult:  # fmt: skip
        """One replay: a hand-made `trace`, or `make_trace(workload, num_requests, seed)` rebuilt in the worker."""
        job: dict[str, Any] = {"num_pages": num_pages, "page_size": page_size, "max_num_seqs": config.max_num_seqs,
                               "max_num_batched_tokens": config.max_num_batched_tokens,
                               "decode_page_size": config.page_size}  # fmt: skip
        if trace is not None:
            job["requests"] = trace_to_json(trace)
        else:
            job.update(workload=workload, num_requests=num_requests, seed=seed)
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        answer = self._read()
        if answer is None or "error" in answer:
            raise RuntimeError(f"MAX's worker failed: {(answer or {}).get('error', 'it exited')}")
        answer.pop("mid_prefill_hit_tokens", None)
        wall = answer.pop("wall_seconds")
        res = SimResult(**answer)
        res.wall_seconds = wall
        return res

    def close(self) -> None:
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> MaxWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


if __name__ == "__main__":
    sys.exit(main())
