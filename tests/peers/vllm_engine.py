"""A vLLM 0.33 engine core on CPU for the connector tests: vLLM's real `Scheduler` and `PagedKVConnector`
loaded by vLLM's own `KVConnectorFactory`, a KV cache allocated by vLLM's own `allocate_kv_cache`, and a
stand-in forward that writes each computed token's K/V (a function of the token prefix, so engines that
compute the same prefix write the same bytes).

    engine = Engine.build(model_dir, extra={"disk_offload_dir": ...})
    engine.add("r0", tokens); outputs = engine.run()   # schedule -> worker -> update_from_output until done
    engine.kv_of("r0", tokens)                          # bf16 [positions, L, H, C] of its blocks

Also runnable as a child process (`python vllm_engine.py SPEC.json`): one engine serves the spec's prompts
and writes their KV and the step log to the spec's "out" file (the cross-process tests).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_CACHE_ROOT", tempfile.mkdtemp(prefix="vllm-cache-"))  # model-info cache, not ~/.cache
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "offload"))  # redis_server, redis_cluster

import pytest  # noqa: E402
import torch  # noqa: E402

LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
BLOCK = 16


def vllm_or_skip() -> Any:
    """vLLM's modules (skips without vLLM; fails under PAGEDKV_REQUIRE_PEERS=1)."""
    try:
        from benchmarks.compare.peers import ensure_torchvision_ops

        ensure_torchvision_ops()
        import vllm.model_executor.models.registry as registry

        registry._run_in_subprocess = lambda fn: fn()  # the inspection subprocess lacks the torchvision fix
        from vllm import config, sampling_params
        from vllm.distributed.kv_transfer.kv_connector import factory
        from vllm.distributed.kv_transfer.kv_connector.v1 import base
        from vllm.utils import hashing
        from vllm.v1 import kv_cache_interface, outputs, request
        from vllm.v1.core import kv_cache_planning, kv_cache_utils
        from vllm.v1.core.sched import scheduler
        from vllm.v1.structured_output import StructuredOutputManager
        from vllm.v1.worker import utils as worker_utils
    except Exception as exc:  # noqa: BLE001 - any import failure means vLLM is not usable here
        if os.environ.get("PAGEDKV_REQUIRE_PEERS") == "1":
            pytest.fail(f"vLLM does not import ({exc}), and PAGEDKV_REQUIRE_PEERS=1")
        pytest.skip(f"vLLM does not import: {exc}")
    return type("V", (), dict(config=config, sampling_params=sampling_params, factory=factory, base=base,
                              hashing=hashing, kv=kv_cache_interface, outputs=outputs, request=request,
                              planning=kv_cache_planning, utils=kv_cache_utils, scheduler=scheduler,
                              StructuredOutputManager=StructuredOutputManager, worker_utils=worker_utils))  # fmt: skip


def model_dir(root: Path) -> str:
    """A tiny Llama config (no weights: nothing runs the model) that vLLM's ModelConfig accepts offline."""
    root.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "head_dim": 16,
              "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
              "vocab_size": 1000, "max_position_embeddings": 2048, "torch_dtype": "bfloat16"}  # fmt: skip
    (root / "config.json").write_text(json.dumps(config))
    return str(root)


def token_kv(tokens: list[int], pos: int, layer: int, heads: int, width: int) -> torch.Tensor:
    """The stand-in K/V of position `pos`: ``bf16 [H, C]``, a function of ``tokens[: pos + 1]`` and the layer."""
    digest = hashlib.sha256(repr((tokens[: pos + 1], layer)).encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
    return torch.randn((heads, width), generator=gen).to(torch.bfloat16)


@dataclass
class Engine:
    """One engine core: scheduler, worker-side connector and KV cache of `num_blocks` blocks."""

    v: Any
    scheduler: Any
    worker: Any
    caches: dict[str, torch.Tensor]
    hasher: Any
    log: list[dict[str, Any]] = field(default_factory=list)
    outputs: dict[str, list[int]] = field(default_factory=dict)
    blocks: dict[str, list[int]] = field(default_factory=dict)  # each request's blocks when last scheduled

    @classmethod
    def build(cls, model: str, extra: dict[str, Any], *, role: str = "kv_both", num_blocks: int = 64,
              layout: str = "LBHNC", policy: str = "recompute", kv_heads: int = 2, head_size: int = 16) -> Engine:  # fmt: skip
        v = vllm_or_skip()
        c = v.config
        vc = c.VllmConfig(
            model_config=c.ModelConfig(model=model, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=1024),
            cache_config=c.CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
            scheduler_config=c.SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=1024,
                                               is_encoder_decoder=False),
            kv_transfer_config=c.KVTransferConfig(kv_connector="PagedKVConnector",
                                                  kv_connector_module_path="pagedkv.integrations.vllm",
                                                  kv_role=role, kv_connector_extra_config=extra,
                                                  kv_load_failure_policy=policy),
            device_config=c.DeviceConfig(device="cpu"),
        )  # fmt: skip
        vc.cache_config.kv_cache_layout = layout
        vc.cache_config.num_gpu_blocks = num_blocks
        spec = v.kv.FullAttentionSpec(block_size=BLOCK, num_kv_heads=kv_heads, head_size=head_size,
                                      dtype=torch.bfloat16)  # fmt: skip
        groups = [v.kv.KVCacheGroupSpec(list(LAYERS), spec)]
        kvc = v.planning.get_kv_cache_config_from_groups(vc, groups, spec.page_size_bytes * len(LAYERS) * num_blocks)
        caches = v.worker_utils.allocate_kv_cache(
            kvc, torch.device("cpu"), vc.cache_config.get_resolved_kv_cache_layout()
        )
        scheduler = v.scheduler.Scheduler(vllm_config=vc, kv_cache_config=kvc, block_size=BLOCK, hash_block_size=BLOCK,
                                          structured_output_manager=v.StructuredOutputManager(vc))  # fmt: skip
        worker = v.factory.KVConnectorFactory.create_connector(vc, v.base.KVConnectorRole.WORKER, kvc)
        worker.register_kv_caches(caches)
        hash_fn = v.hashing.sha256
        v.utils.init_none_hash(hash_fn)
        return cls(v, scheduler, worker, caches, v.utils.get_request_block_hasher(BLOCK, hash_fn))

    def add(self, req_id: str, tokens: list[int], max_tokens: int = 2) -> None:
        params = self.v.sampling_params.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        self.scheduler.add_request(self.v.request.Request(req_id, list(tokens), params, None,
                                                          block_hasher=self.hasher))  # fmt: skip
        self.outputs[req_id] = []

    def forward(self, out: Any) -> None:
        """Write the K/V of every token this step computes (what attention layers would write)."""
        for req_id, n in out.num_scheduled_tokens.items():
            request = self.scheduler.requests[req_id]
            tokens = list(request.all_token_ids)
            (blocks,) = self.scheduler.kv_cache_manager.get_block_ids(req_id)
            self.blocks[req_id] = list(blocks)
            start = request.num_computed_tokens - n  # the scheduler already advanced it
            for pos in range(start, start + n):
                for layer, name in enumerate(LAYERS):
                    view = self.caches[name]  # [B, H, N, C]
                    view[blocks[pos // BLOCK], :, pos % BLOCK] = token_kv(tokens, pos, layer, view.shape[1],
                                                                         view.shape[3])  # fmt: skip

    def step(self, before_worker: Any = None) -> Any:
        """One engine step, in the order of vLLM's model runner (kv_connector_model_runner_mixin);
        `before_worker()` runs between the scheduler's step and the worker's."""
        v, s, w = self.v, self.scheduler, self.worker
        out = s.schedule()
        if before_worker is not None:
            before_worker()
        w.bind_connector_metadata(out.kv_connector_metadata)
        if out.has_sync_kv_loads:
            w.start_load_kv(None)
        self.forward(out)
        if not out.has_sync_kv_loads:
            w.start_load_kv(None)
        w.wait_for_save()
        results = w.get_transfer_results(out.finished_req_ids)
        invalid = w.get_block_ids_with_load_errors()
        w.clear_connector_metadata()
        meta = out.kv_connector_metadata
        self.log.append({
            "scheduled": dict(out.num_scheduled_tokens), "sync_loads": bool(out.has_sync_kv_loads),
            "loads": [(j.req_id, len(j.block_ids), j.is_async) for j in meta.loads],
            "saves": sum(len(j.block_ids) for j in meta.saves), "invalid": sorted(invalid),
            "recving": sorted(results.finished_recving),
            "computed": {r: s.requests[r].num_computed_tokens - n for r, n in out.num_scheduled_tokens.items()},
        })  # fmt: skip
        req_ids = list(out.num_scheduled_tokens)
        sampled = []
        for req_id in req_ids:
            request = s.requests[req_id]
            done_prefill = request.num_computed_tokens >= request.num_tokens
            sampled.append([7 + len(self.outputs[req_id])] if done_prefill else [])
            self.outputs[req_id] += sampled[-1]
        connector_output = v.outputs.KVConnectorOutput(
            finished_recving=results.finished_recving or None, failed_recving=results.failed_recving,
            invalid_block_ids=invalid)  # fmt: skip
        mro = v.outputs.ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                          sampled_token_ids=sampled, kv_connector_output=connector_output)  # fmt: skip
        s.update_from_output(out, mro)
        return out

    def run(self, max_steps: int = 200) -> list[dict[str, Any]]:
        """Step until every request finished; returns the step log."""
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished_requests():
                break
            self.step()
            if self.log[-1]["scheduled"] == {} and self.log[-1]["loads"] == []:
                import time

                time.sleep(0.005)  # an async load is running: let the loader thread work
        else:
            raise AssertionError(f"not finished after {max_steps} steps: {self.log[-3:]}")
        self.worker.wait_for_writes()
        return self.log

    def kv_of(self, req_id: str, tokens: list[int]) -> torch.Tensor:
        """``bf16 [positions, L, H, C]`` of the first `len(tokens)` positions of request `req_id`'s blocks
        (read after it finished: its freed blocks keep their bytes until reused)."""
        blocks = self.blocks[req_id]
        rows = []
        for pos in range(len(tokens)):
            rows.append(torch.stack([self.caches[n][blocks[pos // BLOCK], :, pos % BLOCK] for n in LAYERS]))
        return torch.stack(rows)

    def close(self) -> None:
        self.worker.shutdown()
        self.scheduler.connector.shutdown()


def expected_kv(tokens: list[int], heads: int = 2, width: int = 32) -> torch.Tensor:
    """``bf16 [positions, L, H, C]`` the stand-in forward writes for `tokens`."""
    return torch.stack([torch.stack([token_kv(tokens, p, layer, heads, width) for layer in range(len(LAYERS))])
                        for p in range(len(tokens))])  # fmt: skip


def main(spec_path: str) -> None:
    """Child process: serve spec["prompts"] on one engine; write their KV (bytes) and the log to spec["out"]."""
    spec = json.loads(Path(spec_path).read_text())
    engine = Engine.build(spec["model"], spec["extra"], layout=spec.get("layout", "LBHNC"))
    for i, tokens in enumerate(spec["prompts"]):
        engine.add(f"c{i}", tokens)
    log = engine.run()
    kv = {f"c{i}": engine.kv_of(f"c{i}", t) for i, t in enumerate(spec["prompts"])}
    stats = {name: s.snapshot() for name, s in engine.worker.tiers.stats.items()}
    torch.save({"kv": kv, "log": log, "stats": stats}, spec["out"])
    engine.close()


if __name__ == "__main__":
    main(sys.argv[1])
