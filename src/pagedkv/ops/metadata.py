"""`PagedMetadata`: the per-step index tensors every layer's `store_kv` and `paged_attention` share.

A ragged batch packs the active tokens of B requests into one token axis of
length T; ``input_row_offsets[b]:input_row_offsets[b + 1]`` are request b's
tokens. Token i of request b sits at absolute position
``cache_lengths[b] + i``, and its KV lives in page
``lookup_table[b, pos // page_size]`` at slot ``pos % page_size``. Build the
metadata once per step (it costs a few small tensor ops) and pass it to every
layer; the max lengths come from the host-side `max_lengths` table, so
building it never waits on the device.

Cross-attention steps (``causal=False``) store no keys: every query token of
request b attends the ``cache_lengths[b]`` keys already cached, so
``kv_lengths = cache_lengths`` and the tokens own no slot (`store_kv` refuses
such metadata).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from pagedkv.runtime.inputs import RaggedKVCacheInputs

__all__ = ["PagedMetadata"]


@dataclass(frozen=True, eq=False)
class PagedMetadata:
    """Index tensors of one step's ragged batch (all on the cache's device, int64).

    Attributes:
        page_size: tokens per page.
        input_row_offsets: [B + 1] start of each request's tokens on the token axis.
        cache_lengths: [B] tokens already cached before this step.
        lookup_table: [B, C] page ids, null-padded.
        token_request: [T] request index of each token.
        token_position: [T] absolute position of each token.
        slot_page: [T] page each token's KV is written to (the null page when not causal).
        slot_offset: [T] slot within that page.
        kv_lengths: [B] keys visible to the request's last token (cache + new tokens; the cache when
            not causal).
        max_q_len: longest active window (host int).
        max_kv_len: longest kv_lengths (host int; an upper bound when not causal).
        causal: False for a cross-attention step (see module docstring).
        plans: per-step plans the attention paths derive from these tensors (`torch_decode`'s gather plan,
            `torch_fresh`'s split of the batch), built by the first layer that needs one and reused by the
            others: a step builds its metadata once, not per layer. Keyed by the path's own tuple.
    """

    page_size: int
    input_row_offsets: torch.Tensor
    cache_lengths: torch.Tensor
    lookup_table: torch.Tensor
    token_request: torch.Tensor
    token_position: torch.Tensor
    slot_page: torch.Tensor
    slot_offset: torch.Tensor
    kv_lengths: torch.Tensor
    max_q_len: int
    max_kv_len: int
    causal: bool = True
    plans: dict[tuple[Any, ...], Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def num_requests(self) -> int:
        """B."""
        return self.cache_lengths.shape[0]

    @property
    def num_tokens(self) -> int:
        """T."""
        return self.token_request.shape[0]

    def subset(self, requests: torch.Tensor) -> tuple[PagedMetadata, torch.Tensor]:
        """The metadata of the batch's requests `requests` (int64 [B'], increasing) alone, and their tokens.

        Returns (metadata of a batch of B' requests, int64 [T'] indices of their tokens on this batch's token
        axis, increasing). The max lengths stay this batch's (upper bounds).
        """
        device = self.cache_lengths.device
        q_lens = (self.input_row_offsets[1:] - self.input_row_offsets[:-1])[requests]  # [B']
        offsets = torch.zeros(requests.shape[0] + 1, dtype=torch.int64, device=device)  # [B' + 1]
        torch.cumsum(q_lens, 0, out=offsets[1:])
        renumber = torch.full((self.num_requests,), -1, dtype=torch.int64, device=device)  # [B]: old -> new
        renumber[requests] = torch.arange(requests.shape[0], device=device)
        new_request = renumber[self.token_request]  # [T]: -1 for tokens of other requests
        tokens = torch.nonzero(new_request >= 0).flatten()  # [T']
        sub = PagedMetadata(
            page_size=self.page_size,
            input_row_offsets=offsets,
            cache_lengths=self.cache_lengths[requests],
            lookup_table=self.lookup_table[requests],
            token_request=new_request[tokens],
            token_position=self.token_position[tokens],
            slot_page=self.slot_page[tokens],
            slot_offset=self.slot_offset[tokens],
            kv_lengths=self.kv_lengths[requests],
            max_q_len=self.max_q_len,
            max_kv_len=self.max_kv_len,
            causal=self.causal,
        )
        return sub, tokens

    @classmethod
    def build(
        cls,
        inputs: RaggedKVCacheInputs,
        input_row_offsets: torch.Tensor,
        num_tokens: int | None = None,
        step: int = 0,
        *,
        causal: bool = True,
        positions_of: PagedMetadata | None = None,
    ) -> PagedMetadata:
        """Metadata for `inputs` and the batch's `input_row_offsets` (int [B + 1], starting at 0).

        `num_tokens` (T, known on the host) lets a CUDA caller avoid a device
        sync; on CPU it is read from the offsets. `step` picks the row of a
        multistep `max_lengths` table (after `increment_cache_lengths`, row 0
        is again the current step). ``causal=False`` builds a cross-attention
        step (see module docstring). `positions_of`: the metadata of another
        page-table group of the same step whose inputs share this one's
        ``cache_lengths`` tensor (hybrid models) and offsets; its token
        requests and positions are reused instead of computed again. Raises
        ValueError when the offsets do not match the batch size.
        """
        if positions_of is not None:
            return cls._with_positions(inputs, positions_of, step, causal)
        device = inputs.cache_lengths.device
        lengths = inputs.cache_lengths.to(torch.int64)  # [B]
        offsets = input_row_offsets.to(device=device, dtype=torch.int64)  # [B + 1]
        if offsets.dim() != 1 or offsets.shape[0] != lengths.shape[0] + 1:
            raise ValueError(
                f"input_row_offsets has shape {tuple(offsets.shape)}; a batch of {lengths.shape[0]} needs "
                f"[{lengths.shape[0] + 1}]"
            )
        q_lens = offsets[1:] - offsets[:-1]  # [B]
        if offsets.device.type == "cpu" and (int(offsets[0]) != 0 or bool((q_lens < 0).any())):  # (no sync on CUDA)
            raise ValueError(f"input_row_offsets={offsets.tolist()} must start at 0 and never decrease")
        max_q, max_kv = (int(v) for v in inputs.max_lengths[step].tolist())  # host table: no device sync
        if num_tokens is None and offsets.device.type == "cpu":
            num_tokens = int(offsets[-1])
        token_request = torch.repeat_interleave(
            torch.arange(lengths.shape[0], device=device), q_lens, output_size=num_tokens
        )  # [T]
        token_position = lengths[token_request] + (
            torch.arange(token_request.shape[0], device=device) - offsets[:-1][token_request]
        )  # [T]
        return cls._assemble(inputs, offsets, lengths, token_request, token_position, max_q, max_kv, causal)

    @classmethod
    def _with_positions(
        cls, inputs: RaggedKVCacheInputs, other: PagedMetadata, step: int, causal: bool
    ) -> PagedMetadata:
        """`build` for a group that shares `other`'s cache lengths and offsets: only its own pages differ."""
        if inputs.lookup_table.shape[0] != other.num_requests:
            raise ValueError(f"positions_of has {other.num_requests} requests; these inputs have "
                             f"{inputs.lookup_table.shape[0]}")  # fmt: skip
        max_q, max_kv = (int(v) for v in inputs.max_lengths[step].tolist())  # host table: no device sync
        return cls._assemble(
            inputs, other.input_row_offsets, other.cache_lengths, other.token_request, other.token_position,
            max_q, max_kv, causal,
        )  # fmt: skip

    @classmethod
    def _assemble(
        cls, inputs: RaggedKVCacheInputs, offsets: torch.Tensor, lengths: torch.Tensor, token_request: torch.Tensor,
        token_position: torch.Tensor, max_q: int, max_kv: int, causal: bool,
    ) -> PagedMetadata:  # fmt: skip
        """The metadata of `inputs`' pages for the step's token requests and positions ([T] each)."""
        page_size = inputs.blocks.shape[3]
        q_lens = offsets[1:] - offsets[:-1]  # [B]
        lut = inputs.lookup_table.to(torch.int64)  # [B, C]
        if causal:
            slot_page = lut[token_request, token_position // page_size]  # [T]
        else:  # no new keys: positions past the cache may lie past the table
            slot_page = torch.full_like(token_position, inputs.blocks.shape[0] - 1)  # [T] the null page
        return cls(
            page_size=page_size,
            input_row_offsets=offsets,
            cache_lengths=lengths,
            lookup_table=lut,
            token_request=token_request,
            token_position=token_position,
            slot_page=slot_page,
            slot_offset=token_position % page_size,
            kv_lengths=lengths + q_lens if causal else lengths,
            max_q_len=max_q,
            max_kv_len=max_kv,
            causal=causal,
        )
