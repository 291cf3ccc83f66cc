"""pagedkv's research harness: benchmarks that compare pagedkv with other systems or stress it, run from the
repository root as ``python -m benchmarks.<name>`` (not installed with the package; `pagedkv bench` runs
the benchmarks that ship with it). Every one takes ``--json PATH`` and, where it prints tables,
``--plots DIR``; `benchmarks.command.BENCHMARKS` lists them.
"""
