"""What the state ops (`gated_delta`, `ssd`, `selective_scan`) share: reading a batch's starting states
from their slots, and laying requests out as zero-padded chunks for the chunked prefill forms."""

from __future__ import annotations

import torch

__all__ = ["ChunkLayout", "initial_states"]


def initial_states(state: torch.Tensor, slots: torch.Tensor, has_state: torch.Tensor) -> torch.Tensor:
    """[B, ...]: each request's stored state ``state[slots[b]]``, or zeros where ``has_state[b]`` is False
    (the slot is never read then, so whatever it holds cannot leak in)."""
    stored = state[slots.long()]  # [B, ...]
    mask = has_state.reshape(-1, *([1] * (stored.dim() - 1)))  # [B, 1, ...]
    return torch.where(mask, stored, torch.zeros((), dtype=stored.dtype, device=stored.device))


class ChunkLayout:
    """Requests laid out as contiguous zero-padded chunks of `chunk_size` tokens.

    Request p owns packed rows ``starts[p]:starts[p] + lengths[p]``; its tokens fill chunks
    ``first_chunk[p]`` onwards (`n_chunks[p]` of them), the last one padded with zeros (as transformers pads), N chunks in all.
    `rows` [R] are the packed rows in layout order and `dest` [R] their positions in the ``N * C``
    padded rows.
    """

    def __init__(self, lengths: list[int], starts: list[int], chunk_size: int, device: torch.device) -> None:
        c = chunk_size
        self.chunk_size = c
        self.n_chunks = [-(-n // c) for n in lengths]  # per request
        first_chunk = [0]
        for n in self.n_chunks:
            first_chunk.append(first_chunk[-1] + n)
        self.total_rows, self.total_chunks = sum(lengths), first_chunk[-1]
        lengths_t = torch.tensor(lengths, device=device)  # [P]
        request = torch.repeat_interleave(
            torch.arange(len(lengths), device=device), lengths_t, output_size=self.total_rows
        )  # [R]
        token_start = torch.cumsum(lengths_t, 0) - lengths_t  # [P] first token of p among the R
        position = torch.arange(self.total_rows, device=device) - token_start[request]  # [R] within its request
        self.rows = torch.tensor(starts, device=device)[request] + position  # [R]
        self.first_chunk = torch.tensor(first_chunk[:-1], device=device)  # [P] each request's first chunk
        self.dest = self.first_chunk[request] * c + position  # [R]

    def padded(self, x: torch.Tensor) -> torch.Tensor:
        """[T, H, ...] packed rows -> [N, H, C, ...] zero-padded chunks."""
        flat = x.new_zeros((self.total_chunks * self.chunk_size, *x.shape[1:]))  # [N * C, H, ...]
        flat[self.dest] = x[self.rows]
        return flat.reshape(self.total_chunks, self.chunk_size, *x.shape[1:]).transpose(1, 2).contiguous()

    def unpadded(self, out: torch.Tensor) -> torch.Tensor:
        """[N, H, C, ...] chunk outputs -> [R, H, ...] in `rows` order."""
        return out.transpose(1, 2).reshape(self.total_chunks * self.chunk_size, *out.shape[1:2], *out.shape[3:])[
            self.dest
        ]
