"""The one object the window and the command line talk to.

It wires the supervisor (or an attached upstream), the admission registry, the metrics
and the gateway together on one asyncio loop.  `BackendThread` gives that loop a thread
of its own when a GUI owns the main thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Coroutine, TypeVar

import platformdirs

from backend import event_loop
from backend.addresses import client_urls, is_loopback
from backend.port.admission import AdmissionQueue, AdmissionRegistry
from backend.llama.engine import Engine, detect_accelerators
from backend.errors import RETRY_SOON, LoadReplaced, ModelNotReady, SettingsError
from backend.port.metrics import Metrics
from backend.settings import Settings
from backend.listeners import Listeners
from backend.llama.kv_capacity import KvLayout
from backend.llama.load import Listener, LoadBackend, LogListener, LoadSpec, Snapshot, State
from backend.llama.remote_engine import RemoteEngine
from backend.llama.supervisor import Supervisor

if TYPE_CHECKING:
    from backend.port.server import GatewayServer

T = TypeVar("T")

log = logging.getLogger("gguf_studio.service")


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
            enabled=settings.admission_enabled,
        )
        self.metrics.bind_registry(self.registry)
        self._backend: LoadBackend | None = None
        self._supervisor: Supervisor | None = None  # the backend, when it runs the engine here
        self._listeners: Listeners[[Snapshot]] = Listeners(log, "service listener")
        self._log_listeners: Listeners[[str]] = Listeners(log, "engine log listener")
        self._gateway: GatewayServer | None = None
        self._gateway_lock = asyncio.Lock()
        self._restarts_seen = 0
        self._snapshot = Snapshot()
        self._last_spec: LoadSpec | None = None

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
        return self._backend.log_tail(lines) if self._backend is not None else []

    # --- the port ---------------------------------------------------------------------------

    async def start_gateway(self) -> list[str]:
        """Open the OpenAI-compatible port; returns the base URLs clients should use."""
        check_bind_allowed(self.settings)
        from backend.port.gateway import create_app  # starlette only when serving
        from backend.port.server import GatewayServer

        async with self._gateway_lock:
            if self._gateway is None:
                self._gateway = await GatewayServer.start(create_app(self), self.settings.host,
                                                          self.settings.port)
        return client_urls(self.settings.host, self._gateway.port)

    @property
    def gateway_port(self) -> int | None:
        return self._gateway.port if self._gateway else None

    async def apply_settings(self, settings: Settings) -> list[str]:
        """Take new settings (the port reads them per request); reopens the port when its
        address or number changed."""
        check_bind_allowed(settings)
        old, self.settings = self.settings, settings
        self.registry.enabled = settings.admission_enabled
        self.registry.refresh_bounds()
        if self._gateway is not None and (old.host, old.port) != (settings.host, settings.port):
            await self.stop_gateway()
        return await self.start_gateway() if self._gateway is None else \
            client_urls(settings.host, self._gateway.port)

    async def stop_gateway(self) -> None:
        async with self._gateway_lock:
            gateway, self._gateway = self._gateway, None
            if gateway is not None:
                await gateway.stop()

    # --- loads ----------------------------------------------------------------------------

    async def load(self, spec: LoadSpec) -> Snapshot:
        """Load `spec`, letting requests running on the previous load finish first
        (up to `reload_grace` seconds); waiting requests move to the new load."""
        await asyncio.to_thread(detect_accelerators)  # runs programs once; not on the loop
        binary = self.engine.resolve(self.settings.llama_server or None).path
        self._last_spec = spec
        await self._retire_current_load()
        supervisor = self._supervisor
        if supervisor is None or supervisor.binary != binary:
            # Swapped in before anything is awaited, so a load asked for meanwhile uses
            # this supervisor (which serializes loads) rather than making its own.
            previous = self._backend
            supervisor = Supervisor(
                binary, self.log_dir, load_timeout=self.settings.load_timeout,
                stop_timeout=self.settings.stop_timeout, max_restarts=self.settings.max_restarts)
            self._attach(supervisor)
            self._supervisor = supervisor
            if previous is not None:
                await previous.close()
        try:
            return await supervisor.load(spec)
        except BaseException:
            self.registry.refuse_waiting(ModelNotReady("The model failed to load.", retry_after=RETRY_SOON))
            raise

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
        await self._retire_current_load()
        await self._close_backend()
        remote = RemoteEngine(url, api_key=api_key, kv_layout=kv_layout)
        self._attach(remote)
        return await remote.start()

    async def unload(self) -> None:
        await self._retire_current_load()
        if self._backend is not None:
            await self._backend.unload()
        self.registry.refuse_waiting(ModelNotReady("The model was unloaded.", retry_after=RETRY_SOON))

    async def close(self) -> None:
        await self.stop_gateway()
        await self.unload()
        await self._close_backend()

    # --- wiring --------------------------------------------------------------------------

    def _attach(self, backend: LoadBackend) -> None:
        self._backend = backend
        self._restarts_seen = 0
        def on_snapshot(snapshot: Snapshot) -> None:
            if self._backend is backend:  # a replaced backend's last words are not news
                self._on_backend_snapshot(snapshot)

        backend.add_listener(on_snapshot)
        backend.add_log_listener(self._log_listeners)

    async def _close_backend(self) -> None:
        backend = self._backend
        self._supervisor = None
        if backend is not None:
            await backend.close()  # its last snapshot (stopped) still reaches listeners
        if self._backend is backend:
            self._backend = None

    async def _retire_current_load(self) -> None:
        """No new request goes to the current load; those running on it get
        `reload_grace` seconds to finish, then end with a clean error."""
        queue = self.registry.current
        if queue is None:
            return
        self.registry.retire_current()
        if queue.active and self.settings.reload_grace > 0:
            await self._wait_drained(queue, self.settings.reload_grace)
        if queue.active and self._gateway is not None:
            log.warning("%d request(s) still running on the old load; ending them", queue.active)
            self._gateway.abort_load(queue.key, LoadReplaced(
                "The model was replaced or unloaded while this request ran. Send it again."))

    async def _wait_drained(self, queue: AdmissionQueue, timeout: float) -> None:
        drained = asyncio.Event()

        def check() -> None:
            if queue.active == 0:
                drained.set()

        self.registry.add_listener(check)
        try:
            await asyncio.wait_for(drained.wait(), timeout)
        except asyncio.TimeoutError:
            pass
        finally:
            self.registry.remove_listener(check)

    def _on_backend_snapshot(self, snapshot: Snapshot) -> None:
        previous, self._snapshot = self._snapshot, snapshot
        if snapshot.serving is not None:
            self.registry.activate(snapshot.serving)
        elif previous.state is State.READY and snapshot.state is not State.READY:
            # A crash or a stop: nothing new may go to this load.
            self.registry.retire_current()
            if snapshot.state is State.FAILED:
                self.registry.refuse_waiting(ModelNotReady("The model stopped working.", retry_after=RETRY_SOON))
        if snapshot.restarts > self._restarts_seen:
            for _ in range(snapshot.restarts - self._restarts_seen):
                self.metrics.count_restart()
            self._restarts_seen = snapshot.restarts
        self.metrics.set_backend(snapshot)
        self._listeners(snapshot)


class BackendThread:
    """An asyncio loop in a thread of its own, for a caller (the window) on another loop."""

    def __init__(self, name: str = "gguf-studio-backend") -> None:
        self.loop = event_loop.new_event_loop()  # uvloop's where installed
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        self.loop.call_soon_threadsafe(fn, *args)

    def stop(self, timeout: float = 10.0) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            pending = asyncio.all_tasks(self.loop)
            for task in pending:
                task.cancel()
            if pending:
                self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.close()


def check_bind_allowed(settings: Settings) -> None:
    if is_loopback(settings.host) or settings.api_key:
        return
    if settings.allow_no_key:
        log.warning("SERVING %s WITHOUT AN API KEY: anyone who can reach this port can use the model",
                    settings.host)
        return
    raise SettingsError(
        f"Refusing to listen on {settings.host} without an API key: anyone on the network could "
        "use the model. Set one with --api-key (or GGUF_STUDIO_API_KEY), or pass --allow-no-key "
        "if you really mean it.")
