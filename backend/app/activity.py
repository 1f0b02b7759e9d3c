"""What the shared model is doing, sampled a few times a second, and the last minutes of it.

`ActivitySampler` runs on the service's loop: it reads the admission registry and the
metrics counters there (never from another thread) and asks the engine's own
`/metrics` for the tokens it generated.  Each `ActivitySample` is a frozen value that
may cross to any thread; `ActivityHistory` is the ring buffer a chart draws from.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Protocol

from backend.llama.api import EngineClient

__all__ = [
    "ActivityHistory",
    "ActivitySample",
    "ActivitySampler",
    "parse_prometheus_value",
]

log = logging.getLogger("gguf_studio.activity")

# Rates are averaged over this window so a chart of them does not flicker.
RATE_WINDOW = 2.0


@dataclass(frozen=True)
class ActivitySample:
    time: float  # monotonic seconds
    slots_total: int = 0
    active: int = 0
    waiting: int = 0
    requests: int = 0  # answered by the port since start
    rejections: dict[str, int] = field(default_factory=dict)
    cancellations: dict[str, int] = field(default_factory=dict)
    tokens_generated: int | None = None  # since start; None when the engine does not say
    requests_per_s: float = 0.0
    tokens_per_s: float = 0.0
    # Highest counts since the previous sample: requests shorter than the sampling
    # interval still show in a chart.
    active_peak: int = 0
    waiting_peak: int = 0
    kv_reserved: int = 0  # KV tokens held by running requests (prompt + output budget)
    kv_capacity: int = 0  # the current load's KV cache in tokens; 0 when unknown

    @property
    def kv_text(self) -> str:
        """"6,500 / 16,384" for the window; a dash pair while the cache is unknown."""
        if not self.kv_capacity:
            return "— / —"
        return f"{self.kv_reserved:,} / {self.kv_capacity:,}"

    @property
    def rejections_total(self) -> int:
        return sum(self.rejections.values())

    @property
    def in_flight(self) -> int:
        return self.active + self.waiting


class ActivityHistory:
    """The last `seconds` of samples, oldest first; appending is O(1)."""

    def __init__(self, seconds: float = 300.0, interval: float = 0.5) -> None:
        self.seconds = seconds
        self._samples: deque[ActivitySample] = deque(maxlen=int(seconds / interval) + 1)

    def add(self, sample: ActivitySample) -> None:
        self._samples.append(sample)

    def extend(self, samples: Iterable[ActivitySample]) -> None:
        self._samples.extend(samples)

    def clear(self) -> None:
        self._samples.clear()

    @property
    def latest(self) -> ActivitySample | None:
        return self._samples[-1] if self._samples else None

    def samples(self) -> list[ActivitySample]:
        return list(self._samples)

    def series(self, name: str) -> list[tuple[float, float]]:
        """(time, value) of one numeric field, e.g. "waiting" or "tokens_per_s"."""
        return [(s.time, float(getattr(s, name) or 0)) for s in self._samples]

    def peak(self, name: str) -> float:
        return max((float(getattr(s, name) or 0) for s in self._samples), default=0.0)

    def __len__(self) -> int:
        return len(self._samples)


class _Service(Protocol):
    registry: Any
    metrics: Any

    def snapshot(self) -> Any: ...


class ActivitySampler:
    """Samples a `StudioService` every `interval` seconds and hands each sample on."""

    def __init__(self, service: _Service, on_sample: Callable[[ActivitySample], None], *,
                 interval: float = 0.5, token_interval: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.service = service
        self.on_sample = on_sample
        self.interval = interval
        self.token_interval = token_interval
        self._clock = clock
        self._tokens = _EngineTokens()
        self._recent: deque[tuple[float, int, int | None]] = deque()
        self._peaks = [0, 0]
        self._task: asyncio.Task[None] | None = None
        service.registry.add_listener(self._track_peaks)

    def sample(self) -> ActivitySample:
        """One sample, with rates over the last RATE_WINDOW seconds.  Call on the loop."""
        now = self._clock()
        registry = self.service.registry
        current = registry.current
        totals = self.service.metrics.totals()
        tokens = self._tokens.total
        self._recent.append((now, totals["requests"], tokens))
        while len(self._recent) > 2 and now - self._recent[1][0] >= RATE_WINDOW:
            self._recent.popleft()
        then, requests_then, tokens_then = self._recent[0]
        elapsed = now - then
        requests_rate = tokens_rate = 0.0
        if elapsed > 0:
            requests_rate = max(0, totals["requests"] - requests_then) / elapsed
            if tokens is not None:
                # Before the first scrape nothing was counted, and an engine's counter
                # starts at zero: tokens seen first were all made inside this window.
                tokens_rate = max(0, tokens - (tokens_then or 0)) / elapsed
        slots = current.capacity if current is not None and not current.retired else 0
        active, waiting = registry.total_active, registry.total_waiting
        peaks, self._peaks = self._peaks, [active, waiting]
        return ActivitySample(
            time=now, slots_total=slots, active=active, waiting=waiting,
            requests=totals["requests"],
            rejections=dict(totals["rejections"]), cancellations=dict(totals["cancellations"]),
            tokens_generated=tokens, requests_per_s=requests_rate, tokens_per_s=tokens_rate,
            active_peak=max(peaks[0], active), waiting_peak=max(peaks[1], waiting),
            kv_reserved=registry.total_reserved_tokens, kv_capacity=registry.kv_capacity)

    def start(self) -> asyncio.Task[None]:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self.run(), name="activity sampler")
        return self._task

    async def stop(self) -> None:
        self.service.registry.remove_listener(self._track_peaks)
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def run(self) -> None:
        scraper = asyncio.create_task(self._scrape_tokens(), name="engine token counter")
        try:
            while True:
                try:
                    self.on_sample(self.sample())
                except Exception:
                    log.exception("activity sample failed")
                await asyncio.sleep(self.interval)
        finally:
            scraper.cancel()
            await asyncio.gather(scraper, return_exceptions=True)

    def _track_peaks(self) -> None:
        registry = self.service.registry
        peaks = self._peaks
        peaks[0] = max(peaks[0], registry.total_active)
        peaks[1] = max(peaks[1], registry.total_waiting)

    async def _scrape_tokens(self) -> None:
        # Its own task: an engine busy with a long batch may answer /metrics late, and
        # that must not hold up the samples of the queue.
        engine: EngineClient | None = None
        try:
            while True:
                serving = self.service.snapshot().serving
                base_url = serving.base_url if serving is not None else None
                if serving is not None and (engine is None or engine.base_url != serving.base_url
                                            or engine.api_key != serving.api_key):
                    if engine is not None:
                        await engine.aclose()
                    engine = EngineClient(serving.base_url, api_key=serving.api_key, timeout=5.0)
                if base_url and engine is not None:
                    text = await engine.metrics_text()
                    value = parse_prometheus_value(text, "llamacpp:tokens_predicted_total") \
                        if text is not None else None
                    if value is not None:
                        self._tokens.update(base_url, int(value))
                await asyncio.sleep(self.token_interval)
        finally:
            if engine is not None:
                await engine.aclose()


class _EngineTokens:
    """Tokens generated across engine processes: each new process counts from zero."""

    def __init__(self) -> None:
        self._earlier = 0
        self._url: str | None = None
        self._value = 0
        self._seen = False

    @property
    def total(self) -> int | None:
        return self._earlier + self._value if self._seen else None

    def update(self, base_url: str, value: int) -> None:
        if base_url != self._url or value < self._value:
            self._earlier += self._value
            self._value = 0
            self._url = base_url
        self._value = value
        self._seen = True


def parse_prometheus_value(text: str, name: str) -> float | None:
    """The value of an unlabelled sample `name` in Prometheus text exposition."""
    for line in text.splitlines():
        if line.startswith(name) and (len(line) == len(name) or line[len(name)] in " \t"):
            try:
                return float(line.split()[1])
            except (IndexError, ValueError):
                return None
    return None
