"""``python -m benchmarks.compare``: the side-by-side comparison of `benchmarks.compare.run`."""

import sys

from benchmarks.command import main

sys.exit(main("benchmarks.compare"))
