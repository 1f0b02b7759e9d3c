"""What the port's counts cost per request, side by side in one run.

An admitted request is counted twice on the loop (its queue wait, then its answer); a
refusal twice too (its reason, then its answer).  Three ways, timed with timeit:

- before: main before the counts carried model and engine: `.labels(route=, status=)`
  on a two-label counter, an unlabelled histogram, and the plain totals under a lock
  (rebuilt here as it was);
- naive: the same four-label series as now, looked up with `.labels()` at every count
  (plus the same plain totals);
- now: `Metrics.of(model, engine)` and the `ModelCounts` children it keeps.

    .venv/bin/python bench/metrics_counts.py
"""

from __future__ import annotations

import sys
import threading
import timeit
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from prometheus_client import CollectorRegistry, Counter, Histogram  # noqa: E402

from backend.port.metrics import QUEUE_WAIT_BUCKETS, Metrics  # noqa: E402

ROUTE = "/v1/chat/completions"
MODEL, ENGINE = "coder", "this machine"


class _Totals:
    """The plain counts `Metrics.totals()` reads, kept under a lock as main did."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests = self.waits = 0
        self.wait_sum = 0.0
        self.rejections: dict[str, int] = {}

    def request(self) -> None:
        with self.lock:
            self.requests += 1

    def wait(self, seconds: float) -> None:
        with self.lock:
            self.waits += 1
            self.wait_sum += seconds

    def rejection(self, reason: str) -> None:
        with self.lock:
            self.rejections[reason] = self.rejections.get(reason, 0) + 1


def before() -> tuple[Callable[[], None], Callable[[], None]]:
    registry = CollectorRegistry()
    requests = Counter("r", "", ["route", "status"], registry=registry)
    rejections = Counter("j", "", ["reason"], registry=registry)
    wait = Histogram("w", "", buckets=QUEUE_WAIT_BUCKETS, registry=registry)
    totals = _Totals()

    def admitted() -> None:
        wait.observe(0.01)
        totals.wait(0.01)
        requests.labels(route=ROUTE, status=str(200)).inc()
        totals.request()

    def refused() -> None:
        rejections.labels(reason="model_not_found").inc()
        totals.rejection("model_not_found")
        requests.labels(route=ROUTE, status=str(404)).inc()
        totals.request()
    return admitted, refused


def naive() -> tuple[Callable[[], None], Callable[[], None]]:
    metrics = Metrics()
    totals = _Totals()

    def admitted() -> None:
        metrics.queue_wait.labels(MODEL, ENGINE).observe(0.01)
        totals.wait(0.01)
        metrics.requests.labels(ROUTE, str(200), MODEL, ENGINE).inc()
        totals.request()

    def refused() -> None:
        metrics.rejections.labels("model_not_found", "", "").inc()
        totals.rejection("model_not_found")
        metrics.requests.labels(ROUTE, str(404), "", "").inc()
        totals.request()
    return admitted, refused


def now() -> tuple[Callable[[], None], Callable[[], None]]:
    metrics = Metrics()

    def admitted() -> None:  # the exchange asks for its counts at each count
        metrics.of(MODEL, ENGINE).observe_queue_wait(0.01)
        metrics.of(MODEL, ENGINE).count_request(ROUTE, 200)

    def refused() -> None:
        counts = metrics.of("", "")
        counts.count_rejection("model_not_found")
        counts.count_request(ROUTE, 404)
    return admitted, refused


def microseconds(call: Callable[[], None], number: int = 100_000) -> float:
    return min(timeit.repeat(call, number=number, repeat=7)) / number * 1e6


def main() -> None:
    rows = {name: [microseconds(f) for f in make()]
            for name, make in (("before", before), ("naive", naive), ("now", now))}
    base = rows["before"]
    print(f"{'counts':8} {'admitted µs':>12} {'ratio':>6} {'refused µs':>11} {'ratio':>6}")
    for name, (admitted, refused) in rows.items():
        print(f"{name:8} {admitted:12.2f} {admitted / base[0]:6.2f} "
              f"{refused:11.2f} {refused / base[1]:6.2f}")


if __name__ == "__main__":
    main()
