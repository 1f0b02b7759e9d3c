"""The port with the garbage collector's thresholds set (`$GC_THRESHOLD`, e.g.
"50000,20,10"; CPython's default is 700,10,10): how much of a request's CPU its
collections take (`bench/burst_profile.py --profiler perf --variant
gc=bench/variants/gc_threshold_port.py`).  A measurement, not a fix: fewer collections
hold more garbage between them."""

import gc
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

gc.set_threshold(*(int(x) for x in os.environ.get("GC_THRESHOLD", "50000,20,10").split(",")))

from backend.app.cli import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
