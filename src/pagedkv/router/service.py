"""`pagedkv route`: the KV-aware router as an HTTP service (aiohttp).

Configured by a JSON file (`load_config`)::

    {"engines": [{"name": "e0", "url": "http://127.0.0.1:8100", "events": "tcp://127.0.0.1:5557",
                  "replay": "tcp://127.0.0.1:5558", "topic": "kv",
                  "hash": {"scheme": "pagedkv", "page_size": 16, "algo": "sha256"}}],
     "policy": {"mode": "kv", "load_margin": 4, "stale_after_s": 10, "retry_after_s": 5},
     "proxy": true, "scrape_interval_s": 1.0, "tokenizer": null}

``hash`` is ``{"scheme": "pagedkv", "page_size", "algo", "seed_hex" (64 hex; default: this machine's
deployment seed), "version", "int_hashes"}`` or ``{"scheme": "vllm", "block_size", "algo",
"none_hash_seed", "int_hashes"}``. Endpoints:

- ``POST /v1/completions``: an OpenAI-style completion request whose ``prompt`` is token ids (or text,
  with ``tokenizer``: a local transformers tokenizer directory); optional ``cache_salt``. With
  ``proxy`` the request goes to the chosen engine's ``/v1/completions`` (retried on another engine if
  it cannot be reached) and its answer comes back with a ``pagedkv_router`` field; without, the answer
  is the decision (as ``POST /route``).
- ``POST /route``: ``{"engine", "url", "reason", "predicted_tokens", "scores", "loads"}`` only.
- ``GET /metrics``: Prometheus text (`pagedkv.router.metrics`); ``GET /health``.

Every ``scrape_interval_s`` the service reads each engine's ``GET {url}/load``
(``{"running", "waiting", "free_pages", "total_pages"}``); a failed scrape marks the engine failed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedkv.core.hashing import check_salt
from pagedkv.router.hashers import BlockHasher, PagedKVHasher, VLLMHasher
from pagedkv.router.index import EngineSpec, PrefixIndex
from pagedkv.router.metrics import render_metrics
from pagedkv.router.policy import Decision, Router, RouterPolicy

__all__ = ["RouterConfig", "add_arguments", "load_config", "main", "make_app", "make_hasher"]


@dataclass(frozen=True)
class RouterConfig:
    """A parsed configuration (see the module docstring)."""

    engines: list[EngineSpec]
    policy: RouterPolicy
    proxy: bool = True
    scrape_interval_s: float = 1.0
    tokenizer: str | None = None


def make_hasher(spec: dict[str, Any]) -> BlockHasher:
    """A hasher from its config map. ValueError names a bad scheme or field."""
    spec = dict(spec)
    scheme = spec.pop("scheme", "pagedkv")
    if scheme == "pagedkv":
        seed_hex = spec.pop("seed_hex", None)
        seed = bytes.fromhex(seed_hex) if seed_hex else None
        return PagedKVHasher(spec.pop("page_size", 16), seed=seed, **spec)
    if scheme == "vllm":
        return VLLMHasher(spec.pop("block_size", 16), **spec)
    raise ValueError(f"hash scheme={scheme!r} must be 'pagedkv' or 'vllm'")


def load_config(data: dict[str, Any] | str | Path) -> RouterConfig:
    """A `RouterConfig` from a dict or a JSON file path. Engines with equal hash maps share one hasher
    (a request is hashed once per distinct scheme). ValueError / KeyError name the bad entry."""
    raw = data if isinstance(data, dict) else json.loads(Path(data).read_text())
    if not isinstance(raw, dict):
        raise ValueError(f"config must be a JSON object, got {type(raw).__name__}")
    data = raw
    engines_cfg = data.get("engines")
    if not isinstance(engines_cfg, list) or not engines_cfg:
        raise ValueError("config 'engines' must be a non-empty list")
    hashers: dict[str, BlockHasher] = {}
    engines = []
    for i, e in enumerate(engines_cfg):
        for key in ("name", "events"):
            if key not in e:
                raise ValueError(f"engines[{i}] needs {key!r}")
        hash_cfg = e.get("hash", {})
        key = json.dumps(hash_cfg, sort_keys=True)
        if key not in hashers:
            hashers[key] = make_hasher(hash_cfg)
        engines.append(
            EngineSpec(e["name"], e["events"], hashers[key], e.get("replay"), e.get("topic", ""), e.get("url"))
        )
    interval = float(data.get("scrape_interval_s", 1.0))
    if not interval > 0:
        raise ValueError(f"scrape_interval_s={interval!r} must be > 0")
    return RouterConfig(engines, RouterPolicy(**data.get("policy", {})), bool(data.get("proxy", True)), interval,
                        data.get("tokenizer"))  # fmt: skip


def _decision_json(router: Router, d: Decision) -> dict[str, Any]:
    return {"engine": d.engine, "url": router.index.engines[d.engine].url, "reason": d.reason,
            "predicted_tokens": d.predicted_tokens, "scores": d.scores, "loads": d.loads}  # fmt: skip


def make_app(router: Router, config: RouterConfig) -> Any:
    """The aiohttp application of the service (starts the load scraper with the app)."""
    import aiohttp
    from aiohttp import web

    tokenizer: Any = None
    if config.tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(config.tokenizer, local_files_only=True)

    def parse(body: Any) -> tuple[list[int], str | None]:
        if not isinstance(body, dict) or "prompt" not in body:
            raise ValueError("body must be a JSON object with a 'prompt'")
        prompt, salt = body["prompt"], body.get("cache_salt")
        if isinstance(prompt, str):
            if tokenizer is None:
                raise ValueError("prompt is text but the router has no 'tokenizer' configured: send token ids")
            prompt = list(tokenizer(prompt)["input_ids"])
        if not isinstance(prompt, list) or not prompt or not all(type(t) is int for t in prompt):
            raise ValueError("prompt must be a non-empty list of token ids (or text with a tokenizer)")
        try:
            check_salt(salt)  # (None: no salt; "" is refused, as everywhere)
        except TypeError as exc:
            raise ValueError(str(exc)) from None
        return prompt, salt

    async def route(http: web.Request) -> web.Response:
        try:
            tokens, salt = parse(await http.json())
        except (ValueError, json.JSONDecodeError) as exc:
            return web.json_response({"error": str(exc)}, status=400)
        d = router.route(tokens, salt)
        router.finished(d)  # nothing is proxied: the decision is all
        return web.json_response(_decision_json(router, d))

    async def completions(http: web.Request) -> web.Response:
        if not config.proxy:
            return await route(http)
        try:
            body = await http.json()
            tokens, salt = parse(body)
        except (ValueError, json.JSONDecodeError) as exc:
            return web.json_response({"error": str(exc)}, status=400)
        body = {**body, "prompt": tokens}
        session: aiohttp.ClientSession = http.app["session"]
        for _ in range(len(router.engines)):
            d = router.route(tokens, salt)
            url = router.index.engines[d.engine].url
            if url is None:
                router.finished(d)
                return web.json_response({"error": f"engine {d.engine!r} has no url to proxy to"}, status=502)
            try:
                async with session.post(url + "/v1/completions", json=body) as resp:
                    answer = await resp.json(content_type=None)
                    status = resp.status
            except (TimeoutError, aiohttp.ClientError):
                router.finished(d)
                router.mark_failed(d.engine)
                continue
            cached = None
            if isinstance(answer, dict):
                cached = (answer.get("usage") or {}).get("prompt_tokens_details", {}).get("cached_tokens")
                answer["pagedkv_router"] = _decision_json(router, d)
            router.finished(d, cached if isinstance(cached, int) else None)
            return web.json_response(answer, status=status)
        return web.json_response({"error": "no engine could be reached"}, status=503)

    async def metrics(http: web.Request) -> web.Response:
        return web.Response(text=render_metrics(router), content_type="text/plain", charset="utf-8")

    async def health(http: web.Request) -> web.Response:
        return web.json_response({"ok": True, "live": [e for e in router.engines if router.is_live(e)]})

    async def scrape(app: web.Application) -> None:
        session: aiohttp.ClientSession = app["session"]
        while True:
            for name, spec in router.index.engines.items():
                if spec.url is None:
                    continue
                try:
                    async with session.get(spec.url + "/load", timeout=aiohttp.ClientTimeout(total=2)) as resp:
                        load = await resp.json()
                    router.report_load(name, int(load.get("running", 0)), int(load.get("waiting", 0)),
                                       load.get("free_pages"), load.get("total_pages"))  # fmt: skip
                except (TimeoutError, aiohttp.ClientError, ValueError, AttributeError):
                    router.mark_failed(name)
            await asyncio.sleep(config.scrape_interval_s)

    async def lifecycle(app: web.Application) -> Any:
        app["session"] = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300))
        task = asyncio.create_task(scrape(app))
        yield
        task.cancel()
        await app["session"].close()

    app = web.Application()
    app.cleanup_ctx.append(lifecycle)
    app.add_routes([web.post("/v1/completions", completions), web.post("/route", route), web.get("/metrics", metrics),
                    web.get("/health", health)])  # fmt: skip
    return app


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `pagedkv route`."""
    p.add_argument("--config", type=Path, required=True, help="the router's JSON config (see pagedkv.router.service)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (0: a free one)")


def main(args: argparse.Namespace) -> int:
    """Serve until interrupted; prints ``{"url": ...}`` on stdout when ready."""
    config = load_config(args.config)
    index = PrefixIndex(config.engines)
    router = Router(index, config.policy)
    try:
        serve_app(make_app(router, config), args.host, args.port, lambda port: {"url": f"http://{args.host}:{port}"})
    finally:
        index.close()
    return 0


def serve_app(app: Any, host: str, port: int, ready: Callable[[int], dict[str, Any]]) -> None:
    """Serve the aiohttp `app` on `host`:`port` (0: a free port) until interrupted; once it listens, print
    ``ready(bound port)`` as one JSON line on stdout (what a parent process waits for)."""
    from aiohttp import web

    async def serve() -> None:
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, host, port).start()
        print(json.dumps(ready(runner.addresses[0][1])), flush=True)
        await asyncio.Event().wait()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve())


def cli(argv: Sequence[str] | None = None) -> int:  # pragma: no cover - `python -m` entry
    parser = argparse.ArgumentParser(prog="pagedkv route", description=__doc__)
    add_arguments(parser)
    return main(parser.parse_args(argv))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(cli())
