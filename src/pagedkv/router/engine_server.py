"""`pagedkv engine`: one pagedkv engine behind HTTP, publishing its KV events (a router's backend).

A Llama-style model with seeded random weights (`pagedkv.demo.build_llama`; no download) or a local
checkpoint is served by `LLMEngine` from one thread; aiohttp answers:

- ``POST /v1/completions`` ``{"prompt": [token ids], "max_tokens": n, "cache_salt": str?}`` ->
  an OpenAI-style completion with ``choices[0].token_ids``, ``usage.prompt_tokens_details.cached_tokens``
  (the prefix-cache hit the manager reported) and ``pagedkv.ttft_s`` (arrival to first token, engine side);
- ``GET /load`` -> ``{"running", "waiting", "free_pages", "total_pages", "kv_event_batches"}``;
- ``POST /reset`` -> drops every cached page (an ``AllBlocksCleared`` event).

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

__all__ = ["EngineWorker", "add_arguments", "main"]


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
        self._pending: dict[int, tuple[Any, _Job]] = {}
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
            request = engine.add_request(p["prompt"], p["max_tokens"], cache_salt=p.get("cache_salt"))
            self._pending[id(request)] = (request, job)
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
            except Exception as exc:  # fail every request in flight, keep serving
                for _, job in self._pending.values():
                    self._resolve(job, error=exc)
                self._pending.clear()
                continue
            for request in finished:
                _, job = self._pending.pop(id(request))
                self._resolve(job, request)


def _completion(request: Any, name: str) -> dict[str, Any]:
    out = request.output
    return {
        "id": f"cmpl-{name}-{request.request_id}", "object": "text_completion", "created": int(time.time()),
        "model": name,
        "choices": [{"index": 0, "text": "", "token_ids": out, "finish_reason": "length"}],
        "usage": {"prompt_tokens": request.prompt_len, "completion_tokens": len(out),
                  "total_tokens": request.prompt_len + len(out),
                  "prompt_tokens_details": {"cached_tokens": int(request.cached_tokens)}},
        "pagedkv": {"ttft_s": request.ttft, "engine": name},
    }  # fmt: skip


def make_app(worker: EngineWorker, name: str) -> Any:
    """The aiohttp application serving `worker`."""
    from aiohttp import web

    async def completions(http: web.Request) -> web.Response:
        try:
            body = await http.json()
            prompt = body["prompt"]
            if not isinstance(prompt, list) or not all(type(t) is int for t in prompt):
                raise ValueError("prompt must be a list of token ids")
            job = {"prompt": prompt, "max_tokens": int(body.get("max_tokens", 16)),
                   "cache_salt": body.get("cache_salt")}  # fmt: skip
        except (ValueError, KeyError, TypeError) as exc:
            return web.json_response({"error": f"bad request: {exc}"}, status=400)
        try:
            request = await worker.submit("generate", job)
        except (ValueError, TypeError) as exc:
            return web.json_response({"error": str(exc)}, status=400)
        return web.json_response(_completion(request, name))

    async def load(http: web.Request) -> web.Response:
        return web.json_response(worker.load())

    async def reset(http: web.Request) -> web.Response:
        return web.json_response(await worker.submit("reset", {}))

    app = web.Application()
    app.add_routes([web.post("/v1/completions", completions), web.get("/load", load), web.post("/reset", reset),
                    web.get("/health", lambda _: _ok())])  # fmt: skip
    return app


async def _ok() -> Any:
    from aiohttp import web

    return web.json_response({"ok": True})


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

    from pagedkv.demo import build_llama
    from pagedkv.engine import LLMEngine
    from pagedkv.observability import ZmqEventPublisher
    from pagedkv.router.service import serve_app

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
