"""`TierIndex`: which content hash sits in which slot of a fixed-size tier (the host rows), in LRU order.

Pure Python and thread-safe (one lock): the main thread looks up and
inserts, transfer threads unpin when a write below has read a slot. A
pinned slot is never evicted or reused; an entry removed while pinned
(`clear`) frees its slot at the last `unpin`.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable

from pagedkv.core.errors import require
from pagedkv.params.validation import check_int

__all__ = ["TierIndex"]


class TierIndex:
    """key -> slot for `capacity` slots; the least recently used unpinned entry is evicted first."""

    def __init__(self, capacity: int) -> None:
        check_int("capacity", capacity, 1)
        self.capacity = capacity
        self.lock = threading.RLock()
        self._slots: OrderedDict[bytes, int] = OrderedDict()  # oldest first
        self._free = list(range(capacity - 1, -1, -1))  # slot 0 handed out first
        self._pins = [0] * capacity
        self._orphans: set[int] = set()  # removed while pinned: freed at the last unpin
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, key: object) -> bool:
        return key in self._slots

    def get(self, key: bytes) -> int | None:
        """The slot of `key`, or None. No side effects."""
        return self._slots.get(key)

    def touch(self, key: bytes) -> None:
        """Make `key` the most recently used."""
        with self.lock:
            self._slots.move_to_end(key)

    def insert(self, key: bytes) -> tuple[int, bytes | None] | None:
        """A slot for the new `key` and the key evicted to make room (or None): free slots first,
        then the least recently used unpinned entry. None (and no change) when every slot is pinned."""
        with self.lock:
            require(key not in self._slots, f"key {key.hex()} is already in the tier")
            evicted = None
            if self._free:
                slot = self._free.pop()
            else:
                victim = next((k for k, s in self._slots.items() if not self._pins[s]), None)
                if victim is None:
                    return None
                slot = self._slots.pop(victim)
                evicted = victim
                self.evictions += 1
            self._slots[key] = slot
            return slot, evicted

    def pin(self, slots: Iterable[int]) -> None:
        """Keep `slots` from eviction and reuse until `unpin`."""
        with self.lock:
            for slot in slots:
                self._pins[slot] += 1

    def unpin(self, slots: Iterable[int]) -> None:
        """Undo one `pin` of each slot."""
        with self.lock:
            for slot in slots:
                require(self._pins[slot] > 0, f"slot {slot} is not pinned")
                self._pins[slot] -= 1
                if not self._pins[slot] and slot in self._orphans:
                    self._orphans.discard(slot)
                    self._free.append(slot)

    def available(self) -> int:
        """Slots an `insert` or `lend` may still take: free ones plus unpinned entries."""
        with self.lock:
            return len(self._free) + sum(1 for s in self._slots.values() if not self._pins[s])

    def lend(self, n: int) -> tuple[list[int], list[bytes]] | None:
        """Take `n` slots out of the index for a caller's own use (swapped-out pages), evicting the
        LRU; returns (slots, evicted keys), or None (and no change) when fewer than `n` are available.
        A lent slot is pinned and held by no key: nothing evicts or clears it until `give_back`."""
        with self.lock:
            if n > self.available():
                return None
            slots, evicted = [], []
            for i in range(n):
                key = b"\x00lent" + i.to_bytes(8, "little")  # never a content hash: those are 8, 16 or 32 bytes
                slot, victim = self.insert(key)  # type: ignore[misc]  # room was checked
                self._pins[slot] += 1
                self.remove(key)  # pinned, so the slot is orphaned: owned by the caller
                slots.append(slot)
                if victim is not None:
                    evicted.append(victim)
            return slots, evicted

    def give_back(self, slots: Iterable[int]) -> None:
        """Return slots from `lend` (they become free)."""
        self.unpin(slots)

    def remove(self, key: bytes) -> int | None:
        """Forget `key`; its slot is free (at once, or at its last unpin). Returns the slot."""
        with self.lock:
            slot = self._slots.pop(key, None)
            if slot is not None:
                self._release(slot)
            return slot

    def clear(self) -> list[bytes]:
        """Forget every entry; returns their keys."""
        with self.lock:
            keys = list(self._slots)
            for slot in self._slots.values():
                self._release(slot)
            self._slots.clear()
            return keys

    def _release(self, slot: int) -> None:
        if self._pins[slot]:
            self._orphans.add(slot)
        else:
            self._free.append(slot)

    def check_integrity(self) -> None:
        """Raise `IntegrityError` unless every slot is exactly one of: held by a key, free, orphaned."""
        with self.lock:
            held = list(self._slots.values())
            everything = held + self._free + list(self._orphans)
            require(sorted(everything) == list(range(self.capacity)),
                    f"tier slots are lost or doubled: {len(held)} held, {len(self._free)} free, "
                    f"{len(self._orphans)} orphaned of {self.capacity}")  # fmt: skip
            require(all(self._pins[s] for s in self._orphans), "an orphaned slot is not pinned")
