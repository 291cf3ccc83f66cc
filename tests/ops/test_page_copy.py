"""`copy_page_slots` (vectorised) equals `copy_page_slots_reference` (loops), bit for bit, for every page dtype."""

from __future__ import annotations

import pytest
import torch

from pagedkv.ops.page_copy import copy_page_slots, copy_page_slots_reference

DTYPES = [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.float64]


def random_pages(dtype: torch.dtype, shape: tuple[int, ...] = (9, 2, 3, 5, 2, 4), seed: int = 0) -> torch.Tensor:
    """Pages [N, kv_dim, layers, page_size, heads, dim] holding random bytes of `dtype`."""
    g = torch.Generator().manual_seed(seed)
    width = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * width), generator=g, dtype=torch.uint8)
    return raw.view(dtype)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (random bytes hold NaNs, which `torch.equal` calls unequal)."""
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES)
def test_vectorised_equals_reference_and_copies_exactly_the_slots(dtype: torch.dtype) -> None:
    copies = [(0, 3, 2), (5, 1, 4), (2, 7, 1), (6, 8, 0)]
    for seed in range(3):
        pages = random_pages(dtype, seed=seed)
        before = pages.clone()
        ref, fast = pages.clone(), pages.clone()
        copy_page_slots_reference(ref, copies)
        copy_page_slots(fast, copies)
        assert same(ref, fast)
        raw, old = fast.view(torch.uint8), before.view(torch.uint8)
        for src, dst, n in copies:
            assert torch.equal(raw[dst, :, :, :n], old[src, :, :, :n])  # K and V, every layer and head
            assert torch.equal(raw[dst, :, :, n:], old[dst, :, :, n:])  # the rest of the page is untouched
        untouched = [p for p in range(pages.shape[0]) if p not in {d for _, d, _ in copies}]
        assert torch.equal(raw[untouched], old[untouched])


def test_scale_pages_and_mla_shapes() -> None:
    scales = random_pages(torch.float32, (6, 2, 2, 4, 3, 1))  # FP8 scales: one group per head
    latent = random_pages(torch.bfloat16, (6, 1, 2, 4, 1, 8))  # MLA: kv_dim 1, one head
    for pages in (scales, latent):
        ref = pages.clone()
        copy_page_slots_reference(ref, [(4, 0, 3)])
        copy_page_slots(pages, [(4, 0, 3)])
        assert same(ref, pages) and same(pages[0, :, :, :3], pages[4, :, :, :3])
    copy_page_slots(scales, [])  # nothing to do


@pytest.mark.parametrize(
    "copies,message",
    [
        ([(0, 9, 1)], "page copy \\(0, 9, 1\\) is invalid for 9 pages of 5 slots"),
        ([(0, 1, 6)], "is invalid"),
        ([(2, 2, 1)], "is invalid"),
        ([(0, 1, 1), (2, 1, 1)], "repeat a destination or read one"),
        ([(0, 1, 1), (1, 2, 1)], "repeat a destination or read one"),
    ],
)
def test_invalid_copies_are_refused(copies: list[tuple[int, int, int]], message: str) -> None:
    pages = random_pages(torch.float32)
    before = pages.clone()
    for op in (copy_page_slots, copy_page_slots_reference):
        with pytest.raises(ValueError, match=message):
            op(pages, copies)
    assert same(pages, before)
    with pytest.raises(ValueError, match="must be \\[pages, kv_dim, layers, page_size, heads, dim\\]"):
        copy_page_slots(pages[0], [])
