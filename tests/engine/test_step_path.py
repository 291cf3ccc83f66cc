"""One decode step, one pass: per step (not per layer) option builds, argument checks, positions, H2D copies."""

from __future__ import annotations

import pytest

from benchmarks.step_calls import count_step_calls

PER_STEP_ONCE = [
    "pagedkv.ops.masks:AttentionOptions.__init__",  # the group's options, built in ForwardContext.build
    "pagedkv.ops.checks:check_step",  # the step's inputs and offsets, checked once
    "pagedkv.ops.masks:AttentionOptions.check",  # the options, checked once
    "pagedkv.ops.metadata:PagedMetadata.build",  # token requests and positions, computed once
    "pagedkv.hf.context:ForwardContext.build",
    "pagedkv.ops.torch_decode:_build_batched_plan",  # decode groups, page rows, masks, gather buffer
]
NEVER = [  # per-call checks of the public entry points and the backends' own checks: not on the step's path
    "pagedkv.ops.checks:check_store",
    "pagedkv.ops.checks:check_attention",
    "pagedkv.ops.checks:_check_inputs",
    "pagedkv.ops.checks:_check_tokens",
    "pagedkv.ops.triton_decode:_check_arguments",
]


@pytest.mark.parametrize("num_layers", [2, 5])
def test_decode_step_builds_checks_and_copies_once_per_step(num_layers: int) -> None:
    result = count_step_calls(num_layers=num_layers, batch=3, steps=3)
    per_step = result["per_step"]
    for name in PER_STEP_ONCE:
        assert per_step.get(name) == 1, (name, per_step.get(name))
    for name in NEVER:
        assert name not in per_step, name
    assert per_step["pagedkv.runtime.transfer:to_device"] == 2  # one per table: lookup table, cache lengths
    assert per_step["pagedkv.ops:PagedStep.store"] == num_layers
    assert per_step["pagedkv.ops:PagedStep.attend"] == num_layers
