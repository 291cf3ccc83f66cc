"""The manager state machine (`test_stateful.ManagerMachine`) with ``enable_partial_page_reuse`` on.

`check_integrity()` runs after every rule (enable_runtime_checks) and now also checks each pending page
copy (its destination is its request's first uncommitted page, its source cached and referenced) and
that the child index holds exactly the cached pages; a failed `alloc` leaves the pending copies and
the index unchanged (`snapshot`); and `PrefixStampModel` reads every copied slot after
`runtime_inputs` applied the copy, so a wrong source, a short or long copy, or a copy that never ran
shows up as a mismatch.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule
from test_stateful import EXAMPLES, ManagerMachine

from pagedkv.core.context import TextContext


class PartialReuseMachine(ManagerMachine):
    """`ManagerMachine` with partial-page reuse on, plus requests that share a live one's prefix cut anywhere."""

    extra_params: dict[str, object] = {"enable_partial_page_reuse": True}

    @initialize(
        page_size=st.sampled_from([2, 3, 4, 8]),
        num_pages=st.integers(6, 40),
        spec=st.sampled_from([0, 0, 2]),
        algo=st.sampled_from(["sha256", "sha256_64", "xxh3_128"]),
        layout=st.sampled_from(["mha", "mha-tp2", "mla-tp2", "swa", "hybrid", "hybrid-tp2"]),  # (state refuses it)
        policy=st.sampled_from(["lru", "slru", "arc"]),
    )
    def partial_setup(self, page_size: int, num_pages: int, spec: int, algo: str, layout: str, policy: str) -> None:
        super().setup(page_size=page_size, num_pages=num_pages, caching=True, spec=spec, algo=algo, layout=layout,
                      policy=policy, protect=0.25, leaves=False)  # fmt: skip

    setup = None  # type: ignore[assignment]  # replaced by partial_setup (caching on, no recurrent state)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def new_sibling(self, data: st.DataObject) -> None:
        """A request sharing a prefix of a live one, cut anywhere: the partial hits this machine is about."""
        c = data.draw(st.sampled_from(sorted(self.live.values(), key=lambda x: x.request_id)))
        cut = data.draw(st.integers(1, len(c.tokens)))
        tail = data.draw(st.lists(st.integers(0, 5), max_size=4))
        sibling = TextContext(self.next_id, [*c.tokens.all[:cut].tolist(), *tail], cache_salt=c.cache_salt)
        self.mgr.claim(sibling.request_id)
        self.live[self.next_id] = sibling
        self.next_id += 1

    @invariant()
    def pending_copies(self) -> None:
        if hasattr(self, "mgr"):
            partial = self.bm._partial
            assert partial is not None and set(partial.pending) <= set(self.live)


# twice the base machine's examples: a partial hit needs a committed page and a later sibling request
PartialReuseMachine.TestCase.settings = settings(ManagerMachine.TestCase.settings, max_examples=2 * EXAMPLES)
TestPartialReuseMachine = PartialReuseMachine.TestCase
