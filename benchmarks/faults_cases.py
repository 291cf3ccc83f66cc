"""The mechanics of one `python -m benchmarks.faults` case (`faults.py` runs the set, `faults_inject` the faults):
workload, engines, a measured serving round, the tier's stored pages (damage, audit).
Page keys are the engine's own, from its KV events (parent key + page tokens -> key): no hashing is redone."""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from logging.handlers import BufferingHandler
from pathlib import Path
from typing import Any

import numpy as np

from pagedkv.core.events import BlockRemoved, BlockStored, KVEventBatch
from pagedkv.engine import LLMEngine
from pagedkv.engine.request import Request
from pagedkv.offload.format import HEADER_SIZE, key_bytes
from pagedkv.params.connector import KVConnectorConfig

__all__ = ["CORRUPT", "DAMAGES", "TRUNCATE", "Recorder", "Workload", "build_model", "make_engine"]

PAGE_SIZE = 8
MODEL: dict[str, Any] = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                             initializer_range=0.1)  # fmt: skip
DEVICE_PAGES, HOST_PAGES, BATCH, TOKEN_BUDGET = 512, 1024, 4, 128  # nothing is evicted or preempted
TIMEOUT_S, RETRY_S = 0.2, 0.3  # redis_timeout_s, redis_retry_s
COUNTERS = ("lookups", "pages_loaded", "pages_stored", "refused", "errors", "skipped_writes")
AfterStep = Callable[[int, int], None]  # (steps done, requests finished)


def _flip(data: bytes, i: int) -> bytes:
    return data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1 :]


DAMAGES: dict[str, Callable[[bytes], bytes]] = {  # relative to the stored size (the header may grow)
    "flip a byte in the last quarter": lambda d: _flip(d, len(d) - len(d) // 4),
    "flip the first byte (magic)": lambda d: _flip(d, 0),
    "flip a byte in the middle": lambda d: _flip(d, len(d) // 2),
    "flip the last byte": lambda d: _flip(d, len(d) - 1),
    "truncate to half": lambda d: d[: len(d) // 2],
    "truncate to the header": lambda d: d[:HEADER_SIZE],
    "truncate to 0 bytes": lambda d: b"",
    "truncate by one byte": lambda d: d[:-1],
}
CORRUPT, TRUNCATE = list(DAMAGES)[:4], list(DAMAGES)[4:]


@dataclass(frozen=True)
class Workload:
    """`requests` prompts round robin over `groups` shared prefixes, each + a unique question; `new_tokens` each."""

    requests: int = 32
    groups: int = 4
    prefix_len: int = 40  # 5 shared pages per group
    question: tuple[int, int] = (4, 20)
    new_tokens: int = 6
    seed: int = 0

    def prefixes(self) -> list[list[int]]:
        rng = np.random.default_rng(self.seed)
        return rng.integers(3, MODEL["vocab_size"], size=(self.groups, self.prefix_len)).tolist()  # type: ignore[no-any-return]

    def prompts(self) -> list[list[int]]:
        rng, prefixes = np.random.default_rng(self.seed + 1), self.prefixes()
        return [prefixes[i % self.groups] + rng.integers(3, MODEL["vocab_size"], size=int(rng.integers(*self.question))).tolist()
                for i in range(self.requests)]  # fmt: skip


def build_model(seed: int = 0) -> Any:
    """The tiny seeded Llama every engine of the bench serves (2 layers, hidden 64, GQA 4:2, fp32)."""
    from pagedkv.testing import build_llama

    return build_llama(seed, **MODEL)


class CountingEngine(LLMEngine):
    """`LLMEngine` that counts the prompt tokens the model actually computes (at its input)."""

    prompt_computed: int = 0

    def _forward(self, batch: list[Request]) -> Any:
        for r in batch:
            tokens = r.ctx.tokens
            self.prompt_computed += max(0, min(tokens.current_position, r.prompt_len) - tokens.processed_length)
        return super()._forward(batch)


def make_engine(model: Any, connector: str | None = None, *, prefix_caching: bool = True, **config: Any) -> CountingEngine:  # fmt: skip
    """An engine on `model` with the `connector` tier ("tiered", "redis") set up by `config`, or none."""
    kwargs: dict[str, Any] = {}
    if connector:
        cfg = KVConnectorConfig(model_id="pagedkv-bench-faults", redis_timeout_s=TIMEOUT_S, redis_retry_s=RETRY_S, **config)  # fmt: skip
        kwargs = dict(kv_connector=connector, kv_connector_config=cfg)
        if connector == "tiered":
            kwargs.update(host_kvcache_swap_space_gb=0.25, total_num_host_pages=HOST_PAGES)
    engine = CountingEngine.from_hf(model, page_size=PAGE_SIZE, num_pages=DEVICE_PAGES, max_batch_size=BATCH,
                                    max_num_batched_tokens=TOKEN_BUDGET, enable_prefix_caching=prefix_caching, **kwargs)  # fmt: skip
    assert isinstance(engine, CountingEngine)
    return engine


class PageKeys:
    """The engine's page keys from its KV events: (parent key, page tokens) -> key; tier deletions counted."""

    def __init__(self) -> None:
        self._keys: dict[tuple[Any, tuple[int, ...]], Any] = {}
        self.deleted = 0  # pages removed from disk / Redis (a refused page is not: it is written over)

    def listen(self, batch: KVEventBatch) -> None:
        for e in batch.events:
            if isinstance(e, BlockStored) and e.medium == "GPU":
                parent, size = e.parent_block_hash, e.block_size
                for i, key in enumerate(e.block_hashes):
                    self._keys[(parent, tuple(e.token_ids[i * size : (i + 1) * size]))] = parent = key  # then parent
            elif isinstance(e, BlockRemoved) and e.medium in ("DISK", "REDIS"):
                self.deleted += len(e.block_hashes)

    def chain(self, tokens: list[int], pages: int) -> list[bytes]:
        """Tier keys of the first `pages` pages of `tokens`, as far as they are known."""
        out, parent = [], None
        for i in range(pages):
            parent = self._keys.get((parent, tuple(tokens[i * PAGE_SIZE : (i + 1) * PAGE_SIZE])))
            if parent is None:
                break
            out.append(key_bytes(parent))
        return out


def _counters(engine: LLMEngine) -> dict[str, dict[str, int]]:
    return {n: {c: int(s[c]) for c in COUNTERS} for n, s in engine.manager.tier_stats().items()}  # type: ignore[call-overload]


@dataclass
class Recorder:
    """One case: its tier, rounds, damaged pages and the tier audit."""

    model: Any
    workload: Workload
    reference: list[list[int]]
    connector: str  # "tiered" or "redis"
    config: dict[str, Any]  # KVConnectorConfig fields: disk_offload_dir, or redis_url + redis_key_prefix

    def __post_init__(self) -> None:
        self.redis: Any = None  # a client of the case's Redis server (redis connector)
        if self.connector == "redis":
            from redis import Redis

            self.redis = Redis.from_url(self.config["redis_url"], socket_timeout=10)
        self.log = BufferingHandler(1 << 20)  # the tiers' warnings, kept instead of printed
        self.log.setLevel(logging.WARNING)
        logging.getLogger("pagedkv.offload").addHandler(self.log)
        self.prompts = self.workload.prompts()
        self.keys = PageKeys()
        self.rounds: list[dict[str, Any]] = []  # figures of each round
        self.damaged: list[dict[str, Any]] = []  # pages `damage` rewrote
        self.page_bytes = 0  # an intact stored page
        self.audit_result: dict[str, int] = {}
        self.started = time.perf_counter()

    def engine(self) -> CountingEngine:
        """A fresh engine (empty device pool and host tier) on this case's tier, its events listened to."""
        engine = make_engine(self.model, self.connector, **self.config)
        engine.manager.add_kv_event_listener(self.keys.listen)
        return engine

    def round(self, label: str, engine: CountingEngine, *, faulty: bool = False, after_step: AfterStep | None = None) -> None:  # fmt: skip
        """`engine` serves every prompt at once, stepped here (`after_step` injects faults between steps),
        then writes its pages down (`sync_tiers`); records the round's figures."""
        before, computed0, error = _counters(engine), engine.prompt_computed, None
        requests = [engine.add_request(p, self.workload.new_tokens) for p in self.prompts]
        start, steps, finished = time.perf_counter(), 0, 0
        try:
            while engine.has_unfinished():
                finished += len(engine.step())
                steps += 1
                if after_step is not None:
                    after_step(steps, finished)
            engine.manager.sync_tiers()
        except Exception as exc:  # noqa: BLE001 - a failed round is a figure (requests not completed), not a crash
            error = f"{type(exc).__name__}: {exc}"
        wall, after = time.perf_counter() - start, _counters(engine)
        tiers = {n: {c: after[n][c] - before.get(n, {}).get(c, 0) for c in COUNTERS} for n in after}
        loaded = PAGE_SIZE * sum(t["pages_loaded"] for t in tiers.values())
        prompt, cached = sum(len(p) for p in self.prompts), sum(r.cached_tokens for r in requests)
        computed = engine.prompt_computed - computed0
        gap = abs(prompt - computed - cached) + max(0, loaded - cached)  # tokens neither computed nor served
        integrity = None
        try:
            engine.manager.check_integrity()
        except Exception as exc:  # noqa: BLE001
            integrity = f"{type(exc).__name__}: {exc}"
        self.rounds.append({
            "label": label, "faulty": faulty, "submitted": len(requests),
            "completed": sum(len(q.output) == self.workload.new_tokens for q in requests),
            "wrong_tokens": sum(sum(a != b for a, b in zip(q.output, ref, strict=False)) + abs(len(q.output) - len(ref))
                                for q, ref in zip(requests, self.reference, strict=True)),
            "prompt_tokens": prompt, "computed_tokens": computed, "cached_tokens": cached, "loaded_tokens": loaded,
            "device_hit_tokens": cached - loaded, "unaccounted_pages": math.ceil(gap / PAGE_SIZE),
            "leaked_device_pages": engine.manager.get_num_used_pages(), "integrity_error": integrity, "error": error,
            "preemptions": engine.scheduler.preemptions, "steps": steps, "wall_s": wall, "tiers": tiers,
        })  # fmt: skip
        if not self.page_bytes and (sizes := list(self.sizes().values())):
            self.page_bytes = statistics.mode(sizes)  # as the first round wrote them

    def serve(self, label: str, *, faulty: bool = False, after_step: AfterStep | None = None) -> None:
        """A fresh engine serves one round, then closes (every page written down, threads stopped)."""
        engine = self.engine()
        self.round(label, engine, faulty=faulty, after_step=after_step)
        engine.manager.close()

    def damage(self, kinds: list[str]) -> None:
        """Damage one stored page of each group's prefix (page 1, 2, ... of its chain), one kind each."""
        pages = self.workload.prefix_len // PAGE_SIZE
        for g, prefix in enumerate(self.workload.prefixes()):
            index, kind = 1 + g % (pages - 1), kinds[g % len(kinds)]
            size, now = self.rewrite(self.keys.chain(prefix, pages)[index], DAMAGES[kind])
            self.damaged.append({"group": g, "page": index, "kind": kind, "bytes": size, "now": now})

    def audit(self) -> None:
        """Every full page of every served sequence (prompt + expected output: KV written) must be stored
        intact (its full size) once the tier is healthy again."""
        expected: set[bytes] = set()
        unknown = 0
        for prompt, ref in zip(self.prompts, self.reference, strict=True):
            pages = (len(prompt) + len(ref) - 1) // PAGE_SIZE
            chain = self.keys.chain(prompt + ref, pages)
            unknown, expected = unknown + pages - len(chain), expected | set(chain)
        sizes = self.sizes()
        missing = sum(sizes.get(k.hex()) != self.page_bytes for k in expected)
        self.audit_result = {"expected": len(expected), "missing": missing, "unknown": unknown, "stored": len(sizes)}

    def stored(self) -> dict[str, Any]:
        """Where each page of this case's tier is stored: key hex -> file path or Redis key."""
        if self.redis is None:
            return {p.stem: p for p in Path(self.config["disk_offload_dir"]).glob("*/*/*.page")}
        names = self.redis.scan_iter(match=f"{self.config['redis_key_prefix']}*", count=512)
        return {n.rsplit(b":", 1)[1].decode(): n for n in names}  # <prefix><layout>:<key hex>

    def sizes(self) -> dict[str, int]:
        return {k: self.redis.strlen(n) if self.redis else n.stat().st_size for k, n in self.stored().items()}

    def rewrite(self, key: bytes, damage: Callable[[bytes], bytes]) -> tuple[int, int]:
        """Replace stored page `key` with `damage` of its bytes; its sizes before and after."""
        where = self.stored()[key.hex()]
        bad = damage(good := self.redis.get(where) if self.redis else where.read_bytes())
        self.redis.set(where, bad) if self.redis else where.write_bytes(bad)
        return len(good), len(bad)

    def result(self) -> dict[str, Any]:
        """Rounds, damaged pages, audit, tier deletions and warnings of the case (`faults.summarize` sums them);
        the case's Redis pages are deleted."""
        logging.getLogger("pagedkv.offload").removeHandler(self.log)
        if self.redis is not None and (names := list(self.stored().values())):
            self.redis.unlink(*names)
        return {"connector": self.connector, "rounds": self.rounds, "damaged": self.damaged, "audit": self.audit_result,
                "page_bytes": self.page_bytes, "deleted": self.keys.deleted, "wall_s": time.perf_counter() - self.started,
                "warnings": [r.getMessage() for r in self.log.buffer]}  # fmt: skip
