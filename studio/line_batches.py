"""Lines for the window in batches: the engine's log, the port's access log and build
output reach the GUI thread at most ten times a second, however many lines a flood of
traffic writes (`Batcher`, fed by `AccessLogHandler` for the access log); `on_loop_of`
schedules a `Throttle` on the backend loop from any thread."""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Any, Callable

from backend.app.backend_thread import BackendThread
from backend.throttle import Throttle

__all__ = ["BATCH_INTERVAL", "AccessLogHandler", "Batcher", "LogLine", "on_loop_of"]

BATCH_INTERVAL = 0.1  # seconds: at most ten batches a second reach the GUI
LogLine = tuple[str, str]  # (source, text); source is "llama-server" or "access"


def on_loop_of(thread: BackendThread) -> Callable[[float, Callable[[], None]], None]:
    """A `Throttle` schedule that runs on `thread`'s loop, from any thread."""
    def schedule(delay: float, fn: Callable[[], None]) -> None:
        thread.call_soon(thread.loop.call_later, delay, fn)
    return schedule


class Batcher:
    """Collects items from any thread and hands them on in batches from the backend loop,
    at most one batch per interval (the `Throttle` the download queue's progress uses too)."""

    def __init__(self, thread: BackendThread, emit: Callable[[list[Any]], None], *,
                 interval: float = BATCH_INTERVAL, limit: int = 5000) -> None:
        self._emit = emit
        # A flood beyond the limit within one interval keeps its newest lines: the window
        # shows a tail anyway.
        self._items: deque[Any] = deque(maxlen=limit)
        self._lock = threading.Lock()
        self._throttle = Throttle(interval, self._flush, on_loop_of(thread))

    def push(self, item: Any) -> None:
        with self._lock:
            self._items.append(item)
        try:
            self._throttle.poke()
        except RuntimeError:  # the loop is closed
            pass

    def _flush(self) -> None:
        with self._lock:
            items = list(self._items)
            self._items.clear()
        if items:
            try:
                self._emit(items)
            except RuntimeError:
                pass


class AccessLogHandler(logging.Handler):
    def __init__(self, sink: Batcher) -> None:
        super().__init__(logging.INFO)
        self._sink = sink
        self.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._sink.push(("access", self.format(record)))
        except Exception:
            self.handleError(record)
