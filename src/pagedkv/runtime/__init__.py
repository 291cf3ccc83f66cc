"""The tensor side: page buffers and the per-step inputs built from bookkeeping tables."""
