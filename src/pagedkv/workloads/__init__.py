"""Workloads the demos and the benchmarks share: seeded request traces (`traces`), their replay through
`PagedKVCacheManager` as a continuous-batching scheduler would (`replay`), and a progress bar (`progress`)."""
