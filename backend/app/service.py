"""The one object the window and the command line talk to.

It wires the pool (local models, each run by its own supervisor, and engines elsewhere),
the admission registry, the metrics and the gateway together on one asyncio loop.
`BackendThread` (`backend.app.backend_thread`) gives that loop a thread of its own when a
GUI owns the main thread.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import platformdirs

from backend.addresses import client_urls, is_loopback
from backend.api_keys import generate_api_key
from backend.app.sharing.announcer import Announcer
from backend.app.sharing.discovery import Advertiser
from backend.app.sharing.key_table import KeyTable, client_setup, key_table
from backend.app.sharing.snippets import ClientModel, ClientTarget
from backend.app.pool.local_models import estimate_model_bytes, memory_budget
from backend.app.pool.parking_steward import ParkingSteward
from backend.app.pool.pool import Pool
from backend.app.key_watch import KeyWatch
from backend.app.request_history import HISTORY_FILE, load_history, save_history
from backend.app.model_swap import (LoadQuestion, ServedModel, UnloadQuestion, load_question,
                                    quit_question, served_models, unload_question)
from backend.keys.usage import UsageLedger
from backend.app.pool.pool_config import ModelEntry, PoolConfig, UpstreamEntry
from backend.app.pool.pool_status import engines_elsewhere, model_cards, model_loads
from backend.keys.enrolment_window import EnrolmentWindow, enrolment_window
from backend.keys.enrolments import Enrolments, SharedRequest
from backend.errors import RequestError, SettingsError
from backend.heap import return_large_blocks
from backend.keys.key_store import KeyRecord, KeyStore
from backend.listeners import Listeners
from backend.llama.engine import Engine, detect_accelerators
from backend.llama.kv_capacity import KvLayout
from backend.llama.slot_parking import ParkingLot, ParkKey
from backend.llama.load import Listener, LoadSpec, LogListener, Serving, Snapshot, State
from backend.llama.supervisor import Supervisor
from backend.models.model_names import DEFAULT_MODEL_ALIAS
from backend.app.session_rows import SessionRow, session_rows
from backend.admission.admission_registry import AdmissionRegistry
from backend.port.route import Route
from backend.admission.flow_control import FlowControl
from backend.admission.rate_limits import RateLimiter
from backend.port.request_log import RequestLog
from backend.port.catalog import ModelCard
from backend.port.metrics import Metrics, ModelLoad
from backend.settings import Settings, remember_keys_required

if TYPE_CHECKING:
    from backend.port.tracing import SpanExport
    from backend.port.server import GatewayServer

log = logging.getLogger("gguf_studio.service")

#: Where parked session prefixes live, in the user data dir (backend.llama.slot_parking).
PARKED_SLOTS_DIR = "parked-slots"


class StudioService:
    """Supervisor + admission + metrics + gateway, on the loop that calls `start`."""

    def __init__(self, settings: Settings, *, engine: Engine | None = None,
                 log_dir: Path | None = None) -> None:
        self.settings = settings
        self.engine = engine or Engine()
        self.log_dir = Path(log_dir) if log_dir else Path(platformdirs.user_log_dir("gguf-studio"))
        self.metrics = Metrics()
        self.registry = AdmissionRegistry(
            max_waiting_for=lambda slots: self.settings.effective_max_queue(slots),
            enabled=settings.admission_enabled, placement_of=self._placement_of,
        )
        self.metrics.bind_registry(self.registry)
        self.keys = KeyStore(owner_secret=settings.api_key, keys_required=settings.keys_required,
                             on_keys_required=remember_keys_required)
        self.usage = UsageLedger.load()
        limiter = RateLimiter()
        for record in self.keys.records():
            limiter.preload(record.name, self.usage.day_tokens(record.name))
        self.flows = FlowControl(limiter, self.usage)
        #: Teammates asking for a key (backend.keys.enrolments); `on_enrolments` hears changes.
        self.enrolments = Enrolments(self.keys, ttl=lambda: self.settings.enrolment_ttl,
                                     on_change=self._enrolments_changed)
        self._enrolment_listeners: Listeners[[]] = Listeners(log, "enrolment listener")
        self._window_listeners: Listeners[[EnrolmentWindow]] = Listeners(
            log, "enrolment window listener")
        self._window_published: EnrolmentWindow | None = None
        #: The port's announcement on the LAN (backend.app.sharing.announcer).
        self.announcer = Announcer()
        self.metrics.bind_usage(self.usage.snapshot)
        #: The request inspector's ring (kept across restarts of the port, and of the
        #: app: `backend.app.request_history`).
        self.requests = RequestLog()
        self._history = self.engine.data_dir / HISTORY_FILE
        load_history(self._history, self.requests)
        #: The Chat tab's key: made for this run, never saved (backend.app.chat_session).
        self.chat_secret = generate_api_key()
        self._spans: SpanExport | None = None
        if settings.otel_endpoint:  # OpenTelemetry only when asked for (the `otel` extra)
            from backend.port.tracing import span_export_to
            self._spans = self.requests.exporter = span_export_to(
                settings.otel_endpoint, client_parent=lambda: self.settings.otel_client_parent)
        self._flow_tasks: list[asyncio.Future[None]] = []
        #: Session prefixes saved before planned losses and restored on the next turn.
        self.parking = ParkingSteward(
            ParkingLot(self.engine.data_dir / PARKED_SLOTS_DIR,
                       budget=lambda: self.settings.parked_slots_mib << 20,
                       ttl=lambda: self.settings.parked_slots_days * 86400),
            entry_of=lambda name: self.pool.local_entry(name), sessions=self.registry.sessions)
        self.pool = Pool(self.registry, settings=lambda: self.settings,
                         engine_binary=self._engine_binary, new_supervisor=self._new_supervisor,
                         abort=self._abort, memory_budget=memory_budget,
                         estimate=estimate_model_bytes, before_loss=self.parking.park)
        self.metrics.bind_pool(self.model_loads)
        self._listeners: Listeners[[Snapshot]] = Listeners(log, "service listener")
        self._log_listeners: Listeners[[str]] = Listeners(log, "engine log listener")
        self._gateway: GatewayServer | None = None
        self._gateway_lock = asyncio.Lock()
        self._restarts_seen: dict[str, int] = {}
        self._snapshot = Snapshot()
        self.pool.add_listener(self._on_engine_snapshot)
        self.pool.add_log_listener(lambda model, line: self._log_listeners(line))
        self._last_spec: LoadSpec | None = None
        #: The keys applied to waiting and running requests, and watched while they do.
        self.key_watch = KeyWatch(self.keys, self.registry, self.flows, self.enrolments,
                                  self.parking, self._publish_enrolment_window)

    # --- state --------------------------------------------------------------------------

    def snapshot(self) -> Snapshot:
        return self._snapshot

    def add_listener(self, listener: Listener) -> None:
        """Called on the service's loop with every new snapshot."""
        self._listeners.add(listener)

    def add_log_listener(self, listener: LogListener) -> None:
        """Called with every line the engine writes, whichever backend runs it."""
        self._log_listeners.add(listener)

    def log_tail(self, lines: int = 200) -> list[str]:
        """The default model's engine's last lines."""
        for model, backend in self.pool.backends():
            if model == self.pool.default_model:
                return backend.log_tail(lines)
        return []

    # --- the port ---------------------------------------------------------------------------

    async def start_gateway(self) -> list[str]:
        """Open the OpenAI-compatible port; returns the base URLs clients should use."""
        check_bind_allowed(self.settings, named_keys=self.keys.requires_keys())
        from backend.port.enrolment_endpoint import EnrolmentEndpoint
        from backend.port.gateway import create_app  # starlette only when serving
        from backend.port.server import GatewayServer

        async with self._gateway_lock:
            if self._gateway is None:
                enrolment = EnrolmentEndpoint(self.enrolments, self.enrolment_window,
                                              self.client_setup, lambda: self.settings)
                self._gateway = await GatewayServer.start(create_app(self, enrolment),
                                                          self.settings.host, self.settings.port)
                self._advertise()
                self._start_flow_tasks()
                self._publish_enrolment_window()
                # What is alive now lives about as long as the process (modules, the app,
                # Qt's wrappers): out of the collector's sight, the collections that run
                # while streams flow no longer walk it (62,000 objects: a full collection
                # took 61 ms, the middle generation up to 47 ms, on a port relaying 64
                # streams).  Collected first, so no garbage of an earlier port is kept.
                gc.collect()
                gc.freeze()
                # A large request body's memory goes back to the system once freed.
                return_large_blocks()
        return client_urls(self.settings.host, self._gateway.port)

    @property
    def gateway_port(self) -> int | None:
        return self._gateway.port if self._gateway else None

    async def apply_settings(self, settings: Settings) -> list[str]:
        """Take new settings (the port reads them per request); reopens the port when its
        address or number changed."""
        check_bind_allowed(settings, named_keys=self.keys.requires_keys())
        old, self.settings = self.settings, settings
        self.keys.set_owner_secret(settings.api_key)
        self.registry.enabled = settings.admission_enabled
        self.registry.refresh_bounds()
        self.registry.refresh_placements()
        if self._gateway is not None and (old.host, old.port) != (settings.host, settings.port):
            await self.stop_gateway()
        elif self._gateway is not None and _announced(old) != _announced(settings):
            self._advertise()
        self._publish_enrolment_window()
        return await self.start_gateway() if self._gateway is None else \
            client_urls(settings.host, self._gateway.port)

    async def stop_gateway(self) -> None:
        async with self._gateway_lock:
            gateway, self._gateway = self._gateway, None
            await self.announcer.stop()
            if gateway is not None:
                await gateway.stop()

    # --- the LAN: announcing the port, teammates enrolling ---------------------------------

    def enrolment_window(self) -> EnrolmentWindow:
        """Whether the port takes enrolment requests now, why, and until when
        (`backend.keys.enrolment_window`: announced, or an accept window open)."""
        return enrolment_window(self.settings, keys_required=bool(
            self.settings.api_key or self.keys.requires_keys()))

    def add_enrolment_window_listener(self, listener: Callable[[EnrolmentWindow], None]) -> None:
        """Called on the service's loop with the enrolment window whenever it opens,
        closes or moves (within `key_watch.KEY_CHECK_INTERVAL` of an accept window's end)."""
        self._window_listeners.add(listener)

    def add_enrolment_listener(self, listener: Callable[[], None]) -> None:
        """Called on the service's loop whenever a request comes, is decided or goes."""
        self._enrolment_listeners.add(listener)

    def approve_enrolment(self, request: SharedRequest, **limits: Any) -> None:
        """Approve the waiting request the owner checked (its name, code and time asked;
        limits as `add_key`): its requester's next poll makes the key and receives it,
        once.  Raises when that request is not waiting any more."""
        self.enrolments.approve(request.name, request.code, request.requested_at, **limits)

    def refuse_enrolment(self, request: SharedRequest) -> None:
        self.enrolments.refuse(request.name, request.code, request.requested_at)

    def client_setup(self, record: KeyRecord) -> dict[str, Any]:
        """What a client holding `record` needs to know of the port's models (the window's
        snippets are made of the same), without the address and the secret."""
        settings = self.settings
        chat = [status for status in self.pool.statuses() if not status.embeddings]
        default = next((status for status in chat if status.default), chat[0] if chat else None)
        others = tuple(ClientModel(status.name, status.context_length) for status in chat
                       if status is not default)
        target = ClientTarget("", default.name if default else "", "",
                              default.context_length if default else None,
                              settings.max_output_tokens, settings.default_output_tokens,
                              others=others,
                              default_alias=DEFAULT_MODEL_ALIAS if default else "")
        return client_setup(target, record)

    @property
    def advertiser(self) -> Advertiser:
        return self.announcer.advertiser

    @property
    def advertise_problem(self) -> str:
        """Why the port is not announced although asked to be ("" when it is, or not asked)."""
        return self.announcer.problem

    async def announced(self) -> None:
        """Return once the port's announcement on the LAN is made (or given up)."""
        await self.announcer.announced()

    def add_announce_listener(self, listener: Callable[[str, bool], None]) -> None:
        """Called on the service's loop with what the port's announcement is now
        (`Announcer.add_listener`)."""
        self.announcer.add_listener(listener)

    def announcement(self) -> str:
        return self.announcer.text()

    def _enrolments_changed(self) -> None:
        self._enrolment_listeners()

    def _publish_enrolment_window(self) -> None:
        window = self.enrolment_window()
        if window != self._window_published:
            self._window_published = window
            self._window_listeners(window)

    def _advertise(self) -> None:
        """(Re)announce the port as the settings say, in the background."""
        self.announcer.advertise(lambda: self.settings, lambda: self.gateway_port,
                                 lambda: bool(self.settings.api_key or self.keys.requires_keys()))

    # --- loads ----------------------------------------------------------------------------

    async def load(self, spec: LoadSpec) -> Snapshot:
        """Load `spec` as the default model, letting requests running on the previous
        one finish first (up to `reload_grace` seconds); waiting requests move to it."""
        self._last_spec = spec
        return await self.pool.replace_default(spec)

    async def retry_on_cpu(self) -> Snapshot:
        """Load the last model again with no GPU layers, after a GPU load failed."""
        if self._last_spec is None:
            raise SettingsError("There is no load to retry.")
        spec = self._last_spec
        return await self.load(dataclasses.replace(
            spec, settings=dataclasses.replace(spec.settings, n_gpu_layers="none")))

    async def attach_upstream(self, url: str, api_key: str | None = None,
                              kv_layout: KvLayout | None = None) -> Snapshot:
        """Serve a llama-server (or GGUF Studio port) that runs elsewhere.  Returns at
        once; the snapshot turns ready (slots and KV read from it) whenever it answers
        healthy.  `kv_layout`: what the operator states about a llama-server's cache."""
        return await self.pool.add_upstream(UpstreamEntry(url, api_key, kv_layout))

    async def remove_upstream(self, url: str) -> None:
        """Stop serving through the engine at `url`: nothing new goes to it; its model's
        waiters wait for the model's other engines."""
        await self.pool.remove_upstream(url)

    def load_question(self, name: str, *, takes_chats: bool = True) -> LoadQuestion | None:
        """What loading model `name` (as `load` would) changes for the port's users, to
        ask before: None when no other model is served (`backend.app.model_swap`)."""
        return load_question(name, self._served_models(), takes_chats=takes_chats)

    def unload_question(self) -> UnloadQuestion | None:
        """What unloading the default model changes, when others serve (else None)."""
        default = self.pool.default_model
        return unload_question(default, self._served_models()) if default else None

    def quit_question(self) -> str | None:
        """What quitting would stop for the port's users, to ask first (None: nothing)."""
        busy = self.registry.total_active + self.registry.total_waiting
        return quit_question(self.requests.records(), now=time.time(), busy=busy,
                             shared=not is_loopback(self.settings.host))

    def _served_models(self) -> list[ServedModel]:
        statuses = self.pool.statuses()
        busy = {status.name: sum(e.active for e in status.engines) + (
            line.waiting if (line := self.registry.find_line(status.name)) is not None else 0)
            for status in statuses}
        return served_models(statuses, self.requests.records(), now=time.time(), busy=busy)

    async def add_model(self, entry: ModelEntry, *, default: bool = False) -> Snapshot:
        """Serve `entry` beside the models already here and load it (making room as the
        pool's residency decides); the default model stays the default unless `default`."""
        try:
            self.pool.add_model(entry, default=default)
        except ValueError as exc:
            raise SettingsError(str(exc)) from None
        return await self.pool.load_model(entry.name, why="added")

    async def load_model(self, name: str) -> Snapshot:
        return await self.pool.load_model(name, why="loaded on request")

    async def unload_model(self, name: str) -> None:
        """Unload `name`; it stays in the pool and loads again on its next request."""
        await self.pool.unload_model(name)

    async def remove_model(self, name: str) -> None:
        await self.pool.remove_model(name)

    async def set_model_options(self, name: str, *, pinned: bool | None = None,
                                idle_ttl: float | None = None) -> None:
        try:
            self.pool.set_model_options(name, pinned=pinned, idle_ttl=idle_ttl)
        except ValueError as exc:
            raise SettingsError(str(exc)) from None

    async def start_pool(self, config: PoolConfig) -> None:
        """Serve `config`'s models and upstreams; models marked `preload` load now, one
        after the other, the others on their first request."""
        self.pool.memory_limit_mib = config.memory_limit_mib
        for entry in config.models:
            self.pool.add_model(entry)
        if config.default_model:
            self.pool.set_default(config.default_model)
        for upstream in config.upstreams:
            await self.pool.add_upstream(upstream)
        await self.pool.start()

    async def unload(self, *, new_default: str | None = None) -> None:
        """Unload the default model and stop serving it (requests for it are refused
        until a load, not loaded on demand); its waiters are told it is gone.  Requests
        for `default` go to `new_default` from now on, else are refused until a load."""
        name = self.pool.default_model
        if name is not None:
            await self.pool.remove_model(name)
        if new_default is not None:
            self.pool.set_default(new_default)

    async def close(self) -> None:
        await self.stop_gateway()
        self.enrolments.close()
        await self.pool.close()
        for task in self._flow_tasks:
            task.cancel()
        await asyncio.gather(*self._flow_tasks, return_exceptions=True)
        self._flow_tasks.clear()
        self.usage.save()
        try:
            save_history(self._history, self.requests)
        except (OSError, SettingsError) as exc:
            log.warning("The request history could not be saved: %s", exc)
        if self._spans is not None:
            await asyncio.to_thread(self._spans.close)  # the last batch, off the loop

    # --- keys ----------------------------------------------------------------------------

    def _start_flow_tasks(self) -> None:
        if not self._flow_tasks:
            self._flow_tasks = [asyncio.ensure_future(self.usage.autosave()),
                                asyncio.ensure_future(self.key_watch.watch())]

    def apply_keys(self) -> None:
        """Apply the key store as it is now to every request that waits or runs
        (`KeyWatch.apply`)."""
        self.key_watch.apply()

    def add_key(self, name: str, **limits: Any) -> tuple[KeyRecord, str]:
        """Make a named key (`KeyStore.add`); the port takes it at once."""
        return self.keys.add(name, **limits)

    def edit_key(self, name: str, **changes: Any) -> KeyRecord:
        """Change a key's limits; its requests waiting in line wait under the new ones."""
        record = self.keys.edit(name, **changes)
        self.apply_keys()
        return record

    def revoke_key(self, name: str) -> KeyRecord:
        """Revoke a key: the port refuses it from now on (401), its waiting requests too,
        and its running ones end."""
        record = self.keys.revoke(name)
        self.apply_keys()
        return record

    def key_table(self, chart_key: str | None = None, span: int = 60,
                  now: float | None = None) -> KeyTable:
        """The keys with their usage, and the chart of `chart_key` (None: every key) over
        the last `span` minutes.  On the service's loop, where the usage is recorded."""
        now = time.time() if now is None else now
        return key_table(self.keys.records(), self.usage.snapshot(),
                         self.usage.chart_series(chart_key, span, math.floor(now / 60) * 60.0),
                         owner_key_set=bool(self.settings.api_key), chart_key=chart_key,
                         span=span, now=now)

    def session_rows(self) -> tuple[SessionRow, ...]:
        """The Sessions view's rows: the session book's figures and places.  On the
        service's loop, which owns the book."""
        sessions = self.registry.sessions
        book = sessions.caches()
        table = sessions.snapshot()
        serving = {s.key for _, _, s in self.pool.serving_engines()}
        models = {summary.session: summary.model for summary in book}
        parked = {s.key for s in table
                  if (s.engine is None or s.engine not in serving) and s.key in models
                  and self._is_parked(models[s.key], s.flow, s.key)}
        return session_rows(book, table, now=time.monotonic(), serving=serving, parked=parked)

    def _placement_of(self, model: str) -> str:
        """The placement policy of `model`'s line: its own in the models file, else the
        port's setting."""
        entry = self.pool.local_entry(model)
        return entry.placement if entry is not None and entry.placement else \
            self.settings.placement

    def _is_parked(self, model: str, flow: str, session: str) -> bool:
        # No engine's key: an identity worked out for the view, kept per model.
        identity = self.parking.identity(model, "")
        return identity is not None and self.parking.lot.find(ParkKey(identity, flow, session)) is not None

    # --- the gateway's view of the pool --------------------------------------------------

    def route(self, path: str, requested: object) -> Route:
        return self.pool.route(path, requested)

    def model_cards(self) -> list[ModelCard]:
        return model_cards(self.pool.statuses(), self.pool.serving_engines(),
                           cap=self.settings.max_output_tokens,
                           parking=lambda model, serving: self.parking.ability(
                               model, serving).to_dict())

    def engines_elsewhere(self) -> list[dict[str, Any]]:
        """Every engine elsewhere for /health, by its "upstream N" (never its address)."""
        return engines_elsewhere(self.pool.upstream_statuses())

    def model_loads(self) -> list[ModelLoad]:
        """Every model's line and engines right now, for the metrics and the activity."""
        return model_loads(self.pool.statuses(), self.registry)

    def serving_engines(self) -> list[tuple[str, str, Serving]]:
        """(model, where, serving) of every engine that serves now."""
        return self.pool.serving_engines()

    # --- wiring --------------------------------------------------------------------------

    async def _engine_binary(self) -> Path:
        await asyncio.to_thread(detect_accelerators)  # runs programs once; not on the loop
        return self.engine.resolve(self.settings.llama_server or None).path

    def _new_supervisor(self, binary: Path) -> Supervisor:
        return Supervisor(binary, self.log_dir, load_timeout=self.settings.load_timeout,
                          stop_timeout=self.settings.stop_timeout,
                          max_restarts=self.settings.max_restarts,
                          output_cap=lambda: self.settings.max_output_tokens,
                          slot_save_dir=self.parking.slot_dir,
                          stall_budget=lambda: max(0.0, self.settings.stall_budget_ms) / 1000)

    def _abort(self, key: str, error: RequestError) -> int:
        return self._gateway.abort_load(key, error) if self._gateway is not None else 0

    def _on_engine_snapshot(self, model: str, snapshot: Snapshot) -> None:
        seen = self._restarts_seen.get(model, 0)
        for _ in range(snapshot.restarts - seen):
            self.metrics.count_restart()
        self._restarts_seen[model] = snapshot.restarts
        if model == self.pool.default_model:
            self._snapshot = snapshot
            self.metrics.set_backend(snapshot)
            self._listeners(snapshot)


def _announced(settings: Settings) -> tuple[bool, str]:
    return settings.advertise, settings.advertise_name


def check_bind_allowed(settings: Settings, *, named_keys: bool = False) -> None:
    """Refuse to listen beyond loopback where no key guards the port: neither the
    owner's nor named keys (`named_keys`: the key store requires them)."""
    if is_loopback(settings.host) or settings.api_key or named_keys:
        return
    if settings.allow_no_key:
        log.warning("SERVING %s WITHOUT AN API KEY: anyone who can reach this port can use the model",
                    settings.host)
        return
    raise SettingsError(
        f"Refusing to listen on {settings.host} without an API key: anyone on the network could "
        "use the model. Set one with --api-key (or GGUF_STUDIO_API_KEY), make a named key with "
        "`gguf-studio keys add NAME`, or pass --allow-no-key if you really mean it.")
