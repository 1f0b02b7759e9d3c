"""A transfer's bytes done, its speed over the last few seconds and the time left at that
speed, and a duration as people read it: the window's downloads and `gguf-studio pull`
show them."""

from __future__ import annotations

import time
from collections import deque

__all__ = ["TransferMeter", "describe_duration"]


class TransferMeter:
    """Bytes done, speed over the last few seconds, and time left at that speed."""

    def __init__(self, done: int, total: int, window: float = 3.0) -> None:
        self.done = done
        self.total = total
        self._window = window
        self._samples: deque[tuple[float, int]] = deque([(time.monotonic(), done)])

    def add(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        self._samples.append((now, self.done))
        while len(self._samples) > 2 and now - self._samples[0][0] > self._window:
            self._samples.popleft()

    @property
    def speed(self) -> float:
        (t0, b0), (t1, b1) = self._samples[0], self._samples[-1]
        return (b1 - b0) / (t1 - t0) if t1 > t0 else 0.0

    @property
    def eta(self) -> float | None:
        speed = self.speed
        return max(self.total - self.done, 0) / speed if speed > 0 else None


def describe_duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60} min"
