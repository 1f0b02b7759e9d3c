"""The port under cProfile between two signals: SIGUSR1 starts profiling its main thread
(the event loop's, where every request is served), SIGUSR2 stops it and writes the
stats (`pstats`) to the file `$PROFILE_OUT`.  `$BENCH_CHECKOUT`, when set, is imported
ahead of this environment (as `checkout_port.py` does), else this file's own checkout.
Used by `bench/burst_profile.py`.

cProfile times with the wall clock, its own cost (about a µs per call and return)
included: read its figures as shares and differences between ports profiled alike, not
as the unprofiled port's time."""

import cProfile
import os
import signal
import sys
from pathlib import Path
from typing import Any

checkout = Path(os.environ.get("BENCH_CHECKOUT") or Path(__file__).parents[2]).resolve()
sys.path.insert(0, str(checkout))

import backend  # noqa: E402

if not Path(backend.__file__).resolve().is_relative_to(checkout):
    raise SystemExit(f"backend came from {backend.__file__}, not from {checkout}")

OUT = os.environ["PROFILE_OUT"]
profiler = cProfile.Profile()


def _start(signum: int, frame: Any) -> None:
    profiler.enable()


def _stop(signum: int, frame: Any) -> None:
    profiler.disable()
    profiler.dump_stats(OUT + ".part")
    os.replace(OUT + ".part", OUT)  # whole, or not there yet
    profiler.clear()


signal.signal(signal.SIGUSR1, _start)
signal.signal(signal.SIGUSR2, _stop)

try:  # the CLI's place since backend/ became rooms, then before
    from backend.app.cli import main
except ModuleNotFoundError:
    from backend.cli import main  # type: ignore[no-redef]

sys.exit(main(sys.argv[1:]))
