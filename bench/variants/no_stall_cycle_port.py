"""The port with the reference cycle between an exchange and its stall guard broken when
the exchange ends (`StallGuard.stop` drops its callback, a bound method of the exchange):
an ended request's objects are then freed by their reference counts, not left for the
garbage collector.  A measurement of what that cycle costs (`bench/burst_profile.py
--profiler perf --variant no-cycle=bench/variants/no_stall_cycle_port.py`), not a fix."""

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from backend.port import client_watch  # noqa: E402

_stop = client_watch.StallGuard.stop


def _stop_and_let_go(self: Any) -> None:
    _stop(self)
    self._on_stall = None  # the exchange's `_stalled`: the way back to the exchange


client_watch.StallGuard.stop = _stop_and_let_go  # type: ignore[method-assign]

from backend.app.cli import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
