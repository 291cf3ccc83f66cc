"""Benchmarks: seeded workloads, a replay driver, and the `pagedkv bench` commands."""
