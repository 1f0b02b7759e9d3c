"""The port with every Python bytecode instruction it executes counted (`sys.settrace`
with opcode events, from the first SIGUSR1 on, in its main thread and every thread
started after; the port then runs about 30× slower).  On each SIGUSR1 it appends the
count so far to the file `$OPCODES_OUT` and, with `$OPCODES_BY_FUNCTION` set, writes the
counts per function beside it (`<file>.<n>.json`, n = that line's number).
`$BENCH_CHECKOUT`, when set, is imported ahead of this environment (as `checkout_port.py`
does), else this file's own checkout: never the editable install's, which may be another
tree (a worktree's bench counted main's port, whatever main held at the time).  Used by
`bench/opcodes.py`."""

import json
import os
import signal
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

checkout = Path(os.environ.get("BENCH_CHECKOUT") or Path(__file__).parents[2]).resolve()
sys.path.insert(0, str(checkout))

import backend  # noqa: E402

if not Path(backend.__file__).resolve().is_relative_to(checkout):
    raise SystemExit(f"backend came from {backend.__file__}, not from {checkout}")

OUT = Path(os.environ["OPCODES_OUT"])
BY_FUNCTION = bool(os.environ.get("OPCODES_BY_FUNCTION"))
counted = [0]
per_function: dict[str, int] = {}
dumps = [0]


def _local(frame: FrameType, event: str, arg: Any) -> Any:
    if event == "opcode":
        counted[0] += 1
        if BY_FUNCTION:
            code = frame.f_code
            # Not the whole path: a function keeps this key when its module moves to
            # another package.
            key = f"{code.co_qualname} ({Path(code.co_filename).name})"
            if code.co_filename == "<string>" and frame.f_back is not None:
                # A dataclass's generated __init__: named by who builds it.
                key += f" from {frame.f_back.f_code.co_qualname}"
            per_function[key] = per_function.get(key, 0) + 1
    return _local


def _global(frame: FrameType, event: str, arg: Any) -> Any:
    frame.f_trace_opcodes = True
    frame.f_trace_lines = False
    return _local


def _dump(signum: int, frame: Any) -> None:
    sys.settrace(None)  # the dump itself is not counted
    try:
        value = counted[0]
        dumps[0] += 1
        if BY_FUNCTION:
            Path(f"{OUT}.{dumps[0]}.json").write_text(json.dumps(per_function))
        with OUT.open("a") as f:
            f.write(f"{value}\n")
    finally:
        # Counting starts at the first signal: a traced start-up takes minutes on a busy
        # machine.  Threads already running then are not counted (the port serves from
        # its event loop, in this thread).
        threading.settrace(_global)
        sys.settrace(_global)


signal.signal(signal.SIGUSR1, _dump)

# The upstream's health is checked every second (about 24,000 instructions through
# httpx each time): once the port is up, it is checked no more, so what is counted is
# the requests' work, not the clock's.
from backend.llama import remote_engine  # noqa: E402

_remote_init = remote_engine.RemoteEngine.__init__


def _rarely_checked(self: Any, *args: Any, **kwargs: Any) -> None:
    _remote_init(self, *args, **kwargs)
    self.interval = 24 * 3600.0


remote_engine.RemoteEngine.__init__ = _rarely_checked  # type: ignore[method-assign]

try:  # the CLI's place since backend/ became rooms, then before
    from backend.app.cli import main
except ModuleNotFoundError:
    from backend.cli import main  # type: ignore[no-redef]

sys.exit(main(sys.argv[1:]))
