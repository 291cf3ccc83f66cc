"""One engine process for the Redis engine tests: a real `LLMEngine` on the demo model with the redis
connector, serving rounds of prompts it reads from stdin, one JSON command per line:

    python engine_worker.py '{"redis_url": "redis://127.0.0.1:PORT/0", "retry_s": 2.0, "timeout_s": 0.5}'
    {"prompts": [[...], ...], "new": 4}   -> {"outputs": [...], "cached": tokens cached this round, "redis": stats}
    {"reference": [[...], ...], "new": 4} -> {"outputs": [...]} of another engine on the same model, no connector
    {"wait_available": true}              -> {"available": true} once the tier is tried again after a failure
    {"exit": true}                        -> {"closed": true} after sync_tiers + close

Each reply is one line starting with "@@" on stdout. Before each round the device forgets its prefix
cache, so every hit of a round comes from Redis.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from pagedkv.engine import LLMEngine
from pagedkv.params.connector import KVConnectorConfig
from pagedkv.testing import build_demo_model

PAGE_SIZE = 8


def build(spec: dict[str, Any]) -> LLMEngine:
    config = KVConnectorConfig(
        model_id="demo", redis_url=spec["redis_url"], redis_key_prefix=spec.get("prefix", "pagedkv-engines:"),
        redis_retry_s=spec.get("retry_s", 2.0), redis_timeout_s=spec.get("timeout_s", 0.5),
    )  # fmt: skip
    return LLMEngine.from_hf(build_demo_model(), page_size=PAGE_SIZE, num_pages=64, kv_connector="redis",
                             kv_connector_config=config)  # fmt: skip


def reply(message: dict[str, Any]) -> None:
    sys.stdout.write("@@" + json.dumps(message) + "\n")
    sys.stdout.flush()


def main() -> None:
    engine = build(json.loads(sys.argv[1]))
    tier = engine.manager.tiers.connectors[0].lower[0]
    reply({"ready": True})
    for line in sys.stdin:
        command = json.loads(line)
        if command.get("exit"):
            engine.manager.sync_tiers()
            engine.manager.close()
            reply({"closed": True})
            return
        if "reference" in command:
            plain = LLMEngine.from_hf(build_demo_model(), page_size=PAGE_SIZE, num_pages=64)
            reply({"outputs": plain.generate(command["reference"], command["new"])})
            continue
        if command.get("wait_available"):
            while not tier.available:
                time.sleep(0.01)
            reply({"available": True})
            continue
        for bm in engine.manager._managers:
            bm.reset_prefix_cache()  # the device forgets: hits must come from Redis
        before = engine.summary["prompt_tokens_cached"]
        outputs = engine.generate(command["prompts"], command["new"])
        engine.manager.sync_tiers()  # this round's pages are on the server before the reply
        stats = engine.manager.tier_stats()["redis"]
        reply({"outputs": outputs, "cached": engine.summary["prompt_tokens_cached"] - before,
               "redis": {k: v for k, v in stats.items() if not k.endswith("latency")}})  # fmt: skip


if __name__ == "__main__":
    main()
