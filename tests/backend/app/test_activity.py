"""Activity sampling: counts read from the service, rates over a window, a bounded history."""

from __future__ import annotations

import asyncio
from typing import Any, Callable

import httpx
import pytest

from backend.app.activity import (
    ActivityHistory,
    ActivitySample,
    ActivitySampler,
    parse_prometheus_value,
)
from backend.admission.admission_registry import AdmissionRegistry
from backend.port.metrics import Metrics, ModelLoad
from backend.port.request_log import RequestLog
from backend.llama.load import Serving, Snapshot, State


class FakeService:
    def __init__(self) -> None:
        self.registry = AdmissionRegistry()
        self.metrics = Metrics()
        self.requests = RequestLog()
        self._snapshot = Snapshot()

    def snapshot(self) -> Snapshot:
        return self._snapshot

    def model_loads(self) -> list[ModelLoad]:
        return []

    def serving_engines(self) -> list[tuple[str, str, Serving]]:
        serving = self._snapshot.serving
        return [("m", "this machine", serving)] if serving is not None else []


ENGINE = ("m", "this machine")


def answered_by(handler: Callable[[httpx.Request], httpx.Response]) -> type[httpx.AsyncClient]:
    """httpx's client with every request answered by `handler` (no engine to scrape)."""
    class Client(httpx.AsyncClient):
        def __init__(self, **kwargs: Any) -> None:
            super().__init__(transport=httpx.MockTransport(handler), **kwargs)
    return Client


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_sample_reads_queue_counts_and_totals() -> None:
    service = FakeService()
    queue = service.registry.activate(Serving("http://127.0.0.1:1", 2))
    tickets = [queue.request() for _ in range(3)]
    service.metrics.count_rejection("server_is_overloaded")
    service.metrics.count_rejection("server_is_overloaded")
    service.metrics.count_rejection("queue_timeout")
    service.metrics.count_cancellation("queued")
    sampler = ActivitySampler(service, lambda s: None, clock=Clock())

    sample = sampler.sample()

    assert (sample.slots_total, sample.active, sample.waiting) == (2, 2, 1)
    assert sample.rejections == {"server_is_overloaded": 2, "queue_timeout": 1}
    assert sample.rejections_total == 3
    assert sample.cancellations == {"queued": 1}
    assert sample.in_flight == 3
    assert sample.tokens_generated is None
    for t in tickets:
        t.release()


def test_no_current_load_means_no_slots() -> None:
    service = FakeService()
    sample = ActivitySampler(service, lambda s: None, clock=Clock()).sample()
    assert (sample.slots_total, sample.active, sample.waiting) == (0, 0, 0)
    service.registry.activate(Serving("http://127.0.0.1:1", 4))
    service.registry.retire_current()
    assert ActivitySampler(service, lambda s: None, clock=Clock()).sample().slots_total == 0


def test_request_rate_over_the_window() -> None:
    service = FakeService()
    clock = Clock()
    sampler = ActivitySampler(service, lambda s: None, clock=clock)
    sampler.sample()
    for _ in range(10):
        service.requests.add(route="/v1/chat/completions", key="owner")
    service.metrics.count_request("/health", 200)  # not a model's request: not counted
    clock.now += 1.0
    assert sampler.sample().requests_per_s == pytest.approx(10.0)
    clock.now += 1.0
    assert sampler.sample().requests_per_s == pytest.approx(5.0)  # 10 over the last 2 s
    clock.now += 2.0
    assert sampler.sample().requests_per_s == pytest.approx(0.0)


def test_peaks_catch_requests_shorter_than_the_interval() -> None:
    service = FakeService()
    queue = service.registry.activate(Serving("http://127.0.0.1:1", 1))
    sampler = ActivitySampler(service, lambda s: None, clock=Clock())
    first, second = queue.request(), queue.request()
    first.release()
    second.release()
    sample = sampler.sample()
    assert (sample.active, sample.waiting) == (0, 0)
    assert (sample.active_peak, sample.waiting_peak) == (1, 1)
    assert sampler.sample().active_peak == 0


def test_engine_tokens_count_across_restarts() -> None:
    service = FakeService()
    clock = Clock()
    sampler = ActivitySampler(service, lambda s: None, clock=clock)
    sampler.count_tokens(ENGINE, "http://127.0.0.1:1", 100)
    sampler.sample()
    sampler.count_tokens(ENGINE, "http://127.0.0.1:1", 300)
    clock.now += 1.0
    sample = sampler.sample()
    assert sample.tokens_generated == 300 and sample.tokens_per_s == pytest.approx(200)
    sampler.count_tokens(ENGINE, "http://127.0.0.1:2", 50)  # a new process starts from zero
    clock.now += 1.0
    assert sampler.sample().tokens_generated == 350


def test_tokens_made_before_the_first_scrape_still_show_as_a_rate() -> None:
    """Requests that finish between two scrapes of a new engine are not lost."""
    service = FakeService()
    clock = Clock()
    sampler = ActivitySampler(service, lambda s: None, clock=clock)
    sampler.sample()  # the engine has not been scraped yet
    sampler.count_tokens(ENGINE, "http://127.0.0.1:1", 80)
    clock.now += 1.0
    assert sampler.sample().tokens_per_s == pytest.approx(80)


def test_history_is_a_bounded_ring() -> None:
    history = ActivityHistory(seconds=5, interval=1)
    for i in range(20):
        history.add(ActivitySample(time=float(i), waiting=i))
    assert len(history) == 6
    assert history.series("waiting") == [(float(i), float(i)) for i in range(14, 20)]
    assert history.peak("waiting") == 19
    assert history.latest is not None and history.latest.time == 19.0
    history.clear()
    assert history.latest is None and history.peak("active") == 0


def test_parse_prometheus_value() -> None:
    text = ("# HELP llamacpp:tokens_predicted_total Number of generation tokens processed.\n"
            "# TYPE llamacpp:tokens_predicted_total counter\n"
            "llamacpp:tokens_predicted_total 1234\n"
            "llamacpp:tokens_predicted_seconds_total 5.5\n")
    assert parse_prometheus_value(text, "llamacpp:tokens_predicted_total") == 1234
    assert parse_prometheus_value(text, "llamacpp:tokens_predicted_seconds_total") == 5.5
    assert parse_prometheus_value(text, "llamacpp:missing") is None


async def test_sampler_runs_and_reads_engine_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sampler delivers samples on its loop and scrapes the engine's /metrics."""
    hits = []

    def handler(request: httpx.Request) -> httpx.Response:
        hits.append(request.url.path)
        return httpx.Response(200, text="llamacpp:tokens_predicted_total 42\n")

    service = FakeService()
    service._snapshot = Snapshot(state=State.READY, serving=Serving("http://engine.test", 1))
    samples: list[ActivitySample] = []
    got = asyncio.Event()

    def on_sample(sample: ActivitySample) -> None:
        samples.append(sample)
        if sample.tokens_generated == 42:
            got.set()

    sampler = ActivitySampler(service, on_sample, interval=0.01, token_interval=0.01)
    monkeypatch.setattr(httpx, "AsyncClient", answered_by(handler))
    try:
        sampler.start()
        await asyncio.wait_for(got.wait(), 5)
    finally:
        monkeypatch.undo()
        await sampler.stop()
    assert hits and hits[0] == "/metrics"
    assert len(samples) >= 2


async def test_the_models_of_another_gguf_studio_port_are_not_asked_for_engine_tokens(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Its /metrics has no llama.cpp token counter: the sampler leaves it alone and still
    reads the llama-server beside it."""
    hits: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        hits.append(request.url.host)
        return httpx.Response(200, text="llamacpp:tokens_predicted_total 7\n")

    class Service(FakeService):
        def serving_engines(self) -> list[tuple[str, str, Serving]]:
            return [("a", "upstream 1", Serving("http://studio.test", 2, upstream_model="a")),
                    ("b", "upstream 1", Serving("http://studio.test", 2, upstream_model="b")),
                    ("m", "upstream 2", Serving("http://engine.test", 1))]

    got = asyncio.Event()
    sampler = ActivitySampler(Service(), lambda sample: None, interval=0.01,
                              token_interval=0.01)
    monkeypatch.setattr(httpx, "AsyncClient", answered_by(handler))
    monkeypatch.setattr(sampler, "count_tokens",
                        lambda key, url, value: got.set() if len(hits) >= 3 else None)
    try:
        sampler.start()
        await asyncio.wait_for(got.wait(), 5)
    finally:
        monkeypatch.undo()
        await sampler.stop()
    assert set(hits) == {"engine.test"}
