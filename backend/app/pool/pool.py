"""The pool: the models this port serves, and the engines that serve them.

A model is either a GGUF file on this machine (a `ModelEntry`, run by its own
`Supervisor`: its own llama-server, key, report, restarts, logs, slots and KV), or what
an engine elsewhere serves (an `UpstreamEntry` watched by a `RemoteEngine`; followed by
`backend.app.pool.pool_upstreams`).  Every engine that serves joins its model's admission
line under its own key (base URL), so the admission sees each engine's own slots and
KV, and a waiter goes to whichever engine of its model has room first.  What the pool
says of its models and engines is `backend.app.pool.pool_status`.

Local models are `LocalModels`' (`backend.app.pool.local_models`: loading, eviction by the
fit estimate, idleness, crashes); the pool resolves and routes a request's model to
them or to an engine elsewhere, and says which is the default.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from backend.api_paths import EMBEDDINGS
from backend.errors import RETRY_SOON, ModelNotFound, ModelNotReady, NoChatTemplate, RequestError
from backend.listeners import Listeners
from backend.models.hf_cache import printable
from backend.llama.load import LoadBackend, LoadSpec, Serving, Snapshot
from backend.llama.supervisor import Supervisor
from backend.admission.admission_registry import AdmissionRegistry
from backend.admission.flow import Band
from backend.models.model_names import ModelNames, NamedModel
from backend.app.pool.local_models import LocalModel, LocalModels
from backend.app.pool.pool_config import ModelEntry, UpstreamEntry
from backend.app.pool.pool_status import HERE, EngineStatus, ModelStatus, UpstreamStatus, engine_status
from backend.app.pool.pool_upstreams import Upstreams
from backend.port.route import CHAT_ROUTES, Route
from backend.settings import Settings

__all__ = ["Pool"]

log = logging.getLogger("gguf_studio.pool")


class Pool:
    """Local models and remote engines behind one port; see the module docstring."""

    def __init__(self, registry: AdmissionRegistry, *, settings: Callable[[], Settings],
                 engine_binary: Callable[[], Awaitable[Path]],
                 new_supervisor: Callable[[Path], Supervisor],
                 abort: Callable[[str, RequestError], int],
                 memory_budget: Callable[[], int],
                 estimate: Callable[[ModelEntry], int],
                 before_loss: Callable[[str, Serving], Awaitable[object]] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.registry = registry
        self._listeners: Listeners[[str, Snapshot]] = Listeners(log, "pool listener")
        self._log_listeners: Listeners[[str, str]] = Listeners(log, "pool log listener")
        self._changed_listeners: Listeners[[]] = Listeners(log, "pool change listener")
        self._here = LocalModels(registry, settings=settings, engine_binary=engine_binary,
                                 new_supervisor=new_supervisor, abort=abort,
                                 memory_budget=memory_budget, estimate=estimate,
                                 before_loss=before_loss, clock=clock, told=self._listeners,
                                 logs=self._log_listeners, changed=self._changed_listeners)
        self._locals = self._here.models
        self._upstreams = Upstreams(registry, names=self.names,
                                    default_changed=self._sync_default_engine,
                                    changed=self._changed_listeners, told=self._listeners)
        self._default: str | None = None

    @property
    def memory_limit_mib(self) -> int:
        """The memory budget in MiB for the local models; 0: the machine's."""
        return self._here.memory_limit_mib

    @memory_limit_mib.setter
    def memory_limit_mib(self, value: int) -> None:
        self._here.memory_limit_mib = value

    # --- listeners ---------------------------------------------------------------------

    def add_listener(self, listener: Callable[[str, Snapshot], None]) -> None:
        """`listener(model, snapshot)` for every new snapshot of any engine."""
        self._listeners.add(listener)

    def add_log_listener(self, listener: Callable[[str, str], None]) -> None:
        """`listener(model, line)` for every line a local engine writes."""
        self._log_listeners.add(listener)

    def add_change_listener(self, listener: Callable[[], None]) -> None:
        """Called after every change of the catalogue or of a residency."""
        self._changed_listeners.add(listener)

    # --- the catalogue -----------------------------------------------------------------

    @property
    def default_model(self) -> str | None:
        """The model requests naming none (or `default`) go to: the one made the default,
        also while it is not served (its requests are then refused, never sent to another
        model: an agent set up with `default` is moved only when the owner says so);
        without one, the first model."""
        if self._default is not None:
            return self._default
        names = self.names()
        return names[0] if names else None

    def set_default(self, name: str | None) -> None:
        """Make `name` (any name of a model; an engine elsewhere's may not be known yet)
        the default model."""
        self._default = (self.model_names().resolve(name) or name) if name else name
        self._sync_default_engine()
        self._changed_listeners()

    def names(self) -> list[str]:
        """Every model the pool serves or can load, local ones first."""
        names = [name for name, m in self._locals.items() if not m.entry.embeddings]
        names += [name for name, m in self._locals.items() if m.entry.embeddings]
        names += [name for name in self._upstreams.names() if name not in names]
        return names

    def resolve(self, path: str, requested: object) -> str:
        """The model a request for `path` naming `requested` goes to.

        No model (or an empty one): the default model (for /v1/embeddings the first
        embeddings model, if any), as for `default` (`DEFAULT_MODEL_ALIAS`) unless a model
        is given that name.  A name: a model's name or alias or file name, exact, else
        ignoring case (`ModelNames`).  Unknown: ModelNotFound listing the models (with no
        model at all, ModelNotReady, as for no name).
        """
        names = self.model_names()
        if not isinstance(requested, str) or not requested.strip() \
                or names.is_default_alias(requested.strip()):
            if path == EMBEDDINGS:
                for name, m in self._locals.items():
                    if m.entry.embeddings:
                        return name
                elsewhere = self._upstreams.embeddings_model()
                if elsewhere is not None:
                    return elsewhere
            default = self.default_model
            if default is None:
                raise ModelNotReady("No model is loaded right now. Try again later.",
                                    retry_after=RETRY_SOON)
            if not self._known(default):
                raise ModelNotReady(f"The default model ({printable(default, 80)}) is not "
                                    "served right now. Try again later.", retry_after=RETRY_SOON)
            return default
        wanted = requested.strip()
        if not self.names():
            # Nothing to choose from (before the first load, or after the last unload):
            # the port is not ready, which clients retry, rather than a wrong model name.
            raise ModelNotReady("No model is loaded right now. Try again later.",
                                retry_after=RETRY_SOON)
        found = names.resolve(wanted)
        if found is not None:
            return found
        listed = ", ".join(self.names()) or "none"
        raise ModelNotFound(f"The model {printable(wanted, 80)!r} is not served here. Models: {listed}.",
                            param="model")

    def route(self, path: str, requested: object) -> Route:
        """The route of a request for `path` naming `requested` (`resolve`), with no side
        effect; its `serve` makes sure the model will be served (`_serve`)."""
        name = self.resolve(path, requested)
        local = self._locals.get(name)
        if local is not None:
            template = local.chat_template
            if path in CHAT_ROUTES and template is not None and not template.takes_chats:
                raise NoChatTemplate(name, turned_off=template.model_has_one)
            return Route(name, isolated=local.entry.isolated,
                         serve=functools.partial(self._serve, name))
        return Route(name, named=self._upstreams.must_name(name),
                     serve=functools.partial(self._serve, name))

    def _serve(self, name: str, band: Band) -> None:
        """Make sure model `name` will be served: a local model that is not loaded
        starts loading (for `band`, which decides what its load may evict); one that
        failed answers ModelNotReady until its cool-down is over, then loads again."""
        local = self._locals.get(name)
        if local is not None:
            self._here.serve(local, band)
        elif not self._serves_now(name) and not self.registry.busy(name):
            failed = [served for _upstream, served in self._upstreams.serving(name)
                      if served.state == "failed"]
            if failed:
                raise ModelNotReady(f"The model {name} failed to load where it runs. "
                                    f"{failed[0].error or ''}".strip(), retry_after=RETRY_SOON)

    def model_names(self, adding: ModelEntry | None = None) -> ModelNames:
        """The names requests may use now (with `adding` in place of the local model of
        its name).  Raises SettingsError naming both models when two local ones are given
        one name; an engine elsewhere's models take the names left to them."""
        entries = [m.entry for name, m in self._locals.items()
                   if adding is None or name != adding.name]
        entries += [adding] if adding is not None else []
        guests = [NamedModel(name, names[1:]) for name, names in self._upstreams.all_names()]
        return ModelNames((e.named for e in entries), guests=guests)

    def local_entry(self, name: str) -> ModelEntry | None:
        """The entry of local model `name`; None for an engine elsewhere's or unknown."""
        local = self._locals.get(name)
        return local.entry if local is not None else None

    def statuses(self) -> list[ModelStatus]:
        return [self.status(name) for name in self.names()]

    def status(self, name: str) -> ModelStatus:
        local = self._locals.get(name)
        engines = tuple(self._engine_statuses(name))
        context = None
        line = self.registry.find_line(name)
        if line is not None and line.per_request is not None:
            context = line.per_request
        else:
            for engine in engines:
                if engine.kv is not None:
                    context = int(str(engine.kv["per_request"]))
        if local is not None:
            entry = local.entry
            return ModelStatus(name, entry.aliases, True, local.residency, entry.pinned,
                               entry.idle_ttl, entry.embeddings, name == self.default_model,
                               context, local.decision, local.error, engines,
                               local.chat_template)
        return self._upstreams.model_status(name, engines, context, name == self.default_model)

    def snapshot(self, name: str | None = None) -> Snapshot:
        """The snapshot of `name`'s engine (the default model's when None)."""
        name = name if name is not None else self.default_model
        if name is None:
            return Snapshot()
        local = self._locals.get(name)
        if local is not None:
            return local.supervisor.snapshot if local.supervisor is not None else Snapshot(
                model_id=name, model_path=local.entry.path)
        elsewhere = self._upstreams.snapshot(name)
        return elsewhere if elsewhere is not None else Snapshot()

    def backends(self) -> list[tuple[str, LoadBackend]]:
        """(model, backend) of every engine, for logs and the window."""
        found: list[tuple[str, LoadBackend]] = [
            (name, m.supervisor) for name, m in self._locals.items() if m.supervisor is not None]
        return found + self._upstreams.backends()

    # --- local models ------------------------------------------------------------------

    def add_model(self, entry: ModelEntry, *, default: bool = False) -> None:
        """Know `entry` (replacing an entry of the same name, which keeps its state).
        SettingsError when one of its names is another model's."""
        self.model_names(adding=entry)
        self._here.add(entry)
        if default:
            self._default = entry.name
        self._sync_default_engine()
        self._changed_listeners()

    def set_model_options(self, name: str, *, pinned: bool | None = None,
                          idle_ttl: float | None = None) -> None:
        """Pin or unpin a local model, or change its idle TTL (seconds, 0: never), now.
        Pinning drops the idle TTL: a pinned model is never unloaded for idleness."""
        self._here.set_model_options(name, pinned=pinned, idle_ttl=idle_ttl)

    async def remove_model(self, name: str) -> None:
        await self._here.remove_model(name)

    async def start(self) -> None:
        """Load every model marked to load at start (one after the other)."""
        await self._here.start()

    async def load_model(self, name: str, *, why: str = "loaded on request") -> Snapshot:
        """Load `name` (making room first if needed) and return its ready snapshot.
        Raises LoadError when it does not load."""
        return await self._here.load_model(name, why=why)

    async def replace_default(self, spec: LoadSpec) -> Snapshot:
        """The window's and `serve`'s one load: `spec` becomes the default model; the
        previous default (when another model) is unloaded after its running requests
        finish (up to the reload grace), and its waiters move to the new one."""
        previous = self.default_model
        entry = ModelEntry(name=spec.name, path=spec.model_path, settings=spec.settings, pinned=True)
        self._names_beside(entry, replacing=previous)
        existing = self._locals.get(spec.name)
        if existing is not None and existing.resident:
            await self.unload_model(spec.name, reason="reloaded", refuse=False)
        self._locals.setdefault(spec.name, LocalModel(entry)).entry = entry
        self._default = spec.name
        self._sync_default_engine()
        if previous is not None and previous != spec.name and previous in self._locals:
            self.registry.carry(previous, spec.name)
            await self.unload_model(previous, reason=f"replaced by {spec.name}", refuse=False)
            self._locals.pop(previous, None)
        self._sync_default_engine()
        self._changed_listeners()
        try:
            return await self.load_model(spec.name, why="loaded on request")
        except BaseException:
            self.registry.refuse_waiting(
                ModelNotReady("The model failed to load.", retry_after=RETRY_SOON), spec.name)
            raise

    async def unload_model(self, name: str, *, reason: str = "unloaded on request",
                           refuse: bool = True, evicted: bool = False) -> None:
        """Stop serving `name` (see `LocalModels.unload_model`)."""
        await self._here.unload_model(name, reason=reason, refuse=refuse, evicted=evicted)

    async def unload_all(self) -> None:
        await self._here.unload_all()

    # --- remote engines ----------------------------------------------------------------

    async def add_upstream(self, entry: UpstreamEntry) -> Snapshot:
        """Watch an engine elsewhere; it joins when it answers healthy."""
        return await self._upstreams.add(entry)

    async def remove_upstream(self, url: str) -> None:
        await self._upstreams.remove(url)

    def upstreams(self) -> list[tuple[UpstreamEntry, Snapshot]]:
        return self._upstreams.entries()

    def upstream_statuses(self) -> list[UpstreamStatus]:
        """Every engine elsewhere, serving or not, in the order they were added."""
        return self._upstreams.statuses()

    def serving_engines(self) -> list[tuple[str, str, Serving]]:
        """(model, where, serving) of every engine that serves now, here or elsewhere:
        what the activity reads each engine's own counters from."""
        found: list[tuple[str, str, Serving | None]] = [
            (name, HERE, m.supervisor.snapshot.serving)
            for name, m in self._locals.items() if m.supervisor is not None]
        found += self._upstreams.serving_engines()
        return [(model, where, serving) for model, where, serving in found if serving is not None]

    async def close(self) -> None:
        await self._here.close()
        await self._upstreams.close()

    # --- helpers ---------------------------------------------------------------------

    def _sync_default_engine(self) -> None:
        """The registry's `current` is the default model's engine (what a port with
        one model calls "the load")."""
        name = self.default_model
        if name is None:
            self.registry.default_engine = ""
        elif name in self._locals:
            self.registry.default_engine = self._locals[name].engine_id
        else:
            self.registry.default_engine = self._upstreams.engine_for(name)

    def _engine_statuses(self, name: str) -> list[EngineStatus]:
        found = []
        local = self._locals.get(name)
        if local is not None:
            found.append(engine_status(self.registry, local.engine_id, HERE, self.snapshot(name)))
        return found + self._upstreams.engine_statuses(name)

    def _serves_now(self, name: str) -> bool:
        line = self.registry.find_line(name)
        return line is not None and bool(line.engines)

    def _known(self, name: str) -> bool:
        return name in self._locals or name in self._upstreams.names()

    def _names_beside(self, entry: ModelEntry, replacing: str | None) -> None:
        """Check `entry`'s names against the local models that stay beside it."""
        stay = [m.entry.named for name, m in self._locals.items()
                if name not in (entry.name, replacing)]
        ModelNames([*stay, entry.named])

