"""The child process of `python -m benchmarks.faults`' disk-full case: ``python -m benchmarks.faults_child``.

The case lowers RLIMIT_FSIZE, which lasts for the whole process, so it runs apart from the bench. Reads the
case's spec (directory, workload, reference tokens, file size limit, torch threads) as JSON on stdin and
prints the case's raw figures (`faults_inject.run_case`) as the last line of JSON on stdout.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from benchmarks.faults_cases import Recorder, Workload, build_model
from benchmarks.faults_inject import run_case

__all__ = ["run_disk_full"]


def run_disk_full(spec: dict[str, Any]) -> dict[str, Any]:
    """The disk-full case under `spec` (see `faults.run_faults`), in this process."""
    import torch

    torch.set_num_threads(spec["threads"])
    workload = Workload(**{**spec["workload"], "question": tuple(spec["workload"]["question"])})
    rec = Recorder(build_model(workload.seed), workload, spec["reference"], "tiered", {"disk_offload_dir": spec["dir"]})
    return run_case("disk-full", rec, fsize_limit=spec["fsize_limit"])


if __name__ == "__main__":
    print(json.dumps(run_disk_full(json.loads(sys.stdin.read()))))
