"""The port with its garbage collections timed (`gc.callbacks`): per generation, how many
ran, the CPU they took (`time.thread_time_ns` of the collecting thread) and what they
freed (`bench/burst_profile.py --profiler perf --variant gc=bench/variants/gc_time_port.py`,
with `GC_TIME_OUT=FILE`).  Every second a thread writes the totals so far to FILE as
JSON ({generation: [collections, CPU ns, objects collected]}); divide by the requests
the port served.  CPU time, not the wall clock: the machine's load moves it less than
perf's share of a busy core."""

import gc
import json
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

OUT = Path(os.environ.get("GC_TIME_OUT", "gc-time.json"))
_totals = {generation: [0, 0, 0] for generation in range(3)}
_started = [0]


def _timed(phase: str, info: dict[str, int]) -> None:
    if phase == "start":
        _started[0] = time.thread_time_ns()
        return
    total = _totals[info["generation"]]
    total[0] += 1
    total[1] += time.thread_time_ns() - _started[0]
    total[2] += info["collected"]


def _write_totals() -> None:
    while True:
        time.sleep(1.0)
        OUT.write_text(json.dumps(_totals))


gc.callbacks.append(_timed)
threading.Thread(target=_write_totals, daemon=True).start()

from backend.app.cli import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
