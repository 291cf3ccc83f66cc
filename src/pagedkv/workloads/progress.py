"""`Progress`: the progress bar of a long run (a demo, a benchmark): tqdm's, on a terminal only, so a pipe
or a log gets no carriage returns."""

from __future__ import annotations

import sys
from types import TracebackType
from typing import Any

__all__ = ["Progress"]


class Progress:
    """A tqdm bar on stderr when it is a terminal, else nothing; call it as ``progress(done, total, note)``.

    It fits every bench's progress callback: ``(done, total)`` or ``(done, total, what just ran)``."""

    def __init__(self, unit: str = "it") -> None:
        self.unit = unit
        self.bar: Any = None

    def __call__(self, done: int, total: int, note: str = "") -> None:
        if not sys.stderr.isatty():
            return
        if self.bar is None:
            try:
                from tqdm import tqdm
            except ImportError:  # tqdm comes with pagedkv[bench]; without it, no bar
                return
            self.bar = tqdm(total=total, unit=self.unit, file=sys.stderr, dynamic_ncols=True, leave=True)
        self.bar.total = total
        self.bar.update(done - self.bar.n)
        if note:
            self.bar.set_postfix_str(note, refresh=False)
        self.bar.refresh()

    def close(self) -> None:
        """End the bar (its line stays)."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
