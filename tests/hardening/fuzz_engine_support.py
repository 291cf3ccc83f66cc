"""Parts of the engine machine (`test_stateful_engine.EngineMachine`) shared with its plain tests.

- The model and its shadow: `CONFIG` (a tiny fp32 Llama for `pagedkv.testing.build_llama`), `PREFIXES`
  (shared system prompts), `ATOL` (the logits tolerance, argued below), and `reference(seed, prompt)`:
  greedy tokens and logits of transformers itself with no cache, computed once per (weights, prompt).
- What the installed engine supports (`HAS_SALT`, `HAS_UPDATE`, `HAS_VERSION`), `CONNECTORS` and
  `REPORT`, the machine's `FuzzReport` (`test_stateful_engine` starts and writes it).
- `Tracked`: what the machine knows about one request.
- `EngineTierRules`: a mixin holding the machine's cache and tier rules (`reset_prefix_cache`,
  `sync_tiers`, `tier_fault`) and the restart they share with the teardown (`restart`, `_close`).
  The machine lists it in its bases, so Hypothesis finds these `@rule`s on it; the state they use
  (`engine`, `mgr`, `conn`, `tracked`, the counters) and `drain`, `_build`, `_add` are the machine's.
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from fuzz_support import (
    DISK_FAULTS,
    REDIS,
    REDIS_FAULTS,
    FuzzReport,
    disk_fault,
    has_hmac,
    redis_fault,
    redis_is_up,
    shared_redis,
)
from hypothesis import strategies as st
from hypothesis.stateful import rule

from pagedkv.engine import LLMEngine
from pagedkv.engine.request import Request
from pagedkv.params import KVCacheParams
from pagedkv.testing import build_llama

CONFIG = dict(
    vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.2,
)  # fmt: skip
MAX_NEW = 6
# Logits tolerance, fp32. The engine and the reference compute the same function in a different order:
# paged attention over pages (chunked online softmax, GQA by index) vs eager attention over one matrix,
# and the engine's matmuls run on packed ragged batches of other shapes. Each reordered fp32 reduction
# moves a result by a few ulps (~1e-7 relative); through 2 layers of width 32 the logits (|x| < ~5) move
# by a few 1e-6: the largest difference seen over 32,273 compared logit rows of the long run was 5.1e-6
# (6e-6 in other runs). 1e-4 (the README's parity bound) leaves a margin of ~17x over that, while one
# page holding another prefix's KV moves these logits by 1.5 to 4.3 (measured on this model): 4 orders
# of magnitude above the tolerance, so a wrong page cannot hide in it.
ATOL = 1e-4
RNG = np.random.default_rng(7)
PREFIXES = [RNG.integers(3, 97, size=n).tolist() for n in (12, 7, 17)]  # shared system prompts
CONNECTORS = ["tiered", *(["redis"] if REDIS else [])]
REPORT = FuzzReport("engine+tiers")

HAS_SALT = "cache_salt" in inspect.signature(LLMEngine.add_request).parameters
HAS_UPDATE = hasattr(LLMEngine, "update_weights")
HAS_VERSION = "weights_version" in {f.name for f in dataclasses.fields(KVCacheParams)}

_models: dict[int, Any] = {}  # weights seed -> reference model (eager attention, never switched)
_references: dict[tuple[int, tuple[int, ...]], tuple[list[int], torch.Tensor]] = {}


def reference_model(seed: int) -> Any:
    if seed not in _models:
        _models[seed] = build_llama(seed, "eager", **CONFIG)
    return _models[seed]


def reference(seed: int, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and logits [MAX_NEW, V] of transformers itself, no cache: one full forward per token."""
    key = (seed, tuple(prompt))
    if key not in _references:
        model, ids, logits = reference_model(seed), list(prompt), []
        with torch.inference_mode():
            for _ in range(MAX_NEW):
                out = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1].float()  # [V]
                logits.append(out)
                ids.append(int(torch.argmax(out)))
        _references[key] = (ids[len(prompt) :], torch.stack(logits))
    return _references[key]


@dataclass(eq=False)
class Tracked:
    """What the machine knows about one request."""

    request: Request
    prompt: list[int]
    max_new: int
    weights: int  # the weights seed when it was added
    switches: int  # the number of weight switches before it was added
    salt: str | None
    fresh_salt: bool  # a salt nobody else uses: it must never hit the prefix cache
    done: bool = False


class EngineTierRules:
    """The cache and tier rules of `EngineMachine`, and its restart (a mixin: the state is the machine's)."""

    @rule()
    def reset_prefix_cache(self) -> None:
        self.mgr.reset_prefix_cache()
        self.ops += 1

    @rule()
    def sync_tiers(self) -> None:
        self.mgr.sync_tiers()
        self.ops += 1

    def restart(self, replay: int) -> None:
        """A new process on the same tiers (everything finished, the engine closed and built again, device
        and host empty), then some earlier prompts again: their pages come from disk or Redis."""
        self._close()
        self._build()
        self.restarts += 1
        rng = np.random.default_rng(replay)
        done = [t for t in self.tracked[-24:]]
        for i in rng.permutation(len(done))[:4].tolist():
            t = done[i]
            self._add(t.prompt, int(rng.integers(1, MAX_NEW + 1)), t.salt if not t.fresh_salt else None)
        self.ops += 1

    def _close(self) -> None:
        """Finish every request, check nothing leaked, account and close the engine's tiers."""
        self.drain()
        assert all(t.done for t in self.tracked), "a request never finished"
        self.mgr.check_integrity()
        assert self.mgr.get_num_used_pages() == 0, "pages leaked after every request finished"
        if self.mgr.can_swap:
            assert self.mgr.tiers.swap_spaces[0].rows_lent == 0, "host rows still lent to swapped requests"
        stats = self.mgr.tier_stats()
        self.mgr.close()
        assert not self.mgr.tiers.connectors, "connectors still attached after close"
        summary = self.engine.summary
        REPORT.add(
            forward_steps=summary["steps"], tokens_generated=summary["generated_tokens"],
            prompt_tokens=summary["prompt_tokens"], prompt_tokens_cached=summary["prompt_tokens_cached"],
            preemptions=summary["preemptions"], swaps=summary["swaps"],
            **{f"pages_loaded_{name}": int(s["pages_loaded"]) for name, s in stats.items()},
            **{f"pages_refused_{name}": int(s["refused"]) for name, s in stats.items() if name != "host"},
        )  # fmt: skip

    @rule(kind=st.integers(0, 63), picks=st.lists(st.integers(0, 2**16), min_size=2, max_size=4),
          cold=st.integers(0, 2))  # fmt: skip
    def tier_fault(self, kind: int, picks: list[int], cold: int) -> None:
        """Damage the tier below host memory for real, while its writes may still be running; `cold == 0`
        (a third of the time): then `restart`, so the damaged pages are read back."""
        forge = ["forge"] if has_hmac(self.mgr.params.kv_connector_config) else []
        row_bytes = int(self.conn.mover.row_bytes)
        if self.connector == "tiered":
            kinds = [*DISK_FAULTS, *forge]
            name = kinds[kind % len(kinds)]
            done = disk_fault(self.conn.lower[0].root, name, picks, row_bytes)
        elif not redis_is_up():
            name, done = "redis_up", 1
            shared_redis()  # start it again on its port, empty
        else:
            kinds = [*REDIS_FAULTS, *forge, "redis_down"]
            name = kinds[kind % len(kinds)]
            if name == "redis_down":
                done = 1
                shared_redis().stop()  # kill -9; the engine serves without it until a later tier_fault
            else:
                client = shared_redis().client()
                try:
                    done = redis_fault(client, self.prefix, name, picks, row_bytes)
                finally:
                    client.close()
        self.faults += done
        REPORT.add(**{f"fault_{self.connector}_{name}": done})
        self.ops += 1
        if cold == 0:
            self.restart(picks[0])
