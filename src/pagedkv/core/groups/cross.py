"""Cross-attention: the encoder's pages, allocated once per request, never prefix-cached."""

from __future__ import annotations

from pagedkv.core.groups.base import GroupManager, StepSpan

__all__ = ["CrossAttentionManager"]


class CrossAttentionManager(GroupManager):
    """The encoder's `encoder_length` tokens' pages, taken at the first `alloc` and kept to the release."""

    cacheable = False
    holds_tokens = False
    reads_encoder = True
    kind = "cross_attention"

    def pages_to_add(self, have: int, span: StepSpan) -> int:
        return -(-span.encoder_length // self.page_size) if have == 0 else 0

    def step_pages(self, start: int, end: int, length: int, spec: int = 0, encoder_length: int = 0) -> int:
        return -(-encoder_length // self.page_size)
