"""`DiskIndex`, the disk tier's index shared through `pages.journal`: what one index writes another reads, a
compaction moves everyone to the new file, and a hostile or broken journal never stops the tier."""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

from pagedkv.offload.disk_index import JOURNAL, RECORD, DiskIndex


def _index(directory: Path, capacity: int, errors: list[str] | None = None) -> DiskIndex:
    return DiskIndex(
        str(directory), capacity, 2.0, lambda kind, message: (errors if errors is not None else []).append(kind)
    )


def _key(i: int) -> bytes:
    return i.to_bytes(2, "big") + bytes(30)


def test_two_indexes_share_one_lru_and_one_cap(tmp_path: Path) -> None:
    a, b = _index(tmp_path, 4), _index(tmp_path, 4)
    for i in range(4):
        assert a.reserve(_key(i)) == [] and a.stored(_key(i)) == []
    b.used([_key(0)])  # b read page 0: the most recently used for both, once recorded
    b.flush()
    assert b.reserve(_key(9)) == [_key(1)]  # b sees a's pages: page 1 is the least recently used
    assert a.reserve(_key(10)) == [_key(2)]  # a sees b's reservation: it counts against the cap, not a victim
    assert a.stored(_key(10)) == [] and b.stored(_key(9)) == []
    a.flush()  # (each index is as of its last look at the journal)
    assert len(a) == len(b) == 4 and a.is_stored(_key(9)) and b.is_stored(_key(10))
    assert b.reserve(_key(3), present=lambda: True) is None  # stored, file there: nothing to write
    a.close()
    b.close()


def test_a_compaction_moves_every_index_to_the_new_journal(tmp_path: Path) -> None:
    a, b = _index(tmp_path, 8), _index(tmp_path, 8)
    for i in range(8):
        a.reserve(_key(i))
        a.stored(_key(i))
    before = os.stat(tmp_path / JOURNAL).st_ino
    for _ in range(700):  # far more records than pages: the journal is rewritten under a new name
        a.used([_key(i) for i in range(8)])
        a.flush()
    assert os.stat(tmp_path / JOURNAL).st_ino != before
    assert os.path.getsize(tmp_path / JOURNAL) < 16 + RECORD * 8 * 700
    assert b.reserve(_key(99)) == [_key(0)] and len(b) == 8  # b follows to the new file, and its order
    c = _index(tmp_path, 8)
    c.reconcile([(0.0, _key(i)) for i in range(1, 8)])  # a start: page 99 has no file (b is still writing it)
    assert len(c) == 7
    assert b.stored(_key(99)) == [] and len(b) == 8  # stored again once written
    for index in (a, b, c):
        index.close()


def test_a_hostile_or_torn_journal_is_skipped_and_a_fifo_is_not_used(tmp_path: Path) -> None:
    a = _index(tmp_path, 4)
    a.reserve(_key(1))
    a.stored(_key(1))
    with open(tmp_path / JOURNAL, "ab") as f:  # a record of an unknown kind, a key length of 200, a torn record
        f.write(b"?" + bytes([5]) + bytes(32) + b"=" + bytes([200]) + bytes(32) + b"=\x20" + bytes(7))
    b = _index(tmp_path, 4)
    assert b.reserve(_key(2)) == [] and b.stored(_key(2)) == [] and len(b) == 2
    assert a.reserve(_key(3)) == [] and len(a) == 3  # a reads b's records past the junk
    a.close()
    b.close()
    fifo = tmp_path / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / JOURNAL)
    errors: list[str] = []
    lone = _index(fifo, 2, errors)
    done = threading.Event()

    def use() -> None:
        for i in range(3):
            lone.reserve(_key(i))
            lone.stored(_key(i))
        done.set()

    threading.Thread(target=use, daemon=True).start()
    assert done.wait(30), "a FIFO at the journal's name blocked the index"
    assert errors == ["journal"] and len(lone) == 2  # logged once; the cap is kept by this process alone
    lone.close()


def test_a_removed_directory_is_made_again_with_a_new_journal(tmp_path: Path) -> None:
    errors: list[str] = []
    a = _index(tmp_path / "tier", 4, errors)
    a.reserve(_key(1))
    a.stored(_key(1))
    shutil.rmtree(tmp_path / "tier")  # everything, the journal included
    assert a.reserve(_key(2)) == [] and (tmp_path / "tier" / JOURNAL).is_file()
    b = _index(tmp_path / "tier", 4, errors)
    b.flush()
    assert len(b) == 2 and errors == []  # the new journal starts from what a knew; still shared
    a.close()
    b.close()
