"""The manager state machine (`test_stateful.ManagerMachine`) on models with recurrent state and prefix caching:
state checkpoints are saved (prompt ends, divergence cuts, releases), hit, evicted (three at most, so the
rows' eviction runs) and give their tail pages back when attention pages run short.

`check_integrity()` runs after every rule and checks both pools (state rows: live rows, restores, one entry
and index per checkpoint; attention pages: references, checkpoints' tails included); a failed `alloc`
leaves both exactly as they were (`snapshot`); `PrefixStampModel` proves every restored state row holds
its own prefix's stamp and every copied tail slot its own prefix's KV; at the end only checkpoints' tails
hold pages, and none once the prefix cache is reset.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, precondition, rule
from test_stateful import EXAMPLES, ManagerMachine
from test_stateful_partial import PartialReuseMachine

from pagedkv.core.context import TextContext
from pagedkv.core.pool import EVICTION_POLICIES


class CheckpointMachine(ManagerMachine):
    """`ManagerMachine` on the state layouts with caching on, plus siblings of live requests and chunks
    that end at checkpoint cuts."""

    extra_params: dict[str, object] = {"max_state_checkpoints": 3}

    @initialize(
        page_size=st.sampled_from([1, 2, 3, 4, 8]),
        num_pages=st.integers(6, 40),
        spec=st.sampled_from([0, 0, 2]),
        algo=st.sampled_from(["sha256", "sha256_64", "xxh3_128"]),
        layout=st.sampled_from(["state", "state-tp2"]),
        policy=st.sampled_from(list(EVICTION_POLICIES)),  # every registered policy
    )
    def state_setup(self, page_size: int, num_pages: int, spec: int, algo: str, layout: str, policy: str) -> None:
        super().setup(page_size=page_size, num_pages=num_pages, caching=True, spec=spec, algo=algo, layout=layout,
                      policy=policy, protect=0.25, leaves=False)  # fmt: skip

    setup = None  # type: ignore[assignment]  # replaced by state_setup

    new_sibling = PartialReuseMachine.new_sibling  # siblings cut anywhere: divergence points and tail hits

    @precondition(lambda self: any(c.tokens.processed_length for c in self.live.values()))
    @rule(data=st.data())
    def next_turn(self, data: st.DataObject) -> None:
        """A conversation's next turn: a request that made progress is released (its live state becomes a
        checkpoint when its last alloc was stepped) and its tokens come back with more."""
        c = data.draw(st.sampled_from(sorted((c for c in self.live.values() if c.tokens.processed_length),
                                             key=lambda x: x.request_id)))  # fmt: skip
        self.mgr.release(c.request_id)
        self.allocated.discard(c.request_id)
        del self.live[c.request_id]
        tail = data.draw(st.lists(st.integers(0, 5), min_size=1, max_size=6))
        turn = TextContext(self.next_id, [*c.tokens.all.tolist(), *tail], cache_salt=c.cache_salt)
        self.mgr.claim(turn.request_id)
        self.live[self.next_id] = turn
        self.next_id += 1

    @precondition(lambda self: self.allocated)
    @rule(data=st.data())
    def chunk_at_cut(self, data: st.DataObject) -> None:
        """End an allocated request's window at its checkpoint cut, as a scheduler does."""
        c = data.draw(st.sampled_from(sorted((self.live[r] for r in self.allocated), key=lambda x: x.request_id)))
        cut = self.mgr.checkpoint_cut(c.request_id)
        tokens = c.tokens
        if cut is not None and tokens.processed_length < cut < tokens.current_position:
            tokens.chunk(cut - tokens.processed_length)


CheckpointMachine.TestCase.settings = settings(ManagerMachine.TestCase.settings, max_examples=EXAMPLES)
TestCheckpointMachine = CheckpointMachine.TestCase
