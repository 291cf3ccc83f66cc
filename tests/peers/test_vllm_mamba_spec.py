"""`MambaSpec` against vLLM 0.33's own `MambaSpec` (run in `.venv-peers`, `make test-peers`).

Same fields, same defaults, and the same byte arithmetic for random state layouts: the state's content,
the (padded) page, and a request's memory in vLLM's "none" and "align" modes.
"""

from __future__ import annotations

import dataclasses
import os
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from pagedkv.specs import MambaSpec, SchedulerLimits


def _vllm() -> Any:
    try:
        from vllm.v1 import kv_cache_interface
    except Exception as exc:  # noqa: BLE001 - any import failure means vLLM is not usable here
        if os.environ.get("PAGEDKV_REQUIRE_PEERS") == "1":
            pytest.fail(f"vLLM does not import ({exc}), and PAGEDKV_REQUIRE_PEERS=1")
        pytest.skip(f"vLLM does not import: {exc}")
    return kv_cache_interface


def test_fields_and_defaults_are_vllms() -> None:
    vllm = _vllm()
    base = {f.name for f in dataclasses.fields(vllm.KVCacheSpec)} - {"block_size"}  # vLLM's spec-wide fields
    theirs = {f.name: f.default for f in dataclasses.fields(vllm.MambaSpec) if f.name not in base}
    ours = {f.name: f.default for f in dataclasses.fields(MambaSpec)}
    assert set(theirs) == set(ours)
    for name in ("page_size_padded", "mamba_cache_mode", "num_speculative_blocks", "num_prefill_checkpoint_blocks",
                 "prefill_checkpoint_alignment", "num_heads", "tokens_per_state", "tp_replicated"):  # fmt: skip
        assert ours[name] == theirs[name], name
    assert str(theirs["mamba_type"].name).lower() == ours["mamba_type"]  # vLLM's enum, our string


@pytest.mark.parametrize("seed", range(20))
def test_byte_arithmetic_is_vllms(seed: int) -> None:
    vllm = _vllm()
    gen = torch.Generator().manual_seed(seed)
    dtypes = [torch.float32, torch.bfloat16, torch.float16]

    def rand(hi: int) -> int:
        return int(torch.randint(1, hi, (1,), generator=gen))

    shapes = tuple(tuple(rand(64) for _ in range(rand(4))) for _ in range(rand(4)))
    types = tuple(dtypes[rand(4) - 1] for _ in shapes)
    content = sum(
        torch.Size(s).numel() * torch.tensor([], dtype=d).element_size() for s, d in zip(shapes, types, strict=True)
    )
    common: dict[str, Any] = dict(block_size=rand(600), shapes=shapes, dtypes=types,
                                  page_size_padded=content + rand(100) if seed % 2 else None,
                                  num_speculative_blocks=rand(4) - 1, num_prefill_checkpoint_blocks=rand(3) - 1)  # fmt: skip
    theirs, ours = vllm.MambaSpec(**common), MambaSpec(**common)
    assert ours.state_content_size_bytes == theirs.state_content_size_bytes == content
    assert ours.real_page_size_bytes == theirs.real_page_size_bytes
    assert ours.page_size_bytes == theirs.page_size_bytes
    for mode in ("none", "align"):
        config = SimpleNamespace(cache_config=SimpleNamespace(mamba_cache_mode=mode))  # what vLLM reads of it
        ours_mode = dataclasses.replace(ours, mamba_cache_mode=mode)
        expected = theirs.max_memory_usage_bytes(config)
        assert ours.max_memory_usage_bytes(config) == expected, mode  # type: ignore[arg-type]  # vLLM's config decides
        assert ours_mode.max_memory_usage_bytes(SchedulerLimits(max_model_len=1)) == expected, mode  # else the spec
