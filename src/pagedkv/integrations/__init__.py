"""pagedkv.integrations: pagedkv's tiers behind other inference engines' KV cache APIs (vLLM, SGLang)."""
