"""The window's one door to the backend service, which runs on a thread of its own.

Everything the service does (the port, admission, the engine, network I/O of any kind)
happens on the `BackendThread`'s asyncio loop.  The window calls the methods below,
which return at once; results and state come back as Qt signals, which Qt queues to
the GUI thread because this object lives there.  Lines of logs and build output are
batched on the backend side, at most ten batches a second, so a flood of traffic costs
the GUI thread a handful of events, not one per line.

Completion callbacks (`on_done`, `on_error`) also run on the GUI thread.  The window
never awaits anything: the same code runs under qasync in the app and under
pytest-qt's plain event loop in the tests.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
from pathlib import Path
from typing import Any, Callable, Coroutine, Sequence, TypeVar

from PySide6.QtCore import QObject, Signal, Slot

from backend.app.session_rows import SessionRow
from backend.app.activity import ActivitySample, ActivitySampler
from backend.app.model_swap import LoadQuestion, UnloadQuestion
from backend.app.pool.pool_config import ModelEntry
from backend.app.pool.pool_state import PoolState
from backend.app.saver import Saver, Write
from backend.llama.accelerators import Accelerators
from backend.llama.engine import Engine, Resolution, detect_accelerators, detected_backends
from backend.keys.enrolment_window import EnrolmentWindow
from backend.errors import LoadSuperseded, StudioError
from backend.keys.enrolments import SharedRequest
from backend.keys.key_store import KeyRecord
from backend.models.download_queue import DownloadQueue
from backend.models.library import ModelLibrary
from backend.port.request_log import RequestRecord
from backend.app.sharing.key_table import KeyTable
from backend.app.backend_thread import BackendThread
from backend.app.service import StudioService
from backend.settings import Settings, settings_path
from backend.llama.kv_capacity import KvLayout
from backend.llama.load import LoadSpec, Snapshot
from backend.throttle import Throttle

from studio.hub_calls import HubCalls
from studio.line_batches import BATCH_INTERVAL, AccessLogHandler, Batcher, on_loop_of

__all__ = ["ACCESS_LOGGER", "ServiceBridge", "describe_error"]

log = logging.getLogger("gguf_studio.studio")

ACCESS_LOGGER = "gguf_studio.access"

Callback = Callable[[Any], None]
T = TypeVar("T")


class ServiceBridge(QObject, HubCalls):
    snapshot_changed = Signal(object)  # Snapshot of the default model's engine
    model_snapshot_changed = Signal(str, object)  # model, Snapshot: every engine of the pool
    log_lines_arrived = Signal(list)  # [LogLine], batched
    activity_sampled = Signal(object)  # ActivitySample
    build_progressed = Signal(list)  # [BuildProgress], batched
    build_finished = Signal(object)  # the binary's Path, or an error message (str)
    urls_changed = Signal(list)  # base URLs clients should use
    error_occurred = Signal(str)  # something the user asked for failed; a readable sentence
    download_progressed = Signal(object)  # DownloadProgress, from the download queue's thread
    pool_changed = Signal(object)  # PoolState, at most ten a second
    enrolments_changed = Signal(list)  # [SharedRequest]: teammates asking for a key
    announcement_changed = Signal(str, bool)  # the port on the LAN: announced as..., or why not; a warning?
    enrolment_window_changed = Signal(object)  # EnrolmentWindow: may teammates ask for a key

    # Internal: carries a callback and its argument to the GUI thread.
    _deliver = Signal(object, object)

    def __init__(self, settings: Settings, *, engine: Engine | None = None,
                 log_dir: Path | None = None, downloads: DownloadQueue | None = None,
                 parent: QObject | None = None) -> None:
        super().__init__(parent)
        self._deliver.connect(self._run_callback)
        self.backend_thread = BackendThread()
        self.service = StudioService(settings, engine=engine, log_dir=log_dir)
        self._files = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="gguf-studio-files")
        # Hugging Face calls block on the network: a thread of their own, so neither the
        # window nor the port's loop waits on them.  Reading the saved queue is local.
        self._hub = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="gguf-studio-hub")
        self.downloads = downloads if downloads is not None else DownloadQueue()
        self.downloads.add_listener(self._on_download)
        self._logs = Batcher(self.backend_thread, self.log_lines_arrived.emit)
        self._build_events = Batcher(self.backend_thread, self.build_progressed.emit)
        self._access_handler = AccessLogHandler(self._logs)
        # The pool changes with every request (slots and KV in use): its picture is taken
        # on the loop at most ten times a second, the last change always included.
        self._pool_watch = Throttle(BATCH_INTERVAL, self._publish_pool,
                                    on_loop_of(self.backend_thread))
        self.pool_state = PoolState()
        self._sampler: ActivitySampler | None = None
        self._port_lock: asyncio.Lock | None = None  # made on the backend loop
        self._saver = Saver()  # used on the backend loop only
        self._building: concurrent.futures.Future[Path] | None = None
        self._closed = False
        self.snapshot = Snapshot()
        #: The newest snapshot of each model's engine (the default's is `snapshot`).
        self.model_snapshots: dict[str, Snapshot] = {}
        #: What parking does for each model on its engine (`ParkingSteward.ability`), said
        #: with its snapshot.
        self.parking_notes: dict[str, str] = {}
        self.urls: list[str] = []

    # --- life -----------------------------------------------------------------------------

    def start(self, *, open_port: bool = True) -> None:
        """Listen to the service, start sampling, and open the port (unless told not to:
        `apply_settings` opens it then)."""
        access = logging.getLogger(ACCESS_LOGGER)
        # Left at INFO for good: restoring it when one window closes would silence the
        # access log of another one still open (tests open several).
        if access.getEffectiveLevel() > logging.INFO:
            access.setLevel(logging.INFO)
        access.addHandler(self._access_handler)
        self.backend_thread.call_soon(self._start_on_loop)
        if open_port:
            self.open_port()

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the engine and the port, then the backend thread.  Blocks; call once at exit."""
        if self._closed:
            return
        self._closed = True
        logging.getLogger(ACCESS_LOGGER).removeHandler(self._access_handler)
        timeout = timeout if timeout is not None else self.service.settings.stop_timeout + 10
        try:
            self.backend_thread.submit(self._close_on_loop()).result(timeout)
        except Exception:
            log.exception("the service did not close cleanly")
        self.backend_thread.stop()
        self._files.shutdown(wait=False, cancel_futures=True)
        # A running download pauses; what reached the disk is resumed next time.  Short:
        # a stalled connection must not hold up quitting.
        self.downloads.close(timeout=2.0)
        self._hub.shutdown(wait=False, cancel_futures=True)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def log_dir(self) -> Path:
        """Where llama-server's log files are written."""
        return self.service.log_dir

    @property
    def gateway_port(self) -> int | None:
        """The port's number while it is open, else None."""
        return self.service.gateway_port

    # --- intent -------------------------------------------------------------------------

    def load(self, spec: LoadSpec, on_error: Callable[[str], None] | None = None,
             on_done: Callback | None = None) -> concurrent.futures.Future[Snapshot]:
        """Load `spec` as the default model, replacing the default one (ask first:
        `load_question`)."""
        return self._call(self.service.load(spec), on_done=on_done, on_error=on_error,
                          quiet=(LoadSuperseded,))

    def load_question(self, name: str, takes_chats: bool, on_done: Callback
                      ) -> concurrent.futures.Future[LoadQuestion | None]:
        """What loading `name` changes for the port's users: `on_done(LoadQuestion)`, or
        `on_done(None)` when nothing else is served."""
        return self._call(_now_on_loop(self.service.load_question, name, takes_chats=takes_chats),
                          on_done=on_done)

    def unload_question(self, on_done: Callback
                        ) -> concurrent.futures.Future[UnloadQuestion | None]:
        """What unloading the default model changes, when others serve (else None)."""
        return self._call(_now_on_loop(self.service.unload_question), on_done=on_done)

    def retry_on_cpu(self, on_error: Callable[[str], None] | None = None
                     ) -> concurrent.futures.Future[Snapshot]:
        """After a GPU load failed: the same load with no GPU layers."""
        return self._call(self.service.retry_on_cpu(), on_error=on_error, quiet=(LoadSuperseded,))

    def unload(self, new_default: str | None = None) -> concurrent.futures.Future[None]:
        """Unload the default model; `default` names `new_default` from now on (None:
        no model until a load)."""
        return self._call(self.service.unload(new_default=new_default))

    # --- the pool -----------------------------------------------------------------------

    def add_model(self, entry: ModelEntry, on_error: Callable[[str], None] | None = None, *,
                  default: bool = False, on_done: Callback | None = None
                  ) -> concurrent.futures.Future[Snapshot]:
        """Serve `entry` beside the loaded models and load it; the default one stays the
        default unless `default`."""
        return self._call(self.service.add_model(entry, default=default), on_done=on_done,
                          on_error=on_error)

    def load_model(self, name: str, on_error: Callable[[str], None] | None = None
                   ) -> concurrent.futures.Future[Snapshot]:
        return self._call(self.service.load_model(name), on_error=on_error)

    def unload_model(self, name: str) -> concurrent.futures.Future[None]:
        return self._call(self.service.unload_model(name))

    def remove_model(self, name: str) -> concurrent.futures.Future[None]:
        return self._call(self.service.remove_model(name))

    def set_model_options(self, name: str, *, pinned: bool | None = None,
                          idle_ttl: float | None = None) -> concurrent.futures.Future[None]:
        return self._call(self.service.set_model_options(name, pinned=pinned, idle_ttl=idle_ttl))

    def add_upstream(self, url: str, api_key: str, kv_layout: str,
                     on_done: Callback | None = None,
                     on_error: Callable[[str], None] | None = None) -> concurrent.futures.Future[Snapshot]:
        """Serve through the engine at `url` (a llama-server or a GGUF Studio port);
        `kv_layout` is "split", "unified" or "" (not stated)."""
        async def attach() -> Snapshot:
            layout = KvLayout.parse(kv_layout)
            return await self.service.attach_upstream(url.strip(), api_key.strip() or None, layout)

        return self._call(attach(), on_done=on_done, on_error=on_error)

    def remove_upstream(self, url: str) -> concurrent.futures.Future[None]:
        return self._call(self.service.remove_upstream(url))

    # --- the port -----------------------------------------------------------------------

    def open_port(self, on_error: Callable[[str], None] | None = None) -> concurrent.futures.Future[list[str]]:
        return self._call(self._one_at_a_time(self.service.start_gateway), on_done=self._set_urls,
                          on_error=on_error)

    def apply_settings(self, settings: Settings,
                       on_error: Callable[[str], None] | None = None) -> concurrent.futures.Future[list[str]]:
        """Give the service new settings; the port reopens if its address changed.  Saves
        asked for before are written first: the port never runs settings that the next
        start would not find."""
        async def apply() -> list[str]:
            await self._saver.flush()
            return await self.service.apply_settings(settings)

        return self._call(self._one_at_a_time(apply), on_done=self._set_urls, on_error=on_error)

    # --- saving -------------------------------------------------------------------------
    # The files are written on the backend loop's worker threads, never the GUI thread's;
    # a burst of saves writes the last state, and `shutdown` writes what is still pending.

    def save_settings(self, settings: Settings, path: Path | None = None,
                      on_error: Callable[[str], None] | None = None) -> None:
        """Write `settings` to `path` (by default the user's settings file)."""
        path = path or settings_path()
        self._save(path, functools.partial(settings.replace().save, path), on_error)

    def save_library(self, library: ModelLibrary,
                     on_error: Callable[[str], None] | None = None) -> None:
        """Write the library as it is now (its state is copied here, on the caller's thread)."""
        self._save(library.path, functools.partial(library.save, library.document()), on_error)

    def _save(self, path: Path, write: Write, on_error: Callable[[str], None] | None) -> None:
        tell = on_error or self.error_occurred.emit
        if self._closed:
            # The backend loop has stopped (a callback queued before the app quit saves):
            # written here rather than lost.
            try:
                write()
            except Exception as exc:
                tell(describe_error(exc))
            return
        self.backend_thread.call_soon(
            self._saver.save, path, write, lambda exc: self._post(tell, describe_error(exc)))

    def build_engine(self, extra_cmake_args: Sequence[str] = (),
                     backend: str = "cpu") -> concurrent.futures.Future[Path]:
        if self._building is not None and not self._building.done():
            return self._building

        async def build() -> Path:
            return await self.service.engine.build(tuple(extra_cmake_args), self._build_events.push,
                                                   backend=backend)

        self._building = self._call(build(), on_done=self.build_finished.emit,
                                    on_error=self.build_finished.emit)
        return self._building

    @property
    def building(self) -> bool:
        return self._building is not None and not self._building.done()

    def engine_status(self, llama_server: str = "") -> Resolution:
        """Which llama-server a load with this setting would use, and why; only looks at files
        (before `accelerators` has run, only the CPU engine is considered: detecting the
        GPUs runs programs, which the GUI thread does not wait for)."""
        return self.service.engine.resolve(llama_server or None,
                                           backends=detected_backends() or ["cpu"])

    def accelerators(self, on_done: Callback) -> concurrent.futures.Future[Accelerators]:
        """This computer's GPUs and toolkits (runs vulkaninfo once, so off the GUI thread)."""
        return self.run_in_thread(detect_accelerators, on_done=on_done)

    def requests_in_flight(self, timeout: float = 1.0) -> int | None:
        """Requests running or waiting right now; None if the service does not answer."""
        if self._closed:
            return 0

        async def count() -> int:
            return self.service.registry.total_active + self.service.registry.total_waiting

        try:
            return self.backend_thread.submit(count()).result(timeout)
        except Exception:
            return None

    def quit_question(self, timeout: float = 1.0) -> str | None:
        """What quitting would stop for the port's users (`StudioService.quit_question`);
        None when nothing, or when the service does not answer (then `requests_in_flight`)."""
        if self._closed:
            return None
        try:
            return self.backend_thread.submit(_now_on_loop(self.service.quit_question)).result(timeout)
        except Exception:
            return None

    def run_self_test(self, model_path: str, llama_server: str | None, timeout: float
                      ) -> concurrent.futures.Future[int]:
        """`--self-test` through this bridge's own service and port; the exit code."""
        from backend.app.self_test import run_self_test

        return self.backend_thread.submit(run_self_test(
            model_path, llama_server=llama_server, service=self.service, timeout=timeout))

    def run_in_thread(self, fn: Callable[..., T], *args: Any,
                      on_done: Callback | None = None,
                      on_error: Callable[[str], None] | None = None) -> concurrent.futures.Future[T]:
        """Run blocking file work (scanning, reading a model's header) off the GUI thread."""
        return self._in_pool(self._files, fn, *args, on_done=on_done, on_error=on_error)

    # --- named keys --------------------------------------------------------------------------
    # On the backend loop, like the port that reads the key store and fills the ledger.

    def add_key(self, name: str, limits: dict[str, Any], on_done: Callback,
                on_error: Callable[[str], None]
                ) -> concurrent.futures.Future[tuple[KeyRecord, str]]:
        """Make a key; `on_done((record, secret))`: the secret exists nowhere else."""
        return self._call(_now_on_loop(self.service.add_key, name, **limits), on_done=on_done,
                          on_error=on_error)

    def edit_key(self, name: str, changes: dict[str, Any], on_done: Callback,
                 on_error: Callable[[str], None]) -> concurrent.futures.Future[KeyRecord]:
        return self._call(_now_on_loop(self.service.edit_key, name, **changes), on_done=on_done,
                          on_error=on_error)

    def revoke_key(self, name: str, on_done: Callback | None = None,
                   on_error: Callable[[str], None] | None = None
                   ) -> concurrent.futures.Future[KeyRecord]:
        return self._call(_now_on_loop(self.service.revoke_key, name), on_done=on_done,
                          on_error=on_error)

    def approve_enrolment(self, request: SharedRequest, limits: dict[str, Any],
                          on_done: Callback | None = None,
                          on_error: Callable[[str], None] | None = None
                          ) -> concurrent.futures.Future[None]:
        """Approve the teammate's request the owner checked (its name, code and time
        asked), with `limits` (as `add_key`): the port makes the key when they collect it."""
        return self._call(_now_on_loop(self.service.approve_enrolment, request, **limits),
                          on_done=on_done, on_error=on_error)

    def refuse_enrolment(self, request: SharedRequest,
                         on_error: Callable[[str], None] | None = None
                         ) -> concurrent.futures.Future[None]:
        return self._call(_now_on_loop(self.service.refuse_enrolment, request),
                          on_error=on_error)

    def key_table(self, chart_key: str | None, span: int, on_done: Callback
                  ) -> concurrent.futures.Future[KeyTable]:
        """The keys, their usage and the chart of `chart_key` (None: every key)."""
        return self._call(_now_on_loop(self.service.key_table, chart_key, span), on_done=on_done)

    def recent_requests(self, after: int, on_done: Callback
                        ) -> concurrent.futures.Future[list[RequestRecord]]:
        """The request inspector's records after id `after`, oldest first."""
        return self._call(_now_on_loop(lambda: self.service.requests.records(after=after)),
                          on_done=on_done)

    def requests_under_way(self, on_done: Callback
                           ) -> concurrent.futures.Future[list[RequestRecord]]:
        """The records of the requests under way (`RequestLog.under_way`)."""
        return self._call(_now_on_loop(self.service.requests.under_way), on_done=on_done)

    def session_rows(self, on_done: Callback) -> concurrent.futures.Future[tuple[SessionRow, ...]]:
        """The Sessions view's rows, made on the backend loop (which owns the session book)."""
        return self._call(_now_on_loop(self.service.session_rows), on_done=on_done)

    def _in_pool(self, pool: concurrent.futures.ThreadPoolExecutor, fn: Callable[..., T],
                 *args: Any, on_done: Callback | None,
                 on_error: Callable[[str], None] | None) -> concurrent.futures.Future[T]:
        if self._closed:
            # A callback still queued when the app shut down (a scan's result selecting a
            # model, say) asks for more work: there is none to do.
            future: concurrent.futures.Future[T] = concurrent.futures.Future()
            future.cancel()
            return future
        future = pool.submit(fn, *args)
        self._when_done(future, on_done, on_error, ())
        return future

    def _on_download(self, progress: Any) -> None:
        try:
            self.download_progressed.emit(progress)
        except RuntimeError:  # the bridge is gone: the app is exiting
            pass

    # --- plumbing ------------------------------------------------------------------------

    def _call(self, coro: Coroutine[Any, Any, T], *, on_done: Callback | None = None,
              on_error: Callable[[str], None] | None = None,
              quiet: tuple[type[BaseException], ...] = ()) -> concurrent.futures.Future[T]:
        if self._closed:
            coro.close()
            future: concurrent.futures.Future[T] = concurrent.futures.Future()
            future.cancel()
            return future
        future = self.backend_thread.submit(coro)
        self._when_done(future, on_done, on_error, quiet)
        return future

    def _when_done(self, future: concurrent.futures.Future[T], on_done: Callback | None,
                   on_error: Callable[[str], None] | None,
                   quiet: tuple[type[BaseException], ...]) -> None:
        def done(f: concurrent.futures.Future[T]) -> None:
            if f.cancelled():
                return
            exc = f.exception()
            if exc is None:
                if on_done is not None:
                    self._post(on_done, f.result())
            elif not isinstance(exc, quiet):
                self._post(on_error or self.error_occurred.emit, describe_error(exc))

        future.add_done_callback(done)

    def _post(self, callback: Callback, value: Any) -> None:
        try:
            self._deliver.emit(callback, value)
        except RuntimeError:  # the bridge is gone: the app is exiting
            pass

    @Slot(object, object)
    def _run_callback(self, callback: Callback, value: Any) -> None:
        callback(value)

    def _set_urls(self, urls: list[str]) -> None:
        self.urls = list(urls)
        self.urls_changed.emit(self.urls)

    # --- on the backend loop ------------------------------------------------------------

    async def _one_at_a_time(self, fn: Callable[..., Coroutine[Any, Any, T]], *args: Any) -> T:
        # Opening and reopening the port must not interleave: a second open while the
        # first is still binding would leave the port on the old address.
        if self._port_lock is None:
            self._port_lock = asyncio.Lock()
        async with self._port_lock:
            return await fn(*args)

    def _start_on_loop(self) -> None:
        self.service.add_listener(self._on_snapshot)
        self.service.add_log_listener(lambda line: self._logs.push(("llama-server", line)))
        pool = self.service.pool
        pool.add_change_listener(self._pool_watch.poke)
        pool.add_listener(lambda _model, _snapshot: self._pool_watch.poke())
        pool.add_listener(lambda model, snapshot: self._post(self._set_model_snapshot, (
            model, snapshot, self.service.parking.ability(model, snapshot.serving).says)))
        self.service.registry.add_listener(self._pool_watch.poke)
        self._pool_watch.poke()
        self.service.add_enrolment_listener(self._on_enrolments)
        self.service.add_announce_listener(self._on_announcement)
        self.service.add_enrolment_window_listener(self._on_enrolment_window)
        self._on_enrolment_window(self.service.enrolment_window())
        self._sampler = ActivitySampler(self.service, self._on_sample)
        self._sampler.start()

    def _on_announcement(self, text: str, warning: bool) -> None:
        try:
            self.announcement_changed.emit(text, warning)
        except RuntimeError:  # the bridge is gone: the app is exiting
            pass

    def _on_enrolment_window(self, window: EnrolmentWindow) -> None:
        try:
            self.enrolment_window_changed.emit(window)
        except RuntimeError:  # the bridge is gone: the app is exiting
            pass

    def _on_enrolments(self) -> None:
        waiting = self.service.enrolments.waiting()
        try:
            self.enrolments_changed.emit(waiting)
        except RuntimeError:  # the bridge is gone: the app is exiting
            pass

    async def _close_on_loop(self) -> None:
        await self._saver.close()
        if self._sampler is not None:
            await self._sampler.stop()
        await self._one_at_a_time(self.service.close)

    def _on_snapshot(self, snapshot: Snapshot) -> None:
        self._post(self._set_snapshot, snapshot)

    def _set_snapshot(self, snapshot: Snapshot) -> None:
        self.snapshot = snapshot
        self.snapshot_changed.emit(snapshot)

    def _set_model_snapshot(self, change: tuple[str, Snapshot, str]) -> None:
        model, snapshot, parking = change
        self.model_snapshots[model] = snapshot
        self.parking_notes[model] = parking
        self.model_snapshot_changed.emit(model, snapshot)

    def _publish_pool(self) -> None:
        if not self.backend_thread.loop.is_closed():
            self._post(self._set_pool_state, PoolState.of(self.service.pool, self.service.metrics))

    def _set_pool_state(self, state: PoolState) -> None:
        self.pool_state = state
        self.pool_changed.emit(state)

    def _on_sample(self, sample: ActivitySample) -> None:
        # Counts change with answers, which need not change the pool: read again each second.
        self._pool_watch.poke()
        try:
            self.activity_sampled.emit(sample)
        except RuntimeError:
            pass


async def _now_on_loop(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`fn(*args, **kwargs)` as a coroutine, for `_call` to run on the backend loop."""
    return fn(*args, **kwargs)


def describe_error(exc: BaseException) -> str:
    """A sentence for the person at the window; StudioErrors are written as such already."""
    if isinstance(exc, StudioError):
        return str(exc)
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.strerror}."
    return f"Unexpected error: {exc or type(exc).__name__}"
