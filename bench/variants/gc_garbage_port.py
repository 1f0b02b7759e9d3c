"""The port with every object the garbage collector finds unreachable kept
(`gc.DEBUG_SAVEALL`) and counted by type: what only the collector frees, i.e. what sits
in reference cycles (`bench/burst_profile.py --profiler perf --variant
garbage=bench/variants/gc_garbage_port.py`, with `GC_GARBAGE_OUT=FILE`).  Every second a
thread collects and writes the counts so far to FILE as JSON ({type name: objects});
divide by the requests the port served.  A measurement, not a fix: nothing is freed."""

import collections
import gc
import json
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

OUT = Path(os.environ.get("GC_GARBAGE_OUT", "gc-garbage.json"))

gc.set_debug(gc.DEBUG_SAVEALL)


def _qualified(obj: object) -> str:
    kind = type(obj)
    return f"{kind.__module__}.{kind.__qualname__}"


def _write_counts() -> None:
    counted = 0
    counts: collections.Counter[str] = collections.Counter()
    while True:
        time.sleep(1.0)
        gc.collect()
        garbage = gc.garbage
        counts.update(_qualified(obj) for obj in garbage[counted:])
        counted = len(garbage)
        OUT.write_text(json.dumps(dict(counts.most_common())))


threading.Thread(target=_write_counts, daemon=True).start()

from backend.app.cli import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
