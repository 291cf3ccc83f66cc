"""What one engine holds, per medium, as its KV events told it (pure bookkeeping, no I/O)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pagedkv.router.wire import CLEARED, STORED, WireBatch

__all__ = ["EngineCache", "StreamStats"]


@dataclass
class StreamStats:
    """Counters of one engine's event stream (all monotonic over the index's life).

    Attributes:
        batches, events: applied (live or replayed); removals: `BlockRemoved` events among them.
        gaps: times a sequence number was skipped; replays: replay requests sent;
        replayed: batches applied from replays; unrecovered: gaps a replay could not fill
        (no replay endpoint, timeout, or the publisher's buffer no longer reached back);
        restarts: sequence decreases (the publisher restarted: the engine's entries were dropped);
        malformed: messages counted and skipped (bad frames, payload or event);
        clears: `AllBlocksCleared` events; ignored_groups: events of KV groups other than 0;
        other_topics: messages whose topic frame is not exactly the engine's topic, skipped (a ZMQ
        subscription matches topic prefixes: subscribed to ``kv``, the socket also gets ``kv-metrics``).
    """

    batches: int = 0
    events: int = 0
    removals: int = 0
    gaps: int = 0
    replays: int = 0
    replayed: int = 0
    unrecovered: int = 0
    restarts: int = 0
    malformed: int = 0
    clears: int = 0
    ignored_groups: int = 0
    other_topics: int = 0


@dataclass
class EngineCache:
    """The block hashes (in event form) one engine announced as held, per medium ("GPU", "CPU", "DISK",
    "REDIS", "STORAGE", ...), and the state of its stream.

    Only KV group 0 is tracked (a model's full-attention group; events of other groups are counted in
    `stats.ignored_groups`). A hash stored twice and removed once counts as gone, as vLLM's one
    `BlockRemoved` per evicted key implies.
    """

    held: dict[str, set[bytes | int]] = field(default_factory=dict)
    next_seq: int | None = None  # the sequence number expected next (None: nothing received yet)
    last_message: float | None = None  # time.monotonic() of the last message (live or replayed)
    stats: StreamStats = field(default_factory=StreamStats)

    def apply(self, batch: WireBatch) -> None:
        """Apply one batch's events in order (stores add, removals drop, a clear empties every medium)."""
        self.stats.batches += 1
        for event in batch.events:
            self.stats.events += 1
            if event.kind == CLEARED:
                self.held.clear()
                self.stats.clears += 1
                continue
            if event.group_idx:
                self.stats.ignored_groups += 1
                continue
            if event.kind == STORED:
                self.held.setdefault(event.medium, set()).update(event.block_hashes)
            else:
                self.stats.removals += 1
                held = self.held.get(event.medium)
                if held:
                    held.difference_update(event.block_hashes)

    def clear(self) -> None:
        """Forget every entry (a restarted publisher: its engine starts empty)."""
        self.held.clear()

    def num_blocks(self) -> dict[str, int]:
        """Blocks held per medium."""
        return {medium: len(hashes) for medium, hashes in self.held.items() if hashes}

    def leading_blocks(self, hashes: Sequence[bytes | int]) -> int:
        """How many of `hashes`, from the first, are held in some medium."""
        mediums = [h for h in self.held.values() if h]
        n = 0
        for key in hashes:
            if not any(key in held for held in mediums):
                break
            n += 1
        return n

    def leading_blocks_by_medium(self, hashes: Sequence[bytes | int]) -> dict[str, int]:
        """Per medium, how many of `hashes`, from the first, that medium alone holds."""
        out: dict[str, int] = {}
        for medium, held in self.held.items():
            n = 0
            for key in hashes:
                if key not in held:
                    break
                n += 1
            out[medium] = n
        return out
