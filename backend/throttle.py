"""Throttle: news that changes often reaches its readers a few times a second, the last of it always."""

from __future__ import annotations

import threading
import time
from typing import Callable

Schedule = Callable[[float, Callable[[], None]], None]  # run the callable after that many seconds


class Throttle:
    """Runs `flush` soon after each `poke`, but at most once per `interval`.

    The first poke after a quiet spell runs it at once; pokes within the interval are
    gathered into one run at its end, so whatever the last poke announced is always
    flushed.  `poke` may be called from any thread; `flush` runs where `schedule` runs
    it (by default inline or on a timer thread), and reads the newest state itself.
    """

    def __init__(self, interval: float, flush: Callable[[], None], schedule: Schedule | None = None) -> None:
        self.interval = interval
        self._flush = flush
        self._schedule = schedule or after_on_a_timer
        self._lock = threading.Lock()
        self._pending = False
        self._last = float("-inf")

    def poke(self) -> None:
        with self._lock:
            if self._pending:
                return
            self._pending = True
            delay = max(0.0, self._last + self.interval - time.monotonic())
        try:
            self._schedule(delay, self._run)
        except BaseException:
            with self._lock:
                self._pending = False
            raise

    def _run(self) -> None:
        with self._lock:
            # Cleared before flushing: a poke during the flush schedules the next run.
            self._pending = False
            self._last = time.monotonic()
        self._flush()


def after_on_a_timer(delay: float, fn: Callable[[], None]) -> None:
    """Run `fn` now on this thread, or after `delay` seconds on a timer thread."""
    if delay <= 0:
        fn()
        return
    timer = threading.Timer(delay, fn)
    timer.daemon = True
    timer.start()
