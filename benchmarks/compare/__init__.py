"""`python -m benchmarks.compare`: pagedkv, vLLM and SGLang cache managers and the offline bounds on shared traces."""
