"""Prometheus metrics of one service, in a registry of its own.

Each `Metrics` owns its `CollectorRegistry`, so several services (and tests) can live in
one process without their series colliding.  The gateway and the service call the small
methods below; `/metrics` serves `render()`; the window reads `totals()`.

`totals()` is kept in plain Python counters next to the Prometheus ones so that another
thread (the window's) can read it without touching the admission registry or the
prometheus internals.

A port that serves several models (or one model on several engines) also exposes each
engine's series labelled `model` and `engine` (`bind_pool`): "this machine" or
"upstream N", never an address, which could carry a key.  Requests wait for a model,
not an engine, so waiting is labelled by `model` only.  The unlabelled gauges stay the
totals of the whole port.

The counters and the queue-wait histogram carry `model` and `engine` too (`of(model,
engine)` gives a request's `ModelCounts`): the model the port resolved the request to
(never the client's string: a request refused before it had a model counts under
model=""), and the engine it was admitted on ("" before admission).  Summed over the two,
each is the port's total as before, so `sum by (route, status)` and
`histogram_quantile(..., sum by (le) (...))` read as they did.  A `ModelCounts` holds
its Prometheus children, so a count costs a dict lookup, not a `.labels()` call.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from backend.admission.admission_registry import AdmissionRegistry
    from backend.admission.cache_misses import Verdict
    from backend.llama.load import Snapshot

__all__ = ["EngineLoad", "Metrics", "ModelCounts", "ModelLoad", "ModelTotals",
           "QUEUE_WAIT_BUCKETS", "UNROUTED"]

#: From "admitted at once" to "waited the whole default queue timeout".
QUEUE_WAIT_BUCKETS = (0.001, 0.005, 0.025, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                      120.0, 300.0, 600.0, float("inf"))
#: The `model` and `engine` of a count that has neither (refused before it had a model,
#: or not a model's request: /health, /metrics, an unknown path).
UNROUTED = ""
#: The labels every count carries after its own.
COUNT_LABELS = ("model", "engine")


@dataclass(frozen=True)
class EngineLoad:
    """One engine of a model, right now."""

    engine: str  #: "this machine" or "upstream N"
    ready: bool = False  #: it serves now (healthy, slots read)
    slots: int = 0  #: effective parallel slots; 0 while it does not serve
    active: int = 0  #: requests running on it
    kv_capacity: int = 0  #: its KV cache in tokens; 0 while unknown or not serving
    kv_reserved: int = 0  #: KV tokens held by its running requests
    prefill_tokens_per_second: float = 0.0  #: measured after its load; 0: not measured
    step_seconds: float = 0.0  #: one decode step, measured after its load; 0: not measured


@dataclass(frozen=True)
class ModelLoad:
    """One model of the port and its engines, right now."""

    model: str
    waiting: int = 0  #: requests in the model's line (for whichever engine frees first)
    state: str = ""  #: its residency: loading, ready, unloading, unloaded, evicted, failed
    engines: tuple[EngineLoad, ...] = ()


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        gauge = partial(Gauge, registry=self.registry)
        counter = partial(Counter, registry=self.registry)
        self.requests_waiting = gauge(
            "gguf_studio_requests_waiting", "Requests waiting in line for a slot.")
        self.requests_waiting_by_reason = gauge(
            "gguf_studio_requests_waiting_by_reason",
            "Requests whose turn has come that still wait, by reason (prefill_budget: a "
            "long prompt is being computed beside running streams).", ["reason"])
        self.requests_active = gauge(
            "gguf_studio_requests_active", "Requests holding a slot of the model.")
        self.effective_parallel_slots = gauge(
            "gguf_studio_effective_parallel_slots",
            "Requests the loaded llama-server runs at once (0 when nothing is loaded).")
        self.kv_capacity_tokens = gauge(
            "gguf_studio_kv_capacity_tokens",
            "KV cache tokens of the loaded engine (0 when nothing is loaded or unknown).")
        self.kv_reserved_tokens = gauge(
            "gguf_studio_kv_reserved_tokens",
            "KV tokens reserved by running requests (prompt plus output budget).")
        self.layers_offloaded = gauge(
            "gguf_studio_engine_layers_offloaded",
            "Model layers the engine put on a GPU (0 on the CPU or when nothing is loaded).")
        self.device_memory = gauge(
            "gguf_studio_engine_device_memory_mib",
            "Memory the loaded model took on each device (model, KV cache and compute buffers).",
            ["backend", "device"])
        self.rejections = counter(
            "gguf_studio_rejections_total",
            "Requests answered with an error by the port, by error code, model and engine.",
            ["reason", *COUNT_LABELS])
        self.cancellations = counter(
            "gguf_studio_cancellations_total",
            "Clients that went away, by stage (queued or running), model and engine.",
            ["stage", *COUNT_LABELS])
        self.requests = counter(
            "gguf_studio_requests_total",
            "Requests answered by the port, by route, status, model and engine.",
            ["route", "status", *COUNT_LABELS])
        self.backend_restarts = counter(
            "gguf_studio_backend_restarts_total",
            "Times the engine was restarted after it stopped unexpectedly.")
        self.requeues = counter(
            "gguf_studio_requeues_total",
            "Requests put back in line because the engine refused the connection before "
            "anything was sent (it was going away); they wait for the next load.",
            COUNT_LABELS)
        self.stalled_clients = counter(
            "gguf_studio_stalled_clients_total",
            "Clients dropped because they left their answer unread for the stall timeout.",
            COUNT_LABELS)
        self.queue_wait = Histogram(
            "gguf_studio_queue_wait_seconds",
            "Time from arrival to admission of admitted requests, by model and the engine "
            "that admitted them.", COUNT_LABELS, buckets=QUEUE_WAIT_BUCKETS,
            registry=self.registry)

        self.prompt_tokens = counter(
            "gguf_studio_prompt_tokens",
            "Prompt tokens of answered requests, by kind (cached: the engine took them from "
            "its prompt cache; computed: it computed them) and model.", ["kind", "model"])
        self.prompt_cache_misses = counter(
            "gguf_studio_prompt_cache_misses",
            "Answered requests whose engine computed what the session's previous turn had "
            "left in a cache, by reason (first_turn, prefix_changed, unloaded, "
            "engine_changed, restored, slot_taken) and model.", ["reason", "model"])
        self._prompt_children: dict[tuple[str, str], tuple[Counter, Counter]] = {}
        self._miss_children: dict[tuple[str, str], Counter] = {}

        self._lock = threading.Lock()
        self._requests = 0
        self._rejections: dict[str, int] = {}
        self._cancellations: dict[str, int] = {}
        self._restarts = 0
        self._requeues = 0
        self._stalled_clients = 0
        self._queue_waits = 0
        self._queue_wait_sum = 0.0
        self._by_model: dict[str, ModelTotals] = {}
        self._counts: dict[tuple[str, str], ModelCounts] = {}
        self._unrouted = self.of(UNROUTED, UNROUTED)

    def of(self, model: str, engine: str) -> ModelCounts:
        """The counts of `model` (a name the port resolved, never the client's string) on
        `engine` ("this machine", "upstream N", or "" before admission); made once."""
        counts = self._counts.get((model, engine))
        if counts is None:
            with self._lock:
                totals = self._by_model.setdefault(model, ModelTotals())
            counts = self._counts[(model, engine)] = ModelCounts(self, model, engine, totals)
        return counts

    # --- called by the gateway, for what belongs to no model -------------------------

    def observe_queue_wait(self, seconds: float) -> None:
        self._unrouted.observe_queue_wait(seconds)

    def count_rejection(self, reason: str) -> None:
        self._unrouted.count_rejection(reason)

    def count_cancellation(self, stage: str) -> None:
        self._unrouted.count_cancellation(stage)

    def count_requeue(self) -> None:
        self._unrouted.count_requeue()

    def count_stalled_client(self) -> None:
        self._unrouted.count_stalled_client()

    def count_request(self, route: str, status: int | str) -> None:
        self._unrouted.count_request(route, status)

    def count_prompt(self, model: str, verdict: Verdict) -> None:
        """An answered turn's prompt, as the session book judged it
        (`backend.admission.session_book.Sessions.turn_ended`): its cached and computed
        tokens, counted by kind, and a miss by its reason; once per request."""
        tokens = self._prompt_children.get((model, ""))
        if tokens is None:
            tokens = self._prompt_children[(model, "")] = (
                self.prompt_tokens.labels("cached", model),
                self.prompt_tokens.labels("computed", model))
        tokens[0].inc(verdict.cached)
        tokens[1].inc(verdict.computed)
        if verdict.reason is not None:
            miss = self._miss_children.get((model, verdict.reason))
            if miss is None:
                miss = self._miss_children[(model, verdict.reason)] = \
                    self.prompt_cache_misses.labels(verdict.reason, model)
            miss.inc()

    # --- called by the service ------------------------------------------------------

    def set_backend(self, snapshot: Snapshot) -> None:
        self.effective_parallel_slots.set(snapshot.serving.slots if snapshot.serving else 0)
        report = snapshot.engine
        self.device_memory.clear()
        if report is None:
            self.layers_offloaded.set(0)
            return
        self.layers_offloaded.set(report.layers_offloaded or 0 if report.on_gpu else 0)
        for device in report.devices:
            self.device_memory.labels(report.backend, device.name).set(round(device.total_mib, 2))

    def count_restart(self) -> None:
        self.backend_restarts.inc()
        with self._lock:
            self._restarts += 1

    def bind_registry(self, registry: AdmissionRegistry) -> None:
        """Read waiting/active from the admission registry at every scrape."""
        self.requests_waiting.set_function(lambda: registry.total_waiting)
        self.requests_active.set_function(lambda: registry.total_active)
        self.kv_capacity_tokens.set_function(lambda: registry.kv_capacity)
        self.kv_reserved_tokens.set_function(lambda: registry.total_reserved_tokens)
        self.requests_waiting_by_reason.labels("prefill_budget").set_function(
            lambda: registry.total_held_by_prefill_budget)

    def bind_pool(self, loads: Callable[[], Iterable[ModelLoad]]) -> None:
        """Expose every model's and engine's series, read from `loads()` at every scrape
        (engines come and go: a series ends with its engine)."""
        self.registry.register(_PoolCollector(loads))

    def bind_usage(self, usage: Callable[[], Mapping[str, Any]]) -> None:
        """Usage per key (backend.keys.usage.KeyUsage by key name, never the secret),
        read at every scrape."""
        self.registry.register(_KeyUsageCollector(usage))

    # --- read -----------------------------------------------------------------------

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition and its content type.  Call on the loop."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def value(self, name: str, labels: dict[str, str] | None = None) -> float:
        """The sum of the samples `name` whose labels include `labels` (0.0 if none): a
        counter's value over every model and engine unless they are given.  For tests and
        diagnostics: it walks the registry."""
        wanted = (labels or {}).items()
        return sum((sample.value for family in self.registry.collect()
                    for sample in family.samples
                    if sample.name == name and wanted <= sample.labels.items()), 0.0)

    def totals(self) -> dict[str, Any]:
        """Counts since start, safe to call from any thread."""
        with self._lock:
            return {
                "requests": self._requests,
                "rejections": dict(self._rejections),
                "cancellations": dict(self._cancellations),
                "restarts": self._restarts,
                "requeues": self._requeues,
                "stalled_clients": self._stalled_clients,
                "queue_waits": self._queue_waits,
                "queue_wait_seconds": self._queue_wait_sum,
            }

    def model_totals(self, model: str) -> ModelTotals:
        """`model`'s counts since start, over its engines (a copy), safe from any thread."""
        with self._lock:
            found = self._by_model.get(model)
            return dataclasses.replace(found) if found is not None else ModelTotals()


@dataclass
class ModelTotals:
    """One model's counts since start, over all its engines (for /health)."""

    answered: int = 0  #: requests answered, whatever the status
    refused: int = 0  #: of them, refused by the port (an error it produced)
    cancelled: int = 0  #: clients that went away, queued or running


class ModelCounts:
    """The counts of one model on one engine.  Its Prometheus children are looked up
    once per label set and kept: `.labels()` costs microseconds, a dict lookup does not."""

    __slots__ = ("model", "engine", "_metrics", "_totals", "_requests", "_rejections",
                 "_cancellations", "_requeues", "_stalled_clients", "_queue_wait")

    def __init__(self, metrics: Metrics, model: str, engine: str, totals: ModelTotals) -> None:
        self.model = model
        self.engine = engine
        self._metrics = metrics
        self._totals = totals
        self._requests: dict[tuple[str, int | str], Counter] = {}
        self._rejections: dict[str, Counter] = {}
        self._cancellations: dict[str, Counter] = {}
        self._requeues: Counter | None = None
        self._stalled_clients: Counter | None = None
        self._queue_wait: Histogram | None = None
        if engine:
            # An engine's series exist (at 0) from its first request on: an alert on the
            # increase of a rare count sees the first one.
            self._requeues = metrics.requeues.labels(model, engine)
            self._stalled_clients = metrics.stalled_clients.labels(model, engine)
            self._queue_wait = metrics.queue_wait.labels(model, engine)

    def count_request(self, route: str, status: int | str) -> None:
        child = self._requests.get((route, status))
        if child is None:
            child = self._requests[(route, status)] = self._metrics.requests.labels(
                route, str(status), self.model, self.engine)
        child.inc()
        metrics = self._metrics
        with metrics._lock:
            metrics._requests += 1
            self._totals.answered += 1

    def count_rejection(self, reason: str) -> None:
        child = self._rejections.get(reason)
        if child is None:
            child = self._rejections[reason] = self._metrics.rejections.labels(
                reason, self.model, self.engine)
        child.inc()
        metrics = self._metrics
        with metrics._lock:
            metrics._rejections[reason] = metrics._rejections.get(reason, 0) + 1
            self._totals.refused += 1

    def count_cancellation(self, stage: str) -> None:
        child = self._cancellations.get(stage)
        if child is None:
            child = self._cancellations[stage] = self._metrics.cancellations.labels(
                stage, self.model, self.engine)
        child.inc()
        metrics = self._metrics
        with metrics._lock:
            metrics._cancellations[stage] = metrics._cancellations.get(stage, 0) + 1
            self._totals.cancelled += 1

    def count_requeue(self) -> None:
        if self._requeues is None:
            self._requeues = self._metrics.requeues.labels(self.model, self.engine)
        self._requeues.inc()
        metrics = self._metrics
        with metrics._lock:
            metrics._requeues += 1

    def count_stalled_client(self) -> None:
        if self._stalled_clients is None:
            self._stalled_clients = self._metrics.stalled_clients.labels(self.model, self.engine)
        self._stalled_clients.inc()
        metrics = self._metrics
        with metrics._lock:
            metrics._stalled_clients += 1

    def observe_queue_wait(self, seconds: float) -> None:
        seconds = max(0.0, seconds)
        if self._queue_wait is None:
            self._queue_wait = self._metrics.queue_wait.labels(self.model, self.engine)
        self._queue_wait.observe(seconds)
        metrics = self._metrics
        with metrics._lock:
            metrics._queue_waits += 1
            metrics._queue_wait_sum += seconds


#: (name, help, what it reads from an EngineLoad) of the series labelled model and engine.
_ENGINE_SERIES: tuple[tuple[str, str, Callable[[EngineLoad], float]], ...] = (
    ("gguf_studio_engine_ready", "1 while this engine serves the model (healthy, slots read), "
     "else 0.", lambda e: int(e.ready)),
    ("gguf_studio_engine_requests_active", "Requests holding a slot of this engine.",
     lambda e: e.active),
    ("gguf_studio_engine_effective_parallel_slots",
     "Requests this engine runs at once (0 while it does not serve).", lambda e: e.slots),
    ("gguf_studio_engine_kv_capacity_tokens",
     "KV cache tokens of this engine (0 while it does not serve or is unknown).",
     lambda e: e.kv_capacity),
    ("gguf_studio_engine_kv_reserved_tokens",
     "KV tokens reserved by the requests running on this engine.", lambda e: e.kv_reserved),
    ("gguf_studio_engine_prefill_tokens_per_second",
     "Prompt tokens per second this engine computed when measured after its load (0: not "
     "measured).", lambda e: e.prefill_tokens_per_second),
    ("gguf_studio_engine_step_seconds",
     "One decode step of this engine, measured after its load (0: not measured).",
     lambda e: e.step_seconds),
)
_MODEL_WAITING = ("gguf_studio_model_requests_waiting",
                  "Requests waiting in this model's line, for whichever of its engines frees first.")
_MODEL_STATE = ("gguf_studio_model_state",
                "1 for the state this model is in now (loading, ready, unloading, unloaded, "
                "evicted, failed).")


class _PoolCollector(Collector):
    def __init__(self, loads: Callable[[], Iterable[ModelLoad]]) -> None:
        self._loads = loads

    def describe(self) -> Iterator[Metric]:
        yield from self._families()

    def collect(self) -> Iterator[Metric]:
        waiting, state, *engine_families = self._families()
        for load in self._loads():
            waiting.add_metric([load.model], load.waiting)
            if load.state:
                state.add_metric([load.model, load.state], 1)
            for engine in load.engines:
                for family, (_, _, read) in zip(engine_families, _ENGINE_SERIES):
                    family.add_metric([load.model, engine.engine], read(engine))
        yield waiting
        yield state
        yield from engine_families

    @staticmethod
    def _families() -> list[GaugeMetricFamily]:
        families = [GaugeMetricFamily(*_MODEL_WAITING, labels=["model"]),
                    GaugeMetricFamily(*_MODEL_STATE, labels=["model", "state"])]
        families += [GaugeMetricFamily(name, text, labels=["model", "engine"])
                     for name, text, _ in _ENGINE_SERIES]
        return families


class _KeyUsageCollector:
    """`gguf_studio_key_*` families, labelled by key name, from the usage ledger."""

    def __init__(self, usage: Callable[[], Mapping[str, Any]]) -> None:
        self._usage = usage

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        requests = CounterMetricFamily("gguf_studio_key_requests",
                                       "Requests answered, by key.", labels=["key"])
        tokens = CounterMetricFamily("gguf_studio_key_tokens",
                                     "Tokens the engine reported, by key and kind.",
                                     labels=["key", "kind"])
        waits = CounterMetricFamily("gguf_studio_key_queue_wait_seconds",
                                    "Seconds requests of a key waited in line.", labels=["key"])
        refusals = CounterMetricFamily("gguf_studio_key_refusals",
                                       "Requests refused, by key and reason.",
                                       labels=["key", "reason"])
        for key, used in sorted(self._usage().items()):
            requests.add_metric([key], used.requests)
            tokens.add_metric([key, "prompt"], used.prompt_tokens)
            tokens.add_metric([key, "completion"], used.completion_tokens)
            waits.add_metric([key], used.wait_seconds)
            for reason, count in sorted(used.refusals.items()):
                refusals.add_metric([key, reason], count)
        yield from (requests, tokens, waits, refusals)
