"""A second SGLang process for test_sglang_storage.py: reads the parent's pages, writes its own.

    python sglang_storage_worker.py '{"extra": {...}, "layout": "page_first", "read": [keys], "write": [keys]}'

Builds its own host pool (seed 7) and `PagedKVStorage` through SGLang's factory, then prints one JSON
line: `batch_exists` of the read keys, `batch_get_v1` of them into host pages 0.., the bytes of those
pages (hex), and `batch_set_v1` of the write keys from host pages 20.. with those pages' bytes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sglang_storage_support import backend, host_pool, page_bytes, slots  # noqa: E402


def main() -> None:
    spec = json.loads(sys.argv[1])
    pool = host_pool(spec["layout"], seed=7)
    store = backend(pool, spec["extra"])
    read, write = spec["read"], spec["write"]
    report = {
        "exists": store.batch_exists(read),
        "got": store.batch_get_v1(read, slots(list(range(len(read))))),
        "read_pages": [page_bytes(pool, p).hex() for p in range(len(read))],
        "set": store.batch_set_v1(write, slots(list(range(20, 20 + len(write))))),
        "written_pages": [page_bytes(pool, p).hex() for p in range(20, 20 + len(write))],
    }
    store.close()
    print(json.dumps(report))


if __name__ == "__main__":
    main()
