"""`pagedkv engine`'s HTTP contract on a real aiohttp server (loopback) over a real engine thread: every bad
request gets 400 naming its field, never a 500 or a silently changed value; a request whose sampling fails
gets 500 alone and the server serves on."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

pytest.importorskip("aiohttp")

from aiohttp.test_utils import TestClient, TestServer  # noqa: E402

from hf_models import build  # noqa: E402
from pagedkv.engine import LLMEngine, SamplingParams  # noqa: E402
from pagedkv.router.engine_server import EngineWorker, make_app  # noqa: E402

PROMPT = [5, 6, 7, 8]
POISON = 101  # a token whose embedding is NaN (see tests/engine/test_fail_alone.py)


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """The engine thread of a tiny model runs faster on one torch thread (and the machine may be shared)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def engine(poison: bool = False) -> LLMEngine:
    model = build("llama")  # vocabulary 256
    if poison:
        with torch.no_grad():
            model.model.embed_tokens.weight[POISON] = float("nan")
    eng = LLMEngine.from_hf(model, page_size=4, num_pages=16)  # 64 token slots
    eng.manager.enable_runtime_checks = True
    return eng


@contextmanager
def serving(eng: LLMEngine) -> Iterator[EngineWorker]:
    worker = EngineWorker(eng)
    worker.start()
    try:
        yield worker
    finally:
        worker.stop()


async def post_all(worker: EngineWorker, bodies: list[bytes | dict[str, Any]]) -> list[tuple[int, Any]]:
    """POST every body to /v1/completions at once; (status, JSON answer) each, then GET /load last."""
    async with TestClient(TestServer(make_app(worker, "e"))) as client:

        async def one(body: bytes | dict[str, Any]) -> tuple[int, Any]:
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            resp = await client.post("/v1/completions", data=data, headers={"Content-Type": "application/json"})
            return resp.status, await resp.json()

        answers = list(await asyncio.gather(*(one(b) for b in bodies)))
        load = await client.get("/load")
        return [*answers, (load.status, await load.json())]


BAD = [  # (raw body, field named, message)
    (b"not json", None, "the body is not JSON"),
    (b"[1, 2]", None, "the body must be a JSON object, got list"),
    (b'{"max_tokens": 2}', "prompt", "prompt is missing"),
    (b'{"prompt": []}', "prompt", "prompt must be a non-empty list of token ids"),
    (b'{"prompt": "hello"}', "prompt", "prompt must be a non-empty list of token ids, got str"),
    (b'{"prompt": [5, true, 7]}', "prompt", r"prompt\[1\]=True is not a token id"),
    (b'{"prompt": [5, 6.0]}', "prompt", r"prompt\[1\]=6.0 is not a token id"),
    (b'{"prompt": [5, 256]}', "prompt", r"prompt\[1\]=256 is outside the model's vocabulary \[0, 256\)"),
    (b'{"prompt": [5, 6], "max_tokens": 2.7}', "max_tokens", r"max_tokens=2.7 must be an integer in \[1, 2147483647\]"),
    (b'{"prompt": [5, 6], "max_tokens": "3"}', "max_tokens", "max_tokens='3' must be an integer"),
    (b'{"prompt": [5, 6], "max_tokens": true}', "max_tokens", "max_tokens=True must be an integer"),
    (b'{"prompt": [5, 6], "max_tokens": Infinity}', "max_tokens", "max_tokens=inf must be an integer"),
    (b'{"prompt": [5, 6], "max_tokens": NaN}', "max_tokens", "max_tokens=nan must be an integer"),
    (b'{"prompt": [5, 6], "max_tokens": 0}', "max_tokens", r"max_tokens=0 must be in \[1, 2147483647\]"),
    (b'{"prompt": [5, 6], "max_tokens": 2147483648}', "max_tokens", "max_tokens=2147483648 must be in"),
    (b'{"prompt": [5, 6, 7, 8], "max_tokens": 62}', "max_tokens",
     "max_tokens=62 does not fit this engine's KV cache with a prompt of 4 tokens: at most 61"),
    (json.dumps({"prompt": [5] * 65}).encode(), "prompt", "prompt has 65 tokens: more than this engine's whole KV"),
    (b'{"prompt": [5, 6], "cache_salt": ""}', "cache_salt", "cache_salt='' is empty"),
    (b'{"prompt": [5, 6], "cache_salt": 5}', "cache_salt", "cache_salt=5 must be a str or None"),
    (b'{"prompt": [5, 6], "temperature": -1}', "temperature", "temperature=-1 must be >= 0 and finite"),
    (b'{"prompt": [5, 6], "temperature": Infinity}', "temperature", "temperature=inf must be >= 0 and finite"),
    (b'{"prompt": [5, 6], "temperature": "hot"}', "temperature", "temperature='hot' must be a number"),
    (b'{"prompt": [5, 6], "top_p": 0}', "top_p", r"top_p=0 must be in \(0, 1\]"),
    (b'{"prompt": [5, 6], "seed": 1.5}', "seed", "seed=1.5 must be an int or None"),
]  # fmt: skip


def test_every_bad_request_gets_400_naming_its_field() -> None:
    eng = engine()
    good = {"prompt": PROMPT, "max_tokens": 61, "temperature": 0.8, "seed": 3, "model": "e", "top_k": None}
    with serving(eng) as worker:
        *answers, (ok_status, ok), (_, load) = asyncio.run(post_all(worker, [body for body, _, _ in BAD] + [good]))
    for (body, param, message), (status, answer) in zip(BAD, answers, strict=True):
        assert status == 400 and answer["param"] == param, (body, status, answer)
        assert answer["error"].startswith("bad request: ") and re.search(message, answer["error"]), answer
    want = engine().generate([PROMPT], 61, sampling=SamplingParams(temperature=0.8, seed=3))[0]
    assert ok_status == 200 and ok["choices"][0]["token_ids"] == want and ok["choices"][0]["finish_reason"] == "length"
    assert (load["running"], load["waiting"], load["free_pages"]) == (0, 0, load["total_pages"])
    eng.manager.check_integrity()


def test_a_request_whose_sampling_fails_gets_500_alone_and_the_server_serves_on() -> None:
    eng = engine(poison=True)
    bad = {"prompt": [5, POISON, 7], "max_tokens": 4, "temperature": 1.0}
    good = {"prompt": PROMPT, "max_tokens": 6}
    with serving(eng) as worker:
        (bad_status, failed), (good_status, served), _ = asyncio.run(post_all(worker, [bad, good]))
        (again_status, again), (_, load) = asyncio.run(post_all(worker, [good]))
    assert bad_status == 500 and failed["finish_reason"] == "error"
    assert "the request failed: RuntimeError: probability tensor contains" in failed["error"]
    want = engine().generate([PROMPT], 6)[0]
    assert good_status == again_status == 200
    assert served["choices"][0]["token_ids"] == again["choices"][0]["token_ids"] == want
    assert (load["running"], load["waiting"], load["free_pages"]) == (0, 0, load["total_pages"])
    eng.manager.check_integrity()
