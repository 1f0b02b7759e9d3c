"""The pool's engines elsewhere: llama-servers and other GGUF Studio ports, each watched by
a `RemoteEngine`, and what following them does to the admission.

A llama-server (or a GGUF Studio port older than the pool) is one engine of the one
model it serves.  A GGUF Studio port that lists its models gives one engine per model it
serves or can load (key: its address and the model), each following that model's state
there: ready with its own slots and KV, loadable (one request at a time, which loads it
there), or out.  An engine that leaves retires: its running requests go on and its
waiters keep their place for the model's other engines.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from backend.errors import RETRY_SOON, ModelNotFound, ModelNotReady
from backend.llama.load import LoadBackend, ServedModel, Serving, Snapshot, State
from backend.llama.remote_engine import RemoteEngine
from backend.admission.admission_registry import AdmissionRegistry
from backend.app.pool.pool_config import UpstreamEntry
from backend.app.pool.pool_status import (EngineStatus, ModelStatus, Residency, UpstreamStatus,
                                     engine_status, residency_of)

__all__ = ["Upstream", "Upstreams"]


class Upstream:
    """One engine elsewhere and what it serves."""

    def __init__(self, entry: UpstreamEntry, backend: RemoteEngine, number: int) -> None:
        self.entry = entry
        self.backend = backend
        self.number = number  # "upstream N" while it is in the pool, whoever leaves meanwhile
        self.model: str | None = None  # the name it serves (one model), once it answered
        #: What a GGUF Studio port with several models lists, as last read (also while it
        #: is out, so its models stay known); () for an engine of one model.
        self.models: tuple[ServedModel, ...] = ()
        #: Each model's own snapshot as last told to the listeners.
        self.told: dict[str, Snapshot] = {}

    @property
    def where(self) -> str:
        return f"upstream {self.number}"

    @property
    def engine_id(self) -> str:
        return f"remote:{self.backend.base_url}"

    @property
    def serving(self) -> bool:
        """It answers healthy now (its models' states are fresh)."""
        return self.backend.snapshot.state is State.READY

    def names(self) -> list[str]:
        if self.models:
            return [model.name for model in self.models]
        return [self.model] if self.model is not None else []

    def served(self, name: str) -> ServedModel | None:
        return next((model for model in self.models if model.name == name), None)

    def engine_of(self, name: str) -> str:
        """The engine slot (in the admission registry) of its model `name`."""
        return f"{self.engine_id}#{name}" if self.models else self.engine_id

    def model_snapshot(self, name: str) -> Snapshot:
        """Model `name`'s own view: READY with its own `Serving` while it is ready there;
        loading, failed or stopped as that port says; the upstream's state while it is out."""
        snapshot = self.backend.snapshot
        if not self.models:
            return snapshot
        base = dataclasses.replace(snapshot, model_id=name, models=())
        if snapshot.state is not State.READY:
            return base
        served = self.served(name)
        if served is not None and served.state == State.READY.value and served.serving is not None:
            return dataclasses.replace(base, serving=served.serving)
        state = _REMOTE_STATES.get(served.state if served is not None else "", State.STOPPED)
        return dataclasses.replace(base, state=state, serving=None,
                                   error=served.error if served is not None else None)

    # --- as the window and /health see it ------------------------------------------------

    def status(self, registry: AdmissionRegistry) -> UpstreamStatus:
        snapshot = self.backend.snapshot
        serving = snapshot.serving
        models = self.names()
        if serving is not None:
            models += [m.id for m in serving.upstream_models if m.id not in models]
        layout = self.entry.kv_layout
        engine = (self._together(registry) if self.models else
                  engine_status(registry, self.engine_id, self.where, snapshot))
        return UpstreamStatus(self.backend.base_url, layout.value if layout is not None else None,
                              snapshot.error if serving is None else None, tuple(models), engine)

    def engine_status(self, registry: AdmissionRegistry, name: str) -> EngineStatus | None:
        """Its engine of model `name`, if it serves or lists it."""
        served = self.served(name)
        if served is not None:
            return self._served_status(registry, served)
        if not self.models and self.model == name:
            return engine_status(registry, self.engine_id, self.where, self.backend.snapshot)
        return None

    def _served_status(self, registry: AdmissionRegistry, served: ServedModel) -> EngineStatus:
        """A model of a GGUF Studio port: its state as that port says while it answers."""
        status = engine_status(registry, self.engine_of(served.name), self.where,
                               self.model_snapshot(served.name))
        if not self.serving:
            return status
        serving = served.serving
        return dataclasses.replace(
            status, state=served.state, slots=serving.slots if serving is not None else None,
            note=serving.kv_note if serving is not None else None)

    def _together(self, registry: AdmissionRegistry) -> EngineStatus:
        """A GGUF Studio port as one row: what its ready models hold together."""
        snapshot = self.backend.snapshot
        engines = [self._served_status(registry, m) for m in self.models]
        ready = [e for e in engines if e.state == State.READY.value and e.slots]
        caches = [e.kv for e in ready if e.kv is not None]
        kv: dict[str, object] | None = None
        if caches:
            kv = {"total": sum(int(str(c["total"])) for c in caches),
                  "per_request": max(int(str(c["per_request"])) for c in caches),
                  "unified": any(c["unified"] is True for c in caches)}
        return EngineStatus(
            self.where, self.where,
            "restarting" if snapshot.restarting else snapshot.state.value,
            sum(e.slots or 0 for e in ready) or None, kv,
            sum(e.active for e in engines), sum(e.waiting for e in engines),
            sum(e.reserved_tokens for e in engines))


class Upstreams:
    """Every engine elsewhere, in the order they were added; each joins and leaves the
    admission as it says.  The pool speaks through its callbacks: `names()` every model it
    has (here and elsewhere), `default_changed()` before an engine joins (the
    registry's current engine may be it), `changed()` after, and `told(model, snapshot)`
    every engine's or model's new snapshot."""

    def __init__(self, registry: AdmissionRegistry, *, names: Callable[[], list[str]],
                 default_changed: Callable[[], None], changed: Callable[[], None],
                 told: Callable[[str, Snapshot], None]) -> None:
        self.registry = registry
        self._pool_names = names
        self._default_changed = default_changed
        self._changed = changed
        self._told = told
        self._members: dict[str, Upstream] = {}

    async def add(self, entry: UpstreamEntry) -> Snapshot:
        """Watch an engine elsewhere; it joins when it answers healthy."""
        backend = RemoteEngine(entry.url, api_key=entry.api_key, kv_layout=entry.kv_layout)
        if backend.base_url in self._members:
            await self.remove(backend.base_url)
        taken = {u.number for u in self._members.values()}
        number = next(n for n in range(1, len(taken) + 2) if n not in taken)
        upstream = Upstream(entry, backend, number)
        self._members[backend.base_url] = upstream
        backend.add_listener(lambda snapshot: self._on_snapshot(upstream, snapshot))
        self._changed()
        return await backend.start()

    async def remove(self, url: str) -> None:
        upstream = self._members.pop(url, None) or next(
            (u for u in self._members.values() if u.entry.url == url), None)
        if upstream is None:
            return
        self._members.pop(upstream.backend.base_url, None)
        self.registry.retire(upstream.engine_id)
        for name in upstream.names():
            self.registry.retire(upstream.engine_of(name))
        await upstream.backend.close()
        self._changed()

    async def close(self) -> None:
        for url in list(self._members):
            await self.remove(url)

    # --- what they serve ---------------------------------------------------------------

    def names(self) -> list[str]:
        """Every model they serve or can load, each once."""
        names: list[str] = []
        for upstream in self._members.values():
            names += [name for name in upstream.names() if name not in names]
        return names

    def all_names(self) -> list[tuple[str, tuple[str, ...]]]:
        """(model, the names a request may call it by) of every model they list."""
        found: list[tuple[str, tuple[str, ...]]] = []
        for upstream in self._members.values():
            if upstream.models:
                found += [(m.name, (m.name, *m.aliases)) for m in upstream.models]
            elif upstream.model is not None:
                found.append((upstream.model, (upstream.model,)))
        return found

    def embeddings_model(self) -> str | None:
        for upstream in self._members.values():
            for served in upstream.models:
                if served.embeddings:
                    return served.name
        return None

    def must_name(self, name: str) -> bool:
        """Whether a GGUF Studio port with several models serves `name` (it routes by name)."""
        return any(u.models and name in u.names() for u in self._members.values())

    def serving(self, name: str) -> list[tuple[Upstream, ServedModel]]:
        """Model `name` in every GGUF Studio port that answers now and lists it."""
        found = []
        for upstream in self._members.values():
            served = upstream.served(name)
            if served is not None and upstream.serving:
                found.append((upstream, served))
        return found

    def engine_for(self, name: str) -> str:
        """The engine slot of model `name` in the first of them that lists it; "" if none."""
        return next((u.engine_of(name) for u in self._members.values() if name in u.names()), "")

    def snapshot(self, name: str) -> Snapshot | None:
        """Model `name`'s snapshot where it is ready, else where it is listed first."""
        found = [u.model_snapshot(name) for u in self._members.values() if name in u.names()]
        return next((s for s in found if s.state is State.READY), found[0] if found else None)

    def entries(self) -> list[tuple[UpstreamEntry, Snapshot]]:
        return [(u.entry, u.backend.snapshot) for u in self._members.values()]

    def backends(self) -> list[tuple[str, LoadBackend]]:
        return [(u.model or u.backend.snapshot.model_id or u.backend.base_url, u.backend)
                for u in self._members.values()]

    def serving_engines(self) -> list[tuple[str, str, Serving | None]]:
        return [(name, u.where, u.model_snapshot(name).serving)
                for u in self._members.values() for name in u.names()]

    # --- as the window and /health see them --------------------------------------------

    def statuses(self) -> list[UpstreamStatus]:
        """Every engine elsewhere, serving or not, in the order they were added."""
        return [u.status(self.registry) for u in self._members.values()]

    def engine_statuses(self, name: str) -> list[EngineStatus]:
        found = [u.engine_status(self.registry, name) for u in self._members.values()]
        return [status for status in found if status is not None]

    def model_status(self, name: str, engines: tuple[EngineStatus, ...],
                     context: int | None, default: bool) -> ModelStatus:
        """Model `name`, served only elsewhere."""
        ready = any(e.state == State.READY.value for e in engines)
        served = self.serving(name)
        if not served:
            return ModelStatus(name, (), False, Residency.READY if ready else Residency.UNLOADED,
                               True, 0.0, False, default, context,
                               "served by an engine elsewhere", None, engines)
        upstream, model = served[0]
        residency = Residency.READY if ready else residency_of(model.state)
        if ready:
            decision = "served by an engine elsewhere"
        elif model.serving is not None:
            decision = f"{model.state} at {upstream.where}: loaded there by its first request"
        else:
            decision = f"{model.state} at {upstream.where}"
        if context is None:
            context = model.context_length
        return ModelStatus(name, model.aliases, False, residency, True, 0.0,
                           any(m.embeddings for _u, m in served), default,
                           context, decision, None if ready else model.error, engines,
                           model.chat_template)

    # --- following them ------------------------------------------------------------------

    def _on_snapshot(self, upstream: Upstream, snapshot: Snapshot) -> None:
        if snapshot.models or upstream.models:
            self._follow_models(upstream, snapshot)
            if snapshot.models:
                return
        if snapshot.serving is not None and snapshot.model_id:
            upstream.model = snapshot.model_id
            self._default_changed()
            self.registry.activate(snapshot.serving, model=snapshot.model_id,
                                   engine=upstream.engine_id, label=upstream.where)
            self._changed()
        elif self.registry.current_of(upstream.engine_id) is not None:
            self.registry.retire(upstream.engine_id)
            self._changed()
        self._told(upstream.model or upstream.backend.base_url, snapshot)

    def _follow_models(self, upstream: Upstream, snapshot: Snapshot) -> None:
        """Each model a GGUF Studio port lists is an engine of its own here: it serves
        (with that model's slots and cache, or one slot while it is loadable there) and
        retires (its running requests go on, its waiters keep their place for its other
        engines) as that port says.  A model that failed there refuses its waiters when
        nothing else serves it, as a local one does; one gone from its list and from the
        pool refuses them as unknown."""
        gone = [name for name in upstream.names() if all(m.name != name for m in snapshot.models)]
        upstream.models = snapshot.models
        upstream.model = None
        ready = snapshot.state is State.READY
        for model in snapshot.models:
            engine = upstream.engine_of(model.name)
            if ready and model.serving is not None:
                self.registry.activate(model.serving, model=model.name, engine=engine,
                                       label=upstream.where)
            elif self.registry.current_of(engine) is not None:
                self.registry.retire(engine)
            if ready and model.state == "failed":
                self.registry.refuse_waiting(ModelNotReady(
                    f"The model {model.name} failed to load where it runs.",
                    retry_after=RETRY_SOON), model.name)
        for name in gone:
            self.registry.retire(f"{upstream.engine_id}#{name}")
            upstream.told.pop(name, None)
            served = self._pool_names()
            if name not in served:
                # Nothing will serve it again: its waiters hear so now, not at their timeout.
                listed = ", ".join(served) or "none"
                self.registry.refuse_waiting(ModelNotFound(
                    f"The model {name!r} is no longer served here. Models: {listed}.",
                    param="model"), name)
        if not snapshot.models and self.registry.current_of(upstream.engine_id) is not None:
            self.registry.retire(upstream.engine_id)
        self._default_changed()
        self._changed()
        for name in upstream.names():
            told = upstream.model_snapshot(name)
            if upstream.told.get(name) != told:
                upstream.told[name] = told
                self._told(name, told)


#: A model's state as another GGUF Studio port says it, as an engine state here.
_REMOTE_STATES = {"loading": State.STARTING, "failed": State.FAILED}
