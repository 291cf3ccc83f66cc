"""The `pagedkv bench` commands (`pagedkv bench --help` lists them) and what they share: `report` (tables,
JSON, plots) and `timing`. The research harness (comparisons with other systems, fault injection, the
soak...) lives in the repository's benchmarks/, run as `python -m benchmarks.<name>`."""
