"""The throttle shared by the download queue's progress and the window's log batches."""

from __future__ import annotations

import threading
from typing import Callable

from backend.throttle import Throttle


class Clockwork:
    """Holds what the throttle schedules, so a test runs it when it chooses (no timing)."""

    def __init__(self) -> None:
        self.scheduled: list[tuple[float, Callable[[], object]]] = []

    def __call__(self, delay, fn) -> None:
        self.scheduled.append((delay, fn))

    def run_next(self) -> None:
        _delay, fn = self.scheduled.pop(0)
        fn()


def test_the_first_news_goes_out_at_once_and_a_burst_becomes_one_run_at_the_intervals_end():
    runs: list[int] = []
    news = [0]
    clock = Clockwork()
    throttle = Throttle(60.0, lambda: runs.append(news[0]), clock)
    throttle.poke()
    assert [d for d, _ in clock.scheduled] == [0.0]  # at once
    clock.run_next()
    for n in range(1, 100):  # a burst within the interval
        news[0] = n
        throttle.poke()
    [(delay, _)] = clock.scheduled  # one run, not 99
    assert 59.0 < delay <= 60.0
    clock.run_next()
    assert runs == [0, 99]  # and it carried the last news


def test_news_during_a_flush_is_not_lost():
    clock = Clockwork()
    flushed: list[str] = []
    throttle: Throttle

    def flush() -> None:
        flushed.append("run")
        if len(flushed) == 1:
            throttle.poke()  # more news arrives while the first is being delivered

    throttle = Throttle(0.0, flush, clock)
    throttle.poke()
    clock.run_next()
    assert len(clock.scheduled) == 1
    clock.run_next()
    assert flushed == ["run", "run"]


def test_the_default_schedule_delivers_the_last_news_on_a_timer():
    delivered = threading.Event()
    throttle = Throttle(0.05, delivered.set)
    throttle.poke()
    assert delivered.is_set()  # the first one inline
    delivered.clear()
    throttle.poke()  # within the interval: on a timer thread
    assert delivered.wait(5)
