"""What a benchmark's child processes need: `ROOT`, the checkout holding `benchmarks`, and `child_env`, an
environment in which a child imports the same pagedkv and the same benchmarks as the parent."""

from __future__ import annotations

import os
from pathlib import Path

import pagedkv

__all__ = ["ROOT", "child_env"]

ROOT = Path(__file__).resolve().parents[1]  # the repository root: it holds benchmarks/ (and .venv-max)


def child_env() -> dict[str, str]:
    """``os.environ`` with PYTHONPATH led by the directory of the pagedkv this process imported (a checkout's
    src/, measured even where the child's interpreter has another pagedkv installed) and `ROOT`."""
    src = str(Path(pagedkv.__file__).resolve().parents[1])
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [src, str(ROOT), os.environ.get("PYTHONPATH")])))
