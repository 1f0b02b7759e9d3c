"""The pool as the window shows it: a frozen picture taken on the service's loop, and the
words for each cell (so the widgets only render them).

`PoolState.of(pool, metrics)` reads the pool (and each model's request counts) where it
lives; the value may then cross to any thread.  Nothing here holds a key: upstreams are
shown by their address only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from backend.app.pool.pool import Pool
from backend.app.pool.pool_status import EngineStatus, ModelStatus, Residency, UpstreamStatus
from backend.llama.load import State
from backend.port.metrics import Metrics, ModelTotals

__all__ = ["PoolState", "describe_health", "describe_kv", "describe_requests", "describe_slots",
           "describe_where", "model_actions"]


@dataclass(frozen=True)
class PoolState:
    models: tuple[ModelStatus, ...] = ()
    upstreams: tuple[UpstreamStatus, ...] = ()
    #: Each model's requests since the port started (as `/health` counts them).
    requests: dict[str, ModelTotals] = field(default_factory=dict)
    #: Each local model's file (the window finds the model of the file selected).
    paths: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, pool: Pool, metrics: Metrics | None = None) -> PoolState:
        """What `pool` holds now, with each model's counts from `metrics`.  Call on the
        pool's loop."""
        models = tuple(pool.statuses())
        requests = {} if metrics is None else {m.name: metrics.model_totals(m.name) for m in models}
        paths = {m.name: entry.path for m in models
                 if (entry := pool.local_entry(m.name)) is not None}
        return cls(models, tuple(pool.upstream_statuses()), requests, paths)

    def model_of_file(self, path: str | None) -> str | None:
        """The local model served from the file at `path`, if any."""
        return next((name for name, file in self.paths.items() if file == path), None)

    def model(self, name: str) -> ModelStatus | None:
        return next((m for m in self.models if m.name == name), None)

    def upstream(self, url: str) -> UpstreamStatus | None:
        return next((u for u in self.upstreams if u.url == url), None)


@dataclass(frozen=True)
class ModelActions:
    """Which of a model's buttons make sense now."""

    load: bool
    unload: bool
    remove: bool
    options: bool  #: pin and idle TTL (a local model's own)


def model_actions(status: ModelStatus) -> ModelActions:
    if not status.local:  # an engine elsewhere serves it: managed where it runs
        return ModelActions(False, False, False, False)
    residency = status.residency
    return ModelActions(
        load=residency in (Residency.UNLOADED, Residency.EVICTED, Residency.FAILED),
        unload=residency in (Residency.LOADING, Residency.READY),
        remove=residency is not Residency.UNLOADING,
        options=True)


def describe_where(engines: tuple[EngineStatus, ...]) -> str:
    """"this machine", "upstream 1, upstream 2", or a dash when nothing runs it."""
    return ", ".join(engine.where for engine in engines) or "—"


def describe_slots(engines: tuple[EngineStatus, ...] | EngineStatus) -> str:
    """Requests running of the slots of the serving engines: "1 / 4", else a dash."""
    engines = engines if isinstance(engines, tuple) else (engines,)
    serving = [e for e in engines if e.slots]
    if not serving:
        return "—"
    return f"{sum(e.active for e in serving)} / {sum(e.slots or 0 for e in serving)}"


def describe_kv(engines: tuple[EngineStatus, ...] | EngineStatus) -> str:
    """KV tokens in use of the known caches: "1,200 / 8,192", else a dash."""
    engines = engines if isinstance(engines, tuple) else (engines,)
    known = [e for e in engines if e.kv is not None]
    if not known:
        return "—"
    total = sum(int(str(e.kv["total"])) for e in known if e.kv is not None)
    return f"{sum(e.reserved_tokens for e in known):,} / {total:,}"


def describe_requests(totals: ModelTotals | None) -> str:
    """A model's requests since the port started: "12", "12, 1 refused, 2 stopped by the
    client" (as the Activity and Requests tabs word them)."""
    if totals is None:
        return "—"
    text = f"{totals.answered:,}"
    if totals.refused:
        text += f", {totals.refused:,} refused"
    if totals.cancelled:
        text += f", {totals.cancelled:,} stopped by the client"
    return text


def describe_health(upstream: UpstreamStatus) -> str:
    """"ready", or why it is out of the pool right now."""
    state = upstream.engine.state
    if state == State.READY.value:
        return "ready"
    if upstream.error:
        return f"out of the pool — {upstream.error}"
    if state == State.STARTING.value:
        return "checking…"
    return state
