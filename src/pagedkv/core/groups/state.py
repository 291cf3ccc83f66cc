"""Recurrent state (Mamba, gated delta net, short convolutions): rows of the state pool, not pages."""

from __future__ import annotations

from pagedkv.core.groups.base import GroupManager, StepSpan
from pagedkv.specs import KVCacheSpec, MambaSpec

__all__ = ["MambaManager"]


class MambaManager(GroupManager):
    """A request holds `state_slots` rows of the state pool (its live state and its draft slots,
    `checkpoints.StateCheckpoints`) from its first `alloc` to its release, whatever its length. A row is one
    state, updated in place each step, so the group takes no attention page, its table never grows or drops,
    and prefix hits come from state checkpoints, not from its pages."""

    cacheable = False
    holds_tokens = False
    kind = "mamba"

    def __init__(self, group: int, page_size: int, slots: int = 1) -> None:
        super().__init__(group, page_size)
        self.state_slots = slots

    @classmethod
    def from_spec(cls, group: int, spec: KVCacheSpec) -> GroupManager:
        assert isinstance(spec, MambaSpec)
        return cls(group, spec.block_size, spec.slots_per_request)

    def pages_to_add(self, have: int, span: StepSpan) -> int:
        return 0  # (its rows come from the state pool, taken with the request's first pages)

    def step_pages(self, start: int, end: int, length: int, spec: int = 0, encoder_length: int = 0) -> int:
        return 0
