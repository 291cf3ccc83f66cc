"""`pagedkv route` in a child process in front of two pagedkv engines in child processes: proxied
completions land on the engine holding their prefix, the prediction equals the hit the engine reports,
/metrics counts it, and a killed engine is routed around."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("zmq")
pytest.importorskip("msgspec")
pytest.importorskip("aiohttp")

from engines import SRC, engines, wait_for  # noqa: E402

from pagedkv.router.service import load_config  # noqa: E402


def post(url: str, body: dict[str, Any]) -> Any:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


def test_route_proxies_to_the_engine_holding_the_prefix(tmp_path: Path) -> None:
    with engines({n: ["--page-size", "4", "--num-pages", "64"] for n in ("a", "b")}) as procs:
        config = {"engines": [{"name": p.name, "url": p.url, "events": p.events, "replay": p.replay, "topic": p.topic,
                               "hash": {"scheme": "pagedkv", "page_size": 4}} for p in procs.values()],
                  "policy": {"stale_after_s": 2.0, "retry_after_s": 30.0}, "scrape_interval_s": 0.1}  # fmt: skip
        path = tmp_path / "router.json"
        path.write_text(json.dumps(config))
        assert [e.name for e in load_config(path).engines] == ["a", "b"]
        env = dict(os.environ, PYTHONPATH=SRC)
        proc = subprocess.Popen([sys.executable, "-m", "pagedkv.cli", "route", "--config", str(path), "--port", "0"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip
        try:
            assert proc.stdout is not None
            url = json.loads(proc.stdout.readline())["url"]
            wait_for(lambda: len(json.loads(urllib.request.urlopen(url + "/health").read())["live"]) == 2)
            prefixes = [list(range(10 + 50 * g, 50 + 50 * g)) for g in range(4)]
            first = {}
            for g, prefix in enumerate(prefixes):  # nothing cached: spread by load
                answer = post(url + "/v1/completions", {"prompt": prefix + [1], "max_tokens": 2})
                first[g] = answer["pagedkv_router"]["engine"]
                assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            for g, prefix in enumerate(prefixes):
                wait_for(lambda g=g: post(url + "/route", {"prompt": prefixes[g] + [2]})["predicted_tokens"] == 40)
                answer = post(url + "/v1/completions", {"prompt": prefix + [2, 3], "max_tokens": 2})
                decision = answer["pagedkv_router"]
                assert (decision["engine"], decision["reason"], decision["predicted_tokens"]) == (
                    first[g],
                    "prefix",
                    40,
                )
                assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 40
            with pytest.raises(urllib.error.HTTPError) as err:
                post(url + "/v1/completions", {"prompt": "text without a tokenizer"})
            assert err.value.code == 400
            for salt in ("", 5):  # "" is refused as everywhere (it was the unsalted chain), before any routing
                with pytest.raises(urllib.error.HTTPError) as err:
                    post(url + "/route", {"prompt": prefixes[0] + [2], "cache_salt": salt})
                assert err.value.code == 400 and "cache_salt=" in json.loads(err.value.read())["error"]
            metrics = urllib.request.urlopen(url + "/metrics").read().decode()
            assert "pagedkv_router_predictions_exact_total 8" in metrics
            assert "pagedkv_router_predicted_hit_tokens_total" in metrics and 'reason="prefix"' in metrics

            victim = first[0]
            procs[victim].stop()  # dead: its requests go to the other engine
            other = "b" if victim == "a" else "a"
            for _ in range(3):
                answer = post(url + "/v1/completions", {"prompt": prefixes[0] + [4, 5], "max_tokens": 1})
                assert answer["pagedkv_router"]["engine"] == other
            metrics = urllib.request.urlopen(url + "/metrics").read().decode()
            assert f'pagedkv_router_engine_live{{engine="{victim}"}} 0' in metrics
        finally:
            proc.terminate()
            proc.wait(10)
