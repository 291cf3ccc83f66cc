"""`pagedkv engine`: one pagedkv engine behind HTTP, publishing its KV events (a router's backend).

A Llama-style model with seeded random weights (`pagedkv.testing.build_llama`; no download) or a local
checkpoint is served by `LLMEngine` from one thread; aiohttp answers:

- ``POST /v1/completions`` ``{"prompt": [token ids], "max_tokens": n, "cache_salt": str?}`` (and optionally
  ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``seed``: `SamplingParams`; greedy by default) ->
  an OpenAI-style completion with ``choices[0].token_ids``, ``finish_reason`` (``"length"`` or ``"stop"``),
  ``usage.prompt_tokens_details.cached_tokens`` (the prefix-cache hit the manager reported) and
  ``pagedkv.ttft_s`` (arrival to first token, engine side);
- ``GET /load`` -> ``{"running", "waiting", "free_pages", "total_pages", "kv_event_batches"}``;
- ``POST /reset`` -> drops every cached page (an ``AllBlocksCleared`` event).

Every field is checked before the request reaches the engine (`parse_completion`). A bad request gets
status 400 and ``{"error": message, "param": field}``, the message naming the field, its value and the
limit: a body that is not a JSON object; ``prompt`` missing, empty, not a list of ints (bools refused)
or outside the vocabulary; ``max_tokens`` not an int (``2.7``, ``"3"``, ``true``, ``Infinity`` are
refused, never rounded) or outside [1, 2**31 - 1]; a request the whole KV cache could never hold
(``param`` is ``prompt`` when the prompt alone does not fit, else ``max_tokens``, with the largest
``max_tokens`` that fits); a ``cache_salt`` that is not a non-empty string; a bad sampling field. A
request that fails inside the engine answers 500 with ``{"error", "finish_reason": "error"}`` (its
sampling failed: it alone; a failed forward pass: every request in flight, which are aborted), and the
server serves on.

KV events go out through `ZmqEventPublisher` (PUB and replay ROUTER bound on loopback). When the
server is ready it prints one JSON line: ``{"url", "events", "replay", "page_size"}``.
Needs aiohttp, pyzmq and msgspec (``pip install 'pagedkv[router]'``) and transformers.
"""

from __future__ import annotations

import argparse
import asyncio
import queue
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

__all__ = ["BadRequestError", "EngineWorker", "add_arguments", "main", "make_app", "parse_completion"]

INT32_MAX = 2**31 - 1
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed")


class BadRequestError(ValueError):
    """A request the server refuses (HTTP 400): `param` names the body field at fault (None: the body)."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class _Job:
    kind: str  # "generate" | "reset"
    payload: dict[str, Any]
    future: asyncio.Future[Any]
    loop: asyncio.AbstractEventLoop


class EngineWorker:
    """Runs an `LLMEngine` on its own thread; other threads submit jobs (thread-safe).

    Args:
        engine: the engine (only this worker's thread touches it after `start`).
    """

    def __init__(self, engine: Any, publisher: Any = None) -> None:
        self.engine = engine
        self.publisher = publisher
        self._inbox: queue.Queue[_Job] = queue.Queue()
        self._stop = threading.Event()
        self._pending: dict[int, _Job] = {}  # request id -> its job
        self._thread = threading.Thread(target=self._run, name="pagedkv-engine", daemon=True)

    def start(self) -> None:
        """Start the engine thread."""
        self._thread.start()

    def stop(self) -> None:
        """Stop the engine thread (requests in flight are abandoned)."""
        self._stop.set()
        self._thread.join(5)

    def submit(self, kind: str, payload: dict[str, Any]) -> asyncio.Future[Any]:
        """Queue a job from a running event loop; the future gets its result or exception."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._inbox.put(_Job(kind, payload, future, loop))
        return future

    def load(self) -> dict[str, int]:
        """Running and waiting requests, free / total device pages and the KV event batches numbered so far
        (read without a lock: a snapshot)."""
        sched, mgr = self.engine.scheduler, self.engine.manager
        return {"running": len(sched.running), "waiting": len(sched.waiting),
                "free_pages": int(mgr.num_free_blocks()), "total_pages": int(mgr.total_num_blocks()),
                "kv_event_batches": self.publisher.next_seq if self.publisher is not None else 0}  # fmt: skip

    @staticmethod
    def _resolve(job: _Job, result: Any = None, error: BaseException | None = None) -> None:
        def set_it() -> None:
            if job.future.done():
                return
            if error is not None:
                job.future.set_exception(error)
            else:
                job.future.set_result(result)

        job.loop.call_soon_threadsafe(set_it)

    def _take(self, job: _Job) -> None:
        engine = self.engine
        try:
            if job.kind == "reset":
                engine.manager.reset_prefix_cache()  # (publishes its events at once)
                self._resolve(job, {"reset": True})
                return
            p = job.payload
            request = engine.add_request(p["prompt"], p["max_tokens"], p["sampling"], cache_salt=p.get("cache_salt"))
            self._pending[request.request_id] = job
        except Exception as exc:
            self._resolve(job, error=exc)

    def _run(self) -> None:
        engine = self.engine
        while not self._stop.is_set():
            try:
                job = self._inbox.get(timeout=0.0 if engine.has_unfinished() else 0.05)
                self._take(job)
                while True:
                    self._take(self._inbox.get_nowait())
            except queue.Empty:
                pass
            if not engine.has_unfinished():
                continue
            try:
                finished = engine.step()
            except Exception as exc:  # fail every request in flight (out of the engine, pages released), serve on
                engine.abort_request(list(self._pending))
                for job in self._pending.values():
                    self._resolve(job, error=exc)
                self._pending.clear()
                continue
            for request in finished:  # (a request whose sampling failed is among them, with its error)
                self._resolve(self._pending.pop(request.request_id), request)


def _int_field(body: dict[str, Any], key: str, default: int, low: int, high: int) -> int:
    """`body[key]` (absent or null: `default`) as an int in [low, high]; BadRequestError for anything else
    (bools, floats, strings, Infinity)."""
    value = body.get(key)
    if value is None:
        return default
    if type(value) is not int:
        raise BadRequestError(f"{key}={value!r} must be an integer in [{low}, {high}]", key)
    if not low <= value <= high:
        raise BadRequestError(f"{key}={value} must be in [{low}, {high}]", key)
    return value


def parse_completion(body: Any, engine: Any) -> dict[str, Any]:
    """The job of a ``/v1/completions`` body, every field checked against `engine` (its vocabulary and its
    whole KV cache); `BadRequestError` names the first field at fault. Reads only fixed settings of the
    engine (safe from the server's thread while the engine steps)."""
    from pagedkv.core.errors import InsufficientBlocksError
    from pagedkv.core.hashing import check_salt
    from pagedkv.engine import SamplingParams
    from pagedkv.engine.checks import check_fits

    if not isinstance(body, dict):
        raise BadRequestError(f"the body must be a JSON object, got {type(body).__name__}", None)
    if "prompt" not in body:
        raise BadRequestError("prompt is missing: give a non-empty list of token ids", "prompt")
    prompt = body["prompt"]
    if not isinstance(prompt, list):
        raise BadRequestError(f"prompt must be a non-empty list of token ids, got {type(prompt).__name__}", "prompt")
    if not prompt:
        raise BadRequestError("prompt must be a non-empty list of token ids, got an empty list", "prompt")
    bad = next((i for i, t in enumerate(prompt) if type(t) is not int), None)
    if bad is not None:
        raise BadRequestError(f"prompt[{bad}]={prompt[bad]!r} is not a token id (an int)", "prompt")
    vocab = getattr(getattr(engine.model, "config", None), "vocab_size", None)
    bad = next((i for i, t in enumerate(prompt) if not 0 <= t < vocab), None) if isinstance(vocab, int) else None
    if bad is not None:
        raise BadRequestError(f"prompt[{bad}]={prompt[bad]} is outside the model's vocabulary [0, {vocab})", "prompt")
    max_tokens = _int_field(body, "max_tokens", 16, 1, INT32_MAX)
    salt = body.get("cache_salt")
    try:
        check_salt(salt)
    except (TypeError, ValueError) as exc:
        raise BadRequestError(str(exc), "cache_salt") from None
    options = {key: body[key] for key in SAMPLING_FIELDS if body.get(key) is not None}  # (null: the default)
    for key, value in options.items():  # one by one: the error names its field
        try:
            SamplingParams(**{key: value})
        except (TypeError, ValueError) as exc:
            raise BadRequestError(str(exc), key) from None
    try:
        sampling = SamplingParams(**options)
    except (TypeError, ValueError) as exc:
        raise BadRequestError(str(exc), None) from None
    manager = engine.manager
    try:
        check_fits(manager, len(prompt), 1)
    except InsufficientBlocksError as exc:
        message = f"prompt has {len(prompt)} tokens: more than this engine's whole KV cache holds ({exc})"
        raise BadRequestError(message, "prompt") from None
    try:
        check_fits(manager, len(prompt), max_tokens)
    except InsufficientBlocksError as exc:
        most = _most_tokens(manager, len(prompt), max_tokens)
        message = (f"max_tokens={max_tokens} does not fit this engine's KV cache with a prompt of {len(prompt)} "
                   f"tokens: at most {most} ({exc})")  # fmt: skip
        raise BadRequestError(message, "max_tokens") from None
    return {"prompt": prompt, "max_tokens": max_tokens, "cache_salt": salt, "sampling": sampling}


def _most_tokens(manager: Any, prompt_length: int, above: int) -> int:
    """The largest max_tokens below `above` that a prompt of `prompt_length` tokens fits with (1 fits)."""
    from pagedkv.core.errors import InsufficientBlocksError
    from pagedkv.engine.checks import check_fits

    low, high = 1, above - 1  # fits(low); not fits(above)
    while low < high:
        mid = (low + high + 1) // 2
        try:
            check_fits(manager, prompt_length, mid)
            low = mid
        except InsufficientBlocksError:
            high = mid - 1
    return low


def _completion(request: Any, name: str) -> dict[str, Any]:
    out = request.output
    return {
        "id": f"cmpl-{name}-{request.request_id}", "object": "text_completion", "created": int(time.time()),
        "model": name,
        "choices": [{"index": 0, "text": "", "token_ids": out, "finish_reason": request.finish_reason}],
        "usage": {"prompt_tokens": request.prompt_len, "completion_tokens": len(out),
                  "total_tokens": request.prompt_len + len(out),
                  "prompt_tokens_details": {"cached_tokens": int(request.cached_tokens)}},
        "pagedkv": {"ttft_s": request.ttft, "engine": name},
    }  # fmt: skip


def make_app(worker: EngineWorker, name: str) -> Any:
    """The aiohttp application serving `worker`."""
    from aiohttp import web

    from pagedkv.core.errors import InsufficientBlocksError

    def bad(message: str, param: str | None) -> web.Response:
        return web.json_response({"error": f"bad request: {message}", "param": param}, status=400)

    async def completions(http: web.Request) -> web.Response:
        try:
            body = await http.json()
        except ValueError as exc:  # (not JSON, or not UTF-8)
            return bad(f"the body is not JSON: {exc}", None)
        try:
            job = parse_completion(body, worker.engine)
        except BadRequestError as exc:
            return bad(str(exc), exc.param)
        try:
            request = await worker.submit("generate", job)
        except (ValueError, TypeError, InsufficientBlocksError) as exc:  # (the engine's own checks: a safety net)
            return bad(str(exc), None)
        except Exception as exc:  # the engine's step failed for every request in flight; it serves on
            return web.json_response({"error": f"the engine failed: {type(exc).__name__}: {exc}",
                                      "finish_reason": "error"}, status=500)  # fmt: skip
        if request.error is not None:  # its sampling failed: it alone
            return web.json_response({"error": f"the request failed: {type(request.error).__name__}: "
                                      f"{request.error}", "finish_reason": "error"}, status=500)  # fmt: skip
        return web.json_response(_completion(request, name))

    async def load(http: web.Request) -> web.Response:
        return web.json_response(worker.load())

    async def reset(http: web.Request) -> web.Response:
        return web.json_response(await worker.submit("reset", {}))

    async def health(http: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    app = web.Application()
    app.add_routes([web.post("/v1/completions", completions), web.get("/load", load), web.post("/reset", reset),
                    web.get("/health", health)])  # fmt: skip
    return app


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `pagedkv engine`."""
    p.add_argument("--name", default="engine", help="the engine's name (the model field of its answers)")
    p.add_argument("--host", default="127.0.0.1", help="HTTP and ZMQ address to bind")
    p.add_argument("--port", type=int, default=0, help="HTTP port (0: a free one, printed)")
    p.add_argument("--events-port", type=int, default=0, help="KV event PUB port (0: a free one)")
    p.add_argument("--replay-port", type=int, default=0, help="KV event replay ROUTER port (0: a free one)")
    p.add_argument("--topic", default="kv", help="KV event topic")
    p.add_argument("--page-size", type=int, default=16, help="tokens per page")
    p.add_argument("--num-pages", type=int, default=512, help="device pages")
    p.add_argument("--host-pages", type=int, default=0, help="host tier pages (0: no host tier)")
    p.add_argument("--layers", type=int, default=2, help="layers of the random-weight Llama")
    p.add_argument("--hidden", type=int, default=64, help="hidden size of the random-weight Llama")
    p.add_argument("--vocab", type=int, default=32000, help="vocabulary of the random-weight Llama")
    p.add_argument("--max-len", type=int, default=4096, help="max positions of the random-weight Llama")
    p.add_argument("--max-batched-tokens", type=int, default=2048, help="token budget per step")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--seed", type=int, default=0, help="weights seed")


def main(args: argparse.Namespace) -> int:
    """Serve until interrupted; prints the ready line on stdout."""
    import torch

    from pagedkv.engine import LLMEngine
    from pagedkv.observability import ZmqEventPublisher
    from pagedkv.router.service import serve_app
    from pagedkv.testing import build_llama

    torch.set_num_threads(args.threads)
    heads = max(1, args.hidden // 16)
    model = build_llama(args.seed, vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                        num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                        max_position_embeddings=args.max_len, initializer_range=0.1)  # fmt: skip
    tier: dict[str, Any] = {"kv_connector": "local", "host_kvcache_swap_space_gb": 1} if args.host_pages else {}
    engine = LLMEngine.from_hf(model, page_size=args.page_size, num_pages=args.num_pages,
                               total_num_host_pages=args.host_pages, max_num_batched_tokens=args.max_batched_tokens,
                               **tier)  # fmt: skip
    pub = ZmqEventPublisher(f"tcp://{args.host}:{args.events_port or '*'}", topic=args.topic,
                            replay_endpoint=f"tcp://{args.host}:{args.replay_port or '*'}", bind=True)  # fmt: skip
    engine.manager.add_kv_event_listener(pub)
    worker = EngineWorker(engine, pub)
    worker.start()

    def ready(port: int) -> dict[str, Any]:
        return {"name": args.name, "url": f"http://{args.host}:{port}", "events": pub.endpoint,
                "replay": pub.replay_endpoint, "topic": args.topic, "page_size": args.page_size}  # fmt: skip

    try:
        serve_app(make_app(worker, args.name), args.host, args.port, ready)
    finally:
        worker.stop()
        pub.close()
        engine.manager.close()
    return 0


if __name__ == "__main__":  # pragma: no cover
    parser = argparse.ArgumentParser(prog="pagedkv engine", description=__doc__)
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
