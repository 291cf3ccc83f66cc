"""`ops.store_kv` refuses what would write rows outside their request's pages, and `PagedStep.store` K/V that do not
fit the pages; a refused call leaves every page byte-identical, on every backend."""

from __future__ import annotations

import pytest
import torch
from test_masks_dense import paged_batch

from pagedkv import ops
from pagedkv.ops.masks import AttentionOptions

BACKENDS = ("reference", "torch")


def kv(tokens: int, heads: int = 2, dim: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(tokens, heads, dim, generator=g), torch.randn(tokens, heads, dim, generator=g)


def refused(inputs: object, call: object, match: str) -> None:
    """`call()` raises ValueError matching `match` on every backend and changes no page byte."""
    before = inputs.blocks.clone()  # type: ignore[attr-defined]
    for backend in BACKENDS:
        with ops.use_backend(backend), pytest.raises(ValueError, match=match):
            call()  # type: ignore[operator]
        assert torch.equal(inputs.blocks, before), backend  # type: ignore[attr-defined]


def test_offsets_giving_a_request_more_tokens_than_the_batch_has() -> None:
    """A batch of 7 + 5 new tokens with offsets 9 / 3: request 0's last rows would land past its pages."""
    inputs, offsets, _ = paged_batch(4, [7, 5], [7, 5], 2, 8)
    assert offsets.tolist() == [0, 7, 12]
    key, value = kv(12)
    refused(inputs, lambda: ops.store_kv(key, value, inputs, torch.tensor([0, 9, 12]), 0),
            r"input_row_offsets=\[0, 9, 12\] give request 0 9 tokens, more than the batch's longest, 7 "
            r"\(inputs.max_lengths\[0, 0\]\)")  # fmt: skip


def test_offsets_putting_rows_on_the_null_page() -> None:
    """7 + 3 new tokens read as 3 + 7: request 1 holds one page of 4 slots, its positions 4..6 have none."""
    inputs, _, _ = paged_batch(4, [7, 3], [7, 3], 2, 8)
    key, value = kv(10)
    refused(inputs, lambda: ops.store_kv(key, value, inputs, torch.tensor([0, 3, 10]), 0),
            r"input_row_offsets=\[0, 3, 10\] give request 1 7 tokens after its 0 cached ones: its token at "
            r"position 4 would land on column 1 of its lookup_table row, which holds the null page")  # fmt: skip


@pytest.mark.parametrize(
    "offsets,match",
    [
        ([[0, 7, 12]], r"input_row_offsets has shape \(1, 3\); a batch of 2 needs \[3\]"),
        ([0, 12], r"input_row_offsets has shape \(2,\); a batch of 2 needs \[3\]"),
        ([1, 7, 12], r"input_row_offsets=\[1, 7, 12\] must start at 0 and never decrease"),
        ([0, 13, 12], r"input_row_offsets=\[0, 13, 12\] must start at 0 and never decrease"),
    ],
)
def test_malformed_offsets(offsets: list, match: str) -> None:
    inputs, _, _ = paged_batch(4, [7, 5], [7, 5], 2, 8)
    key, value = kv(12)
    refused(inputs, lambda: ops.store_kv(key, value, inputs, torch.tensor(offsets), 0), match)


def test_two_dimensional_offsets_for_attention() -> None:
    inputs, _, _ = paged_batch(4, [7, 5], [7, 5], 2, 8)
    query = torch.randn(12, 4, 8)
    for backend in BACKENDS:
        with ops.use_backend(backend), pytest.raises(ValueError, match=r"input_row_offsets has shape \(1, 3\)"):
            ops.paged_attention(query, inputs, torch.tensor([[0, 7, 12]]), 0)


def test_value_for_a_kv_cache_is_required_and_none_for_mla() -> None:
    inputs, offsets, _ = paged_batch(4, [7, 5], [7, 5], 2, 8)
    key, value = kv(12)
    refused(inputs, lambda: ops.store_kv(key, None, inputs, offsets, 0), "value is None but the cache stores K and V")
    mla, _, _ = paged_batch(4, [7, 5], [7, 5], 1, 8, kv_dim=1)
    refused(
        mla, lambda: ops.store_kv(key[:, :1], value[:, :1], mla, offsets, 0), "value given for a cache with kv_dim=1"
    )


def test_a_dummy_request_writes_to_the_null_page() -> None:
    """A dummy request (its lookup-table row all null pages, as `claim(dummy=True)` gives) is accepted."""
    inputs, offsets, _ = paged_batch(4, [7, 5], [7, 5], 2, 8)
    null = inputs.blocks.shape[0] - 1
    inputs.lookup_table[1] = null
    key, value = kv(12)
    for backend in BACKENDS:
        with ops.use_backend(backend):
            ops.store_kv(key, value, inputs, offsets, 0)
        page = inputs.lookup_table[0, 1].long()
        assert torch.equal(inputs.blocks[page, 0, 0, :3], key[4:7]), backend


@pytest.mark.parametrize("heads,dim", [(4, 8), (2, 4), (1, 16)])
def test_step_store_refuses_kv_of_another_layout(heads: int, dim: int) -> None:
    """`PagedStep.store` checks K/V against the pages once per step: K of 4 heads never lands in pages of 2."""
    inputs, offsets, _ = paged_batch(4, [7, 5], [7, 5], 2, 8)
    before = inputs.blocks.clone()
    key, value = kv(12, heads, dim)
    step = ops.PagedStep.build(inputs, offsets, 12, AttentionOptions())
    with pytest.raises(
        ValueError, match=rf"key shape \(12, {heads}, {dim}\) != the step's \[T, H_kv, D\]=\[12, 2, 8\]"
    ):
        step.store(key, value, 0)
    good_key, good_value = kv(12)
    with pytest.raises(ValueError, match=r"value shape \(12, 2, 4\) != the step's"):
        step.store(good_key, good_value[..., :4], 0)
    with pytest.raises(ValueError, match="value is None but the cache stores K and V"):
        step.store(good_key, None, 0)
    assert torch.equal(inputs.blocks, before)
    step.store(good_key, good_value, 0)  # the right layout is stored
    assert torch.equal(inputs.blocks[inputs.lookup_table[0, 0].long(), 1, 0], good_value[:4])
