"""Metrics: one registry per service, exact counts, gauges read from admission."""

from __future__ import annotations

import threading

from prometheus_client.parser import text_string_to_metric_families

from backend.admission.admission_registry import AdmissionRegistry
from backend.port.metrics import Metrics, ModelTotals
from backend.llama.load import Serving, Snapshot, State

BASE = "http://127.0.0.1:41001"


def samples(metrics: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    body, _ = metrics.render()
    out = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def test_every_series_of_the_contract_is_exposed():
    body, content_type = Metrics().render()
    assert content_type.startswith("text/plain")
    text = body.decode()
    for name, kind in (("gguf_studio_requests_waiting", "gauge"),
                       ("gguf_studio_requests_active", "gauge"),
                       ("gguf_studio_effective_parallel_slots", "gauge"),
                       ("gguf_studio_rejections_total", "counter"),
                       ("gguf_studio_cancellations_total", "counter"),
                       ("gguf_studio_requests_total", "counter"),
                       ("gguf_studio_backend_restarts_total", "counter"),
                       ("gguf_studio_queue_wait_seconds", "histogram")):
        assert f"# TYPE {name} {kind}\n" in text


def test_two_services_in_one_process_do_not_share_series():
    first, second = Metrics(), Metrics()
    first.count_rejection("server_is_overloaded")
    first.count_restart()
    assert first.value("gguf_studio_rejections_total", {"reason": "server_is_overloaded"}) == 1
    assert second.value("gguf_studio_rejections_total", {"reason": "server_is_overloaded"}) == 0
    assert second.value("gguf_studio_backend_restarts_total") == 0


def test_counts_are_exact_and_labelled():
    metrics = Metrics()
    for reason in ("server_is_overloaded", "server_is_overloaded", "queue_timeout"):
        metrics.count_rejection(reason)
    metrics.count_cancellation("queued")
    metrics.count_cancellation("running")
    metrics.count_cancellation("running")
    metrics.count_request("/v1/chat/completions", 200)
    metrics.count_request("/v1/chat/completions", "429")
    metrics.count_request("other", 404)
    metrics.count_restart()

    found = samples(metrics)
    unrouted = (("engine", ""), ("model", ""))  # counted by the bare Metrics: no model
    assert found[("gguf_studio_rejections_total",
                  (*unrouted, ("reason", "server_is_overloaded")))] == 2
    assert found[("gguf_studio_rejections_total", (*unrouted, ("reason", "queue_timeout")))] == 1
    assert found[("gguf_studio_cancellations_total", (*unrouted, ("stage", "running")))] == 2
    assert found[("gguf_studio_requests_total",
                  (*unrouted, ("route", "/v1/chat/completions"), ("status", "429")))] == 1
    assert found[("gguf_studio_requests_total",
                  (*unrouted, ("route", "other"), ("status", "404")))] == 1
    assert found[("gguf_studio_backend_restarts_total", ())] == 1
    assert metrics.totals() == {
        "requests": 3,
        "rejections": {"server_is_overloaded": 2, "queue_timeout": 1},
        "cancellations": {"queued": 1, "running": 2},
        "restarts": 1,
        "requeues": 0,
        "stalled_clients": 0,
        "queue_waits": 0,
        "queue_wait_seconds": 0.0,
    }


def test_queue_wait_histogram():
    metrics = Metrics()
    for seconds in (0.0, 0.02, 3.0, -1.0):  # a clock hiccup never counts negative
        metrics.observe_queue_wait(seconds)
    assert metrics.value("gguf_studio_queue_wait_seconds_count") == 4
    assert metrics.value("gguf_studio_queue_wait_seconds_sum") == 3.02
    assert metrics.value("gguf_studio_queue_wait_seconds_bucket", {"le": "0.025"}) == 3
    assert metrics.value("gguf_studio_queue_wait_seconds_bucket", {"le": "+Inf"}) == 4
    assert metrics.totals()["queue_waits"] == 4


def test_waiting_and_active_are_read_from_the_admission_registry_at_scrape_time():
    metrics = Metrics()
    registry = AdmissionRegistry(max_waiting_for=lambda slots: 8)
    metrics.bind_registry(registry)
    queue = registry.activate(Serving(BASE, 2))
    tickets = [queue.request() for _ in range(5)]
    assert metrics.value("gguf_studio_requests_active") == 2
    assert metrics.value("gguf_studio_requests_waiting") == 3
    for ticket in tickets:
        ticket.release()
    assert metrics.value("gguf_studio_requests_active") == 0
    assert metrics.value("gguf_studio_requests_waiting") == 0


def test_effective_slots_follow_the_backend_snapshot():
    metrics = Metrics()
    metrics.set_backend(Snapshot(state=State.READY, serving=Serving("http://e", 4)))
    assert metrics.value("gguf_studio_effective_parallel_slots") == 4
    metrics.set_backend(Snapshot(state=State.STOPPED))  # reset on unload / crash
    assert metrics.value("gguf_studio_effective_parallel_slots") == 0


def test_totals_can_be_read_from_another_thread_while_counting():
    metrics = Metrics()
    seen: list[dict] = []

    def reader() -> None:
        for _ in range(200):
            seen.append(metrics.totals())

    thread = threading.Thread(target=reader)
    thread.start()
    for _ in range(2000):
        metrics.count_request("/v1/chat/completions", 200)
        metrics.count_rejection("queue_timeout")
    thread.join()
    assert metrics.totals()["requests"] == 2000
    assert all(t["requests"] <= 2000 for t in seen)
    seen[-1]["rejections"]["queue_timeout"] = -1  # a copy: the live counts are untouched
    assert metrics.totals()["rejections"]["queue_timeout"] == 2000


def test_counts_by_model_and_engine_sum_to_the_port_totals():
    metrics = Metrics()
    tiny_here = metrics.of("tiny", "this machine")
    tiny_far = metrics.of("tiny", "upstream 1")
    smol_queued = metrics.of("smol", "")  # refused before admission: its model, no engine
    tiny_here.count_request("/v1/chat/completions", 200)
    tiny_here.count_request("/v1/chat/completions", 200)
    tiny_far.count_request("/v1/chat/completions", 200)
    tiny_far.count_rejection("upstream_failed")
    tiny_far.count_request("/v1/chat/completions", 502)
    smol_queued.count_rejection("server_is_overloaded")
    smol_queued.count_request("/v1/responses", 429)
    smol_queued.count_cancellation("queued")
    tiny_here.count_cancellation("running")
    tiny_here.count_requeue()
    tiny_far.count_stalled_client()
    tiny_here.observe_queue_wait(0.02)
    tiny_far.observe_queue_wait(3.0)
    metrics.count_request("/health", 200)  # no model's request

    found = samples(metrics)
    def at(name: str, model: str, engine: str, **labels: str) -> float:
        return found[(name, tuple(sorted({"model": model, "engine": engine, **labels}.items())))]

    chat = {"route": "/v1/chat/completions"}
    assert at("gguf_studio_requests_total", "tiny", "this machine", **chat, status="200") == 2
    assert at("gguf_studio_requests_total", "tiny", "upstream 1", **chat, status="200") == 1
    assert at("gguf_studio_requests_total", "tiny", "upstream 1", **chat, status="502") == 1
    assert at("gguf_studio_requests_total", "smol", "", route="/v1/responses", status="429") == 1
    assert at("gguf_studio_requests_total", "", "", route="/health", status="200") == 1
    assert at("gguf_studio_rejections_total", "smol", "", reason="server_is_overloaded") == 1
    assert at("gguf_studio_rejections_total", "tiny", "upstream 1", reason="upstream_failed") == 1
    assert at("gguf_studio_cancellations_total", "smol", "", stage="queued") == 1
    assert at("gguf_studio_requeues_total", "tiny", "this machine") == 1
    assert at("gguf_studio_requeues_total", "tiny", "upstream 1") == 0  # exists from the start
    assert at("gguf_studio_stalled_clients_total", "tiny", "upstream 1") == 1
    assert at("gguf_studio_queue_wait_seconds_count", "tiny", "this machine") == 1
    assert at("gguf_studio_queue_wait_seconds_bucket", "tiny", "upstream 1", le="5.0") == 1
    assert at("gguf_studio_queue_wait_seconds_bucket", "tiny", "upstream 1", le="2.5") == 0

    # Summed over model and engine, each series is the port's total, as before.
    assert metrics.value("gguf_studio_requests_total") == 6
    assert metrics.value("gguf_studio_requests_total", {"status": "200"}) == 4
    assert metrics.value("gguf_studio_requests_total", {"model": "tiny"}) == 4
    assert metrics.value("gguf_studio_queue_wait_seconds_count") == 2
    assert metrics.value("gguf_studio_queue_wait_seconds_sum") == 3.02
    totals = metrics.totals()
    assert (totals["requests"], totals["requeues"], totals["stalled_clients"]) == (6, 1, 1)
    assert totals["rejections"] == {"upstream_failed": 1, "server_is_overloaded": 1}
    assert totals["cancellations"] == {"queued": 1, "running": 1}
    assert metrics.model_totals("tiny") == ModelTotals(answered=4, refused=1, cancelled=1)
    assert metrics.model_totals("smol") == ModelTotals(answered=1, refused=1, cancelled=1)
    assert metrics.model_totals("gpt-4o") == ModelTotals()  # never counted, never made


def test_a_models_counts_are_made_once_and_keep_their_children():
    metrics = Metrics()
    counts = metrics.of("tiny", "this machine")
    assert metrics.of("tiny", "this machine") is counts
    counts.count_request("/v1/chat/completions", 200)
    counts.count_request("/v1/chat/completions", 200)
    assert len(counts._requests) == 1  # one child per label set, looked up once
