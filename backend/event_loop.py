"""The asyncio event loop the backend runs on: uvloop's where it is installed, else
asyncio's own.

Why uvloop: with 63 streams flowing at one token per 20 ms, most of the port's CPU per
relayed chunk is the loop itself (epoll, callbacks, socket reads and writes in Python);
uvloop does that part in C.  `bench/relay.py` measured the port's CPU per paced chunk at
38 / 38 µs with uvloop against 47 / 56 µs with asyncio's loop in one run, 44 / 52 against
50 / 55 µs in another (bench/README.md, "The port's event loop").  Nothing else changes:
the backend uses only the asyncio API, which uvloop implements.

uvloop is optional: it does not exist on Windows, and `GGUF_STUDIO_EVENT_LOOP=asyncio`
chooses asyncio's loop anyway (to rule uvloop out when something misbehaves).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

__all__ = ["ENV", "loop_factory", "new_event_loop", "run"]

T = TypeVar("T")

#: "asyncio" forces asyncio's own loop; anything else (or unset): uvloop when installed.
ENV = "GGUF_STUDIO_EVENT_LOOP"


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop]:
    """What makes a new loop here: uvloop's when installed and not ruled out."""
    if os.environ.get(ENV, "").strip().lower() != "asyncio":
        try:
            import uvloop
        except ImportError:
            pass
        else:
            return uvloop.new_event_loop
    return asyncio.new_event_loop


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A new loop, not yet running (for a thread of its own)."""
    return loop_factory()()


def run(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(main)` on the chosen loop."""
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(main)
