"""The manager state machine with ``commit_on_alloc`` (and partial-page reuse) on.

Pages become hittable at `alloc`, before the forward pass writes them, so the machine keeps the flag's
contract: every request alloc'ed since the last forward runs in the next one, and none of them is
released before it. `PrefixStampModel` then proves that a request which hit another's pages in the same
step reads that request's values, and `check_integrity()` runs after every rule.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule
from test_stateful_partial import PartialReuseMachine

from pagedkv.core.context import TextContext


class CommitOnAllocMachine(PartialReuseMachine):
    extra_params: dict[str, object] = {"enable_partial_page_reuse": True, "commit_on_alloc": True}

    def _may_preempt(self, c: TextContext) -> bool:
        return c.request_id not in self.allocated  # (a request alloc'ed this step runs before it is released)

    @rule(data=st.data())
    def forward(self, data: st.DataObject) -> None:
        self._run(self._ready(), data)  # the contract: everything alloc'ed runs together

    def _releasable(self) -> list[int]:
        return sorted(set(self.live) - self.allocated)

    @precondition(lambda self: self.live and not self.allocated)
    @rule(data=st.data())
    def chunk(self, data: st.DataObject) -> None:  # chunk only between steps, before the next alloc
        super().chunk(data)

    def teardown(self) -> None:
        if hasattr(self, "mgr") and self.allocated:  # the contract: what was alloc'ed runs before release
            batch = self._ready()
            self.model.forward([batch])
            for c in batch:
                c.update(0)
            self.mgr.step([batch])
            self.allocated.clear()
        super().teardown()


CommitOnAllocMachine.TestCase.settings = settings(PartialReuseMachine.TestCase.settings)
TestCommitOnAlloc = CommitOnAllocMachine.TestCase
