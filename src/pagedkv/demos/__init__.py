"""The `pagedkv demo` runs: an engine checked against transformers (`engine`), the bookkeeping alone with
real pages (`manager`, ``--manager-only``), and prefixes reused across processes through a tier (`tiers`,
``--connector``)."""
