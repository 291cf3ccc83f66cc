"""Run tier_worker.py in a fresh process and read its JSON report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

WORKER = Path(__file__).with_name("tier_worker.py")


def run_worker(spec: dict[str, Any], timeout: float = 120) -> dict[str, Any]:
    """One engine process: returns its report (fails the test with its stderr if it crashed)."""
    result = subprocess.run([sys.executable, str(WORKER), json.dumps(spec)], capture_output=True, text=True,
                            timeout=timeout)  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture
def worker() -> Any:
    return run_worker
