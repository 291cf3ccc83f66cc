"""Bookkeeping: pure Python plus numpy. Nothing in this package imports torch."""
