"""The bookkeeping tests run without torch: `make test` runs this directory first with
``PAGEDKV_WITHOUT_TORCH=1``, which makes every ``import torch`` fail, so a test (or the code under
test) that needs torch fails there instead of passing by accident."""

import os
import sys

if os.environ.get("PAGEDKV_WITHOUT_TORCH") == "1":
    if "torch" in sys.modules:
        raise RuntimeError("PAGEDKV_WITHOUT_TORCH=1 but torch was imported before the core tests were collected")
    sys.modules["torch"] = None  # type: ignore[assignment]  # `import torch` now raises ImportError
