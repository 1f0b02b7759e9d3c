"""What the port is doing, in total and per engine, sampled a few times a second, and the
last minutes of it.

`ActivitySampler` runs on the service's loop: it reads the admission registry, each
model's line and engines, and the metrics counters there (never from another thread),
and asks every serving engine's own `/metrics` for the tokens it generated.  Each
`ActivitySample` (with an `EngineActivity` per engine) is a frozen value that may cross
to any thread; `ActivityHistory` is the ring buffer a chart draws from.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Protocol

from backend.llama.api import EngineClient
from backend.llama.load import Serving
from backend.port.metrics import ModelLoad

__all__ = [
    "ActivityHistory",
    "EngineActivity",
    "ActivitySample",
    "ActivitySampler",
    "parse_prometheus_value",
]

log = logging.getLogger("gguf_studio.activity")

# Rates are averaged over this window so a chart of them does not flicker.
RATE_WINDOW = 2.0


@dataclass(frozen=True)
class EngineActivity:
    """One engine of one model in a sample."""

    model: str
    engine: str  #: "this machine" or "upstream N"
    slots: int = 0  #: 0 while it does not serve
    active: int = 0
    waiting: int = 0  #: the model's line: its waiters go to whichever engine frees first
    kv_reserved: int = 0
    kv_capacity: int = 0
    tokens_generated: int | None = None  #: since start; None when the engine does not say
    tokens_per_s: float = 0.0

    @property
    def kv_text(self) -> str:
        return _kv_text(self.kv_reserved, self.kv_capacity)


@dataclass(frozen=True)
class ActivitySample:
    time: float  # monotonic seconds
    slots_total: int = 0
    active: int = 0
    waiting: int = 0
    #: Requests to the models since start, whatever their end: the inspector's count,
    #: which the Requests tab lists and the Pool tab counts per model.
    requests: int = 0
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
    kv_capacity: int = 0  # every serving engine's KV cache in tokens; 0 when unknown
    engines: tuple[EngineActivity, ...] = ()  # per engine, models in the pool's order

    @property
    def kv_text(self) -> str:
        """"6,500 / 16,384" for the window; a dash pair while the cache is unknown."""
        return _kv_text(self.kv_reserved, self.kv_capacity)

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
    requests: Any  #: the request inspector's ring (RequestLog)

    def model_loads(self) -> list[ModelLoad]: ...

    def serving_engines(self) -> list[tuple[str, str, Serving]]: ...


EngineKey = tuple[str, str]  # (model, where)


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
        self._tokens: dict[EngineKey, _EngineTokens] = {}
        self._requests_rate = _Rate()
        self._tokens_rate = _Rate()
        self._engine_rates: dict[EngineKey, _Rate] = {}
        self._peaks = [0, 0]
        self._task: asyncio.Task[None] | None = None
        service.registry.add_listener(self._track_peaks)

    def count_tokens(self, engine: EngineKey, base_url: str, value: int) -> None:
        """What `engine`'s own counter says now (a new process counts from zero)."""
        self._tokens.setdefault(engine, _EngineTokens()).update(base_url, value)

    def sample(self) -> ActivitySample:
        """One sample, with rates over the last RATE_WINDOW seconds.  Call on the loop."""
        now = self._clock()
        registry = self.service.registry
        totals = self.service.metrics.totals()
        requests = self.service.requests.since_start
        seen = [counter.total for counter in self._tokens.values() if counter.total is not None]
        tokens = sum(seen) if seen else None
        slots = sum(queue.capacity for queue in registry.queues if not queue.retired)
        active, waiting = registry.total_active, registry.total_waiting
        peaks, self._peaks = self._peaks, [active, waiting]
        return ActivitySample(
            time=now, slots_total=slots, active=active, waiting=waiting,
            requests=requests,
            rejections=dict(totals["rejections"]), cancellations=dict(totals["cancellations"]),
            tokens_generated=tokens,
            requests_per_s=self._requests_rate.update(now, requests),
            # Before the first scrape nothing was counted, and an engine's counter starts
            # at zero: tokens seen first were all made inside this window.
            tokens_per_s=self._tokens_rate.update(now, tokens),
            active_peak=max(peaks[0], active), waiting_peak=max(peaks[1], waiting),
            kv_reserved=registry.total_reserved_tokens, kv_capacity=registry.kv_capacity,
            engines=self._engines(now))

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

    def _engines(self, now: float) -> tuple[EngineActivity, ...]:
        found = []
        for load in self.service.model_loads():
            for engine in load.engines:
                key = (load.model, engine.engine)
                counter = self._tokens.get(key)
                tokens = counter.total if counter is not None else None
                rate = self._engine_rates.setdefault(key, _Rate()).update(now, tokens)
                found.append(EngineActivity(
                    load.model, engine.engine, slots=engine.slots, active=engine.active,
                    waiting=load.waiting, kv_reserved=engine.kv_reserved,
                    kv_capacity=engine.kv_capacity, tokens_generated=tokens, tokens_per_s=rate))
        shown = {(e.model, e.engine) for e in found}
        for key in [k for k in self._engine_rates if k not in shown]:
            del self._engine_rates[key]
        return tuple(found)

    def _track_peaks(self) -> None:
        registry = self.service.registry
        peaks = self._peaks
        peaks[0] = max(peaks[0], registry.total_active)
        peaks[1] = max(peaks[1], registry.total_waiting)

    async def _scrape_tokens(self) -> None:
        # Its own task: an engine busy with a long batch may answer /metrics late, and
        # that must not hold up the samples of the queue.  Engines are asked together.
        clients: dict[EngineKey, EngineClient] = {}
        try:
            while True:
                # A model of another GGUF Studio port (`upstream_model`) is not a
                # llama-server: that port's /metrics counts no tokens, and one read per
                # model of it each second would be the only load it saw from here.
                engines = {(model, where): serving
                           for model, where, serving in self.service.serving_engines()
                           if serving.upstream_model is None}
                for key in [k for k, c in clients.items() if k not in engines
                            or (c.base_url, c.api_key) != (engines[k].base_url,
                                                          engines[k].api_key)]:
                    await clients.pop(key).aclose()
                for key, serving in engines.items():
                    if key not in clients:
                        clients[key] = EngineClient(serving.base_url, api_key=serving.api_key,
                                                    timeout=5.0)
                keys = list(engines)
                texts = await asyncio.gather(*(clients[k].metrics_text() for k in keys))
                for key, text in zip(keys, texts):
                    value = parse_prometheus_value(text, "llamacpp:tokens_predicted_total") \
                        if text is not None else None
                    if value is not None:
                        self.count_tokens(key, engines[key].base_url, int(value))
                await asyncio.sleep(self.token_interval)
        finally:
            for client in clients.values():
                await client.aclose()


class _Rate:
    """How fast a counter grew over the last RATE_WINDOW seconds."""

    def __init__(self) -> None:
        self._points: deque[tuple[float, int | None]] = deque()

    def update(self, now: float, value: int | None) -> float:
        points = self._points
        points.append((now, value))
        while len(points) > 2 and now - points[1][0] >= RATE_WINDOW:
            points.popleft()
        then, before = points[0]
        if now <= then or value is None:
            return 0.0
        return max(0, value - (before or 0)) / (now - then)


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


def _kv_text(reserved: int, capacity: int) -> str:
    if not capacity:
        return "— / —"
    return f"{reserved:,} / {capacity:,}"


def parse_prometheus_value(text: str, name: str) -> float | None:
    """The value of an unlabelled sample `name` in Prometheus text exposition."""
    for line in text.splitlines():
        if line.startswith(name) and (len(line) == len(name) or line[len(name)] in " \t"):
            try:
                return float(line.split()[1])
            except (IndexError, ValueError):
                return None
    return None
