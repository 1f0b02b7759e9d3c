"""The main window: the library on the left; the model, sharing, activity, logs and
engine on the right.  It renders what the bridge reports and turns clicks into calls
on the bridge; decisions (what a load spec is, where models are, what a snippet says)
are the backend's."""

from __future__ import annotations

import logging
from pathlib import Path

from PySide6.QtCore import QByteArray, QSettings, Qt
from PySide6.QtGui import QAction, QCloseEvent, QKeySequence, QShortcut
from PySide6.QtWidgets import (
    QLabel,
    QMainWindow,
    QMessageBox,
    QScrollArea,
    QSplitter,
    QTabWidget,
    QVBoxLayout,
    QWidget,
)

from backend.llama.accelerators import Accelerators
from backend.app.pool import pool_config
from backend.app.activity import ActivitySample
from backend.app.model_account import model_account
from backend.app.model_swap import LoadChoice, LoadQuestion, UnloadQuestion
from backend.app.pool.pool_status import Residency
from backend.errors import SettingsError
from backend.models.gguf_info import ModelInfo, read_model_info
from backend.models.download import DownloadProgress, DownloadState
from backend.models.library import ModelEntry, ModelLibrary
from backend.settings import Settings
from backend.llama.load import Snapshot, State

from studio.activity_view import ActivityView
from studio.bridge import ServiceBridge
from studio.chat_view import ChatLink, ChatView
from studio.discover_view import DiscoverView
from studio.engine_view import EngineView
from studio.library_view import LibraryView
from studio.logs_view import LogsView
from studio.model_view import ModelView, describe_state
from studio.pool_view import PoolView
from studio.requests_view import RequestsView
from studio.sessions_view import SessionsView
from studio.sharing_view import SharingView
from studio.swap_dialog import LoadDialog, UnloadDialog
from studio.window_sharing import SharingWiring
from studio.widgets import guard_widgets

__all__ = ["MainWindow"]

# The way a newcomer goes: talk to the model loaded, share it, see who uses it; the
# machinery after.
(CHAT_TAB, SHARING_TAB, REQUESTS_TAB, SESSIONS_TAB, POOL_TAB, ACTIVITY_TAB, LOGS_TAB,
 ENGINE_TAB, GET_MODELS_TAB) = range(9)

log = logging.getLogger("gguf_studio.studio")


class MainWindow(QMainWindow, SharingWiring):
    def __init__(self, bridge: ServiceBridge, library: ModelLibrary, settings: Settings, *,
                 settings_path: Path | None = None, state_path: Path | None = None) -> None:
        super().__init__()
        self.bridge = bridge
        self.library = library
        self.settings = settings
        self._settings_path = settings_path
        self._state = QSettings(str(state_path), QSettings.Format.IniFormat) if state_path else None
        self._in_flight = 0
        self._scans = 0
        #: Shared on the network by the settings, but no model is ready yet (`start`).
        self._lan_waits = False
        self.setWindowTitle("GGUF Studio")

        self.library_view = LibraryView()
        if library.opened:
            self.library_view.start_dir = str(Path(library.opened[-1]).parent)
        self.model_view = ModelView()
        self.sharing = SharingView()
        self.pool = PoolView()
        self.activity = ActivityView()
        self.requests = RequestsView()
        self.logs = LogsView(bridge.log_dir)
        self.engine = EngineView()
        self.discover = DiscoverView(bridge.curated_models())
        self.chat = ChatView()
        self.chat_link = ChatLink(bridge, self.chat)
        self.chat.share_requested.connect(self.show_sharing)
        self.sessions = SessionsView()

        self.tabs = QTabWidget()
        # Sessions and Pool go by Ctrl+4 and Ctrl+5: every letter of theirs is taken.
        for page, title in ((self.chat, "C&hat"), (_scrolling(self.sharing), "&Sharing"),
                            (self.requests, "&Requests"), (self.sessions, "Sessions"),
                            (self.pool, "Pool"), (self.activity, "&Activity"),
                            (self.logs, "Lo&gs"), (_scrolling(self.engine), "&Engine"),
                            (self.discover, "Get &models")):
            page.setObjectName(title.replace("&", "").lower())  # remembered by name
            self.tabs.addTab(page, title)
        # The model above the tabs, in a splitter of its own that remembers its place:
        # the Chat tab gets the height the model pane does not need.
        self.right_splitter = QSplitter(Qt.Orientation.Vertical)
        self.right_splitter.setObjectName("right_splitter")
        self.right_splitter.addWidget(self.model_view)
        self.right_splitter.addWidget(self.tabs)
        self.right_splitter.setStretchFactor(0, 0)
        self.right_splitter.setStretchFactor(1, 1)
        self.right_splitter.setChildrenCollapsible(False)
        right = QWidget()
        right_layout = QVBoxLayout(right)
        right_layout.setContentsMargins(6, 0, 0, 0)
        right_layout.addWidget(self.right_splitter)
        self.splitter = QSplitter()
        self.splitter.setObjectName("splitter")
        self.splitter.addWidget(self.library_view)
        self.splitter.addWidget(right)
        self.splitter.setStretchFactor(0, 0)
        self.splitter.setStretchFactor(1, 1)
        self.splitter.setSizes([300, 900])
        self.splitter.setChildrenCollapsible(False)
        central = QWidget()
        central_layout = QVBoxLayout(central)
        central_layout.addWidget(self.splitter)
        self.setCentralWidget(central)

        self.status_state = QLabel()
        self.status_url = QLabel()
        self.status_url.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.statusBar().addWidget(self.status_state, 1)
        self.statusBar().addPermanentWidget(self.status_url)

        self._build_menu()
        self._connect()
        self._connect_keys()
        self._set_tab_order()

        self.sharing.set_settings(settings)
        self.refresh_engine()
        self.refresh_library(select=settings.model or None)
        self._on_snapshot(bridge.snapshot)
        self._restore_state()
        guard_widgets(self)  # every page made; rows and dialogs made later are caught too

    # --- wiring ------------------------------------------------------------------------------

    def _build_menu(self) -> None:
        file_menu = self.menuBar().addMenu("&File")
        for text, shortcut, slot in (
                ("&Open model…", QKeySequence.StandardKey.Open, self.library_view.ask_for_files),
                ("Add &folder…", None, self.library_view.ask_for_folder),
                ("&Rescan models", QKeySequence.StandardKey.Refresh, self.refresh_library),
                (None, None, None),
                ("&Quit", QKeySequence.StandardKey.Quit, self.close)):
            if text is None:
                file_menu.addSeparator()
                continue
            action = QAction(text, self)
            if shortcut is not None:
                action.setShortcut(shortcut)
            action.triggered.connect(lambda _=False, s=slot: s())
            file_menu.addAction(action)
        model_menu = self.menuBar().addMenu("&Model")
        for label, keys, handler in (("&Load", "Ctrl+L", self.load_selected),
                                     ("&Unload", "Ctrl+U", self.unload_selected)):
            action = QAction(label, self)
            action.setShortcut(QKeySequence(keys))
            action.triggered.connect(lambda _=False, h=handler: h())
            model_menu.addAction(action)
        for index in range(self.tabs.count()):
            QShortcut(QKeySequence(f"Ctrl+{index + 1}"), self,
                      lambda i=index: self.tabs.setCurrentIndex(i))

    def _connect(self) -> None:
        b = self.bridge
        b.snapshot_changed.connect(self._on_snapshot)
        b.model_snapshot_changed.connect(lambda _model, _snapshot: self._show_account())
        b.pool_changed.connect(lambda _state: self._show_account())
        b.pool_changed.connect(self._share_once_ready)
        b.log_lines_arrived.connect(self.logs.add_lines)
        b.activity_sampled.connect(self._on_sample)
        self.tabs.currentChanged.connect(
            lambda index: self.refresh_sessions() if index == SESSIONS_TAB else None)
        b.urls_changed.connect(self._on_urls)
        b.build_progressed.connect(self.engine.show_progress)
        b.build_finished.connect(self._on_build_finished)
        b.error_occurred.connect(self.show_message)
        b.pool_changed.connect(self.pool.set_state)
        b.pool_changed.connect(lambda state: self.chat.set_models(
            [m.name for m in state.models if not m.embeddings], without_template=[
                m.name for m in state.models
                if m.chat_template is not None and not m.chat_template.takes_chats],
            ready=[m.name for m in state.models if m.residency is Residency.READY]))
        self.requests.refresh_wanted.connect(
            lambda after: b.recent_requests(after, on_done=self.requests.add_records))
        self.requests.refresh_wanted.connect(
            lambda _after: b.requests_under_way(on_done=self.requests.show_under_way))

        self.library_view.selected.connect(self._on_selected)
        self.library_view.files_opened.connect(self.open_files)
        self.library_view.folder_added.connect(self.add_folder)
        self.library_view.rescan_requested.connect(self.refresh_library)
        self.model_view.load_requested.connect(self.load_selected)
        self.model_view.unload_requested.connect(self.unload_selected)
        self.model_view.add_requested.connect(self.add_selected)
        self.model_view.settings_edited.connect(self._remember_load_settings)
        self.model_view.cpu_retry_requested.connect(
            lambda: self.bridge.retry_on_cpu(on_error=self._on_load_error))
        self.sharing.scope_changed.connect(self.set_lan)
        self.sharing.port_changed.connect(self._on_port)
        self.sharing.generate_key_requested.connect(self.regenerate_key)
        self.sharing.limits_changed.connect(lambda limits: self.apply_settings(
            self.settings.replace(**limits)))
        self.engine.build_requested.connect(self.build_engine)
        self.engine.binary_chosen.connect(self.choose_binary)
        self._connect_pool()
        self._connect_discover()

    def _connect_pool(self) -> None:
        p, b = self.pool, self.bridge
        p.load_requested.connect(lambda name: b.load_model(
            name, on_error=lambda message: self.show_message(f"{name} did not load: {message}")))
        p.unload_requested.connect(b.unload_model)
        p.remove_requested.connect(b.remove_model)
        p.pinned_changed.connect(lambda name, on: b.set_model_options(name, pinned=on))
        p.idle_ttl_changed.connect(lambda name, ttl: b.set_model_options(name, idle_ttl=ttl))
        p.upstream_added.connect(lambda url, key, layout: b.add_upstream(
            url, key, layout, on_done=lambda _snapshot: p.upstream_added_ok(),
            on_error=p.show_upstream_problem))
        p.upstream_removed.connect(b.remove_upstream)

    def _connect_discover(self) -> None:
        d, b = self.discover, self.bridge
        d.search_requested.connect(lambda text, sort: b.search_models(
            text, sort, on_done=d.show_repos, on_error=d.show_error))
        d.repo_selected.connect(lambda repo, context: b.list_repo(
            repo, context, on_done=d.show_listing, on_error=d.show_error))
        d.context_changed.connect(lambda listing, context: b.refit(listing, context, on_done=d.show_listing))
        d.download_requested.connect(b.download)
        d.pause_requested.connect(b.pause_download)
        d.resume_requested.connect(b.resume_download)
        d.cancel_requested.connect(b.cancel_download)
        d.token_entered.connect(lambda token: b.save_hf_token(token, on_error=d.show_error))
        b.download_progressed.connect(self._on_download)
        for progress in b.downloads.jobs():  # paused ones from the last session
            d.show_progress(progress)
        self.library_view.get_models_requested.connect(
            lambda: self.tabs.setCurrentIndex(GET_MODELS_TAB))

    def _on_download(self, progress: DownloadProgress) -> None:
        self.discover.show_progress(progress)
        if progress.state is DownloadState.DONE:
            self.refresh_library(select=progress.path)  # ready to load

    def _set_tab_order(self) -> None:
        lv, mv = self.library_view, self.model_view
        chain = [lv.search, lv.list, lv.open_button, lv.folder_button, lv.rescan_button,
                 mv.ctx_size, mv.parallel, mv.threads, mv.gpu_layers, mv.extra_args, mv.rpc,
                 mv.load_button, mv.unload_button, mv.add_button, self.tabs]
        for first, second in zip(chain, chain[1:]):
            QWidget.setTabOrder(first, second)

    # --- library --------------------------------------------------------------------------

    def refresh_library(self, select: str | None = None) -> None:
        # Scans may finish out of order; only the newest one describes the library.
        self._scans += 1
        scan = self._scans

        def done(entries: list[ModelEntry]) -> None:
            if scan == self._scans:
                view = self.library_view
                view.set_entries(entries, select=select)
                if view.current_entry() is None and view.entries():
                    # At first sight a model found is a model chosen: Load is one click.
                    view.select_path(view.entries()[0].path)

        self.bridge.run_in_thread(self.library.scan, on_done=done, on_error=self.show_message)

    def open_files(self, paths: list[str]) -> None:
        keys = [self.library.add_file(p) for p in paths]
        self._save_library()
        self.refresh_library(select=keys[-1] if keys else None)

    def add_folder(self, folder: str) -> None:
        self.library.add_folder(folder)
        self._save_library()
        self.refresh_library()

    def _on_selected(self, entry: ModelEntry | None) -> None:
        self.chat.set_chosen(entry.name if entry is not None else "")
        if entry is None:
            self.model_view.show_info(None, None)
            self._show_account()
            return
        path = entry.path
        self.model_view.show_reading(path, entry.name)
        self.model_view.set_load_settings(self.library.settings_for(path))
        self._show_account()

        def shown(info: ModelInfo) -> None:
            if self.model_view.path == path:
                self.model_view.show_info(path, info)

        def broken(reason: str) -> None:
            if self.model_view.path == path:
                self.model_view.show_info(path, None, f"This file cannot be loaded — {reason}")

        self.bridge.run_in_thread(read_model_info, path, on_done=shown, on_error=broken)

    def _remember_load_settings(self) -> None:
        path = self.model_view.path
        if path is None:
            return
        try:
            wanted = self.model_view.load_settings()
        except SettingsError:
            return  # shown when the user tries to load
        self.library.remember_settings(path, wanted)
        self._save_library()

    # --- loading ----------------------------------------------------------------------------

    def load_selected(self) -> None:
        """Load the selected model with the settings shown.  While other models serve, ask
        first: replace the default model (teammates' `default` moves) or add beside it."""
        path, info = self.model_view.path, self.model_view.info
        if path is None or info is None:
            return
        try:
            wanted = self.model_view.load_settings()
            spec = wanted.to_spec(path, own_template=info.has_chat_template)
        except SettingsError as exc:
            self.model_view.show_settings_error(str(exc))
            return
        self.model_view.show_settings_error("")
        tab = self.tabs.currentIndex()  # where the person was when they asked

        def asked(question: LoadQuestion | None) -> None:
            if self.model_view.path != path:
                return  # another model was picked meanwhile
            choice = LoadChoice.REPLACE if question is None else self.ask_load(question)
            if choice is None:
                return
            self.library.remember_settings(path, wanted)
            self.library.mark_used(path)
            self._save_library()
            if choice is LoadChoice.REPLACE:
                self.apply_settings(spec.settings.remembered_in(self.settings).replace(model=path))
                self.bridge.load(spec, on_error=self._on_load_error,
                                 on_done=lambda _snapshot: self._chat_with(spec.name, tab))
            else:
                entry = pool_config.ModelEntry.for_file(path, settings=wanted)
                self.bridge.add_model(entry, on_error=lambda message: self.show_message(
                    f"{entry.name} did not load: {message}"),
                    default=choice is LoadChoice.BESIDE_AS_DEFAULT,
                    on_done=lambda _snapshot: self._chat_with(entry.name, tab))
            self.refresh_library(select=path)

        self.bridge.load_question(spec.name, spec.chat_template.takes_chats, on_done=asked)

    def ask_load(self, question: LoadQuestion) -> LoadChoice | None:
        """The owner's answer to `question` (None: cancelled)."""
        dialog = LoadDialog(question, self)
        return dialog.choice() if dialog.exec() == LoadDialog.DialogCode.Accepted else None

    def unload_selected(self) -> None:
        """Stop serving the selected model; for the default model while others serve, ask
        first which one `default` names from now on."""
        state = self.bridge.pool_state
        name = state.model_of_file(self.model_view.path)
        status = state.model(name) if name is not None else None
        if name is not None and status is not None and not status.default:
            self.bridge.remove_model(name)
            return

        def asked(question: UnloadQuestion | None) -> None:
            if question is None:
                self.bridge.unload()
                return
            answer = self.ask_unload(question)
            if answer is not None:
                self.bridge.unload(new_default=answer[0])

        self.bridge.unload_question(on_done=asked)

    def ask_unload(self, question: UnloadQuestion) -> tuple[str | None] | None:
        """(the model `default` names from now on, or None) or None when cancelled."""
        dialog = UnloadDialog(question, self)
        return (dialog.new_default(),) if dialog.exec() == UnloadDialog.DialogCode.Accepted else None

    def _chat_with(self, name: str, tab: int) -> None:
        """After a load: the Chat tab, with the model loaded chosen (unless the person
        went to another tab meanwhile: they are doing something else there), ready to type."""
        self.chat.choose(name)
        if self.tabs.currentIndex() == tab:
            self.tabs.setCurrentIndex(CHAT_TAB)
            self.chat.input.setFocus()

    def add_selected(self) -> None:
        """Serve the selected model beside the others, with the settings shown."""
        path, info = self.model_view.path, self.model_view.info
        if path is None or info is None:
            return
        try:
            wanted = self.model_view.load_settings()
            wanted.to_spec(path, own_template=info.has_chat_template)  # refuses owned flags
        except SettingsError as exc:
            self.model_view.show_settings_error(str(exc))
            return
        self.model_view.show_settings_error("")
        self.library.remember_settings(path, wanted)
        self.library.mark_used(path)
        self._save_library()
        entry = pool_config.ModelEntry.for_file(path, settings=wanted)
        self.bridge.add_model(entry, on_error=lambda message: self.show_message(
            f"{entry.name} did not load: {message}"))
        self.tabs.setCurrentIndex(POOL_TAB)
        self.refresh_library(select=path)

    def _on_load_error(self, message: str) -> None:
        if self.bridge.snapshot.state is not State.FAILED:
            # Failed before there was anything to supervise (no engine, for instance).
            self.model_view.show_load_failed(message)
        self.show_message(message)
        if self.bridge.engine_status(self.settings.llama_server).chosen is None:
            self.refresh_engine()
            self.tabs.setCurrentIndex(ENGINE_TAB)

    def _show_account(self) -> None:
        """Under the selected model's heading: its own engine's account, not the default
        model's."""
        state = self.bridge.pool_state
        name = state.model_of_file(self.model_view.path)
        status = state.model(name) if name is not None else None
        snapshot = self.bridge.model_snapshots.get(name) if name is not None else None
        serving = [m.name for m in state.models
                   if m.residency is Residency.READY and m.name != name]
        self.model_view.show_account(
            model_account(snapshot, status, serving=serving,
                          parking=self.bridge.parking_notes.get(name or "", "")),
            cpu_retry=snapshot is not None and snapshot.state is State.FAILED
            and snapshot.cpu_retry_offered)

    def _on_snapshot(self, snapshot: Snapshot) -> None:
        serving = snapshot.serving
        self.sharing.set_model(snapshot.model_id, serving.context_length if serving else None)
        self.status_state.setText(describe_state(snapshot))

    # --- sharing ------------------------------------------------------------------------------

    def show_sharing(self, keys: bool = False) -> None:
        """The Sharing tab (at its named keys when `keys`)."""
        self.tabs.setCurrentIndex(SHARING_TAB)
        if keys:
            self.sharing.show_keys()

    # --- activity -------------------------------------------------------------------------------

    def _on_sample(self, sample: ActivitySample) -> None:
        self._in_flight = sample.in_flight
        self.activity.add_sample(sample)
        if self.tabs.currentWidget() is self.sessions:
            self.refresh_sessions()

    def refresh_sessions(self) -> None:
        """The Sessions tab, from rows the backend makes on its loop (where the session
        table lives); shown when they come back."""
        self.bridge.session_rows(on_done=self.sessions.show_sessions)

    @property
    def requests_in_flight(self) -> int:
        return self._in_flight

    # --- engine ---------------------------------------------------------------------------------

    def refresh_engine(self) -> None:
        self.engine.set_resolution(self.bridge.engine_status(self.settings.llama_server), self.bridge.building)
        self.bridge.accelerators(on_done=self._show_accelerators)

    def _show_accelerators(self, found: Accelerators) -> None:
        self.engine.set_accelerators(found)
        # Now that the GPUs are known, the engine a load would use may be a GPU one.
        self.engine.set_resolution(self.bridge.engine_status(self.settings.llama_server), self.bridge.building)

    def build_engine(self) -> None:
        self.tabs.setCurrentIndex(ENGINE_TAB)
        self.bridge.build_engine(backend=self.engine.backend_to_build)
        self.refresh_engine()

    def choose_binary(self, path: str) -> None:
        self.apply_settings(self.settings.replace(llama_server=path))
        self.refresh_engine()

    def _on_build_finished(self, result: object) -> None:
        self.engine.show_finished(result)
        self.refresh_engine()

    # --- closing --------------------------------------------------------------------------------

    def closeEvent(self, event: QCloseEvent) -> None:
        # Asked live: the last activity sample may be half a second old.  Teammates who
        # used the port lately are named too: their agents lose it with the window.
        question = self.bridge.quit_question()
        if question is None:
            n = self.bridge.requests_in_flight()
            n = self._in_flight if n is None else n
            if n:
                question = (f"{n} request{'s are' if n != 1 else ' is'} still running or "
                            "waiting. Closing GGUF Studio stops the model and ends them.")
        if question and not self.ask("Stop serving?", question):
            event.ignore()
            return
        self.save_state()
        event.accept()

    def shutdown(self) -> None:
        """Stop the engine and the port; the window may stay on screen meanwhile."""
        self.chat_link.close()
        self.bridge.shutdown()

    # --- helpers ------------------------------------------------------------------------------

    def ask(self, title: str, text: str) -> bool:
        answer = QMessageBox.question(self, title, text,
                                      QMessageBox.StandardButton.Yes | QMessageBox.StandardButton.No,
                                      QMessageBox.StandardButton.No)
        return answer == QMessageBox.StandardButton.Yes

    def show_message(self, message: str) -> None:
        self.statusBar().showMessage(message, 15_000)

    def _save_library(self) -> None:
        self.bridge.save_library(self.library, on_error=lambda message: self.show_message(
            f"The model library could not be saved: {message}"))

    def _restore_state(self) -> None:
        # The model pane as tall as it needs; the tabs below take the rest.
        self.right_splitter.setSizes([self.model_view.sizeHint().height(), 10_000])
        if self._state is None:
            self.resize(1240, 860)
            return
        geometry = self._state.value("geometry")
        if isinstance(geometry, QByteArray) and not geometry.isEmpty():
            self.restoreGeometry(geometry)
        else:
            self.resize(1240, 860)
        for splitter in self._splitters():
            saved = self._state.value(splitter.objectName())
            if isinstance(saved, QByteArray):
                splitter.restoreState(saved)
        tab = self._state.value("tab")
        for index in range(self.tabs.count()):
            page = self.tabs.widget(index)
            if page is not None and page.objectName() == tab:
                self.tabs.setCurrentIndex(index)
        self.logs.follow.setChecked(self._state.value("follow_logs", "true") in (True, "true"))

    def _splitters(self) -> list[QSplitter]:
        """Every splitter of the window's, each remembered under its object name."""
        return [s for s in self.findChildren(QSplitter) if s.objectName()]

    def save_state(self) -> None:
        if self._state is None:
            return
        self._state.setValue("geometry", self.saveGeometry())
        for splitter in self._splitters():
            self._state.setValue(splitter.objectName(), splitter.saveState())
        current = self.tabs.currentWidget()
        self._state.setValue("tab", current.objectName() if current is not None else "")
        self._state.setValue("follow_logs", "true" if self.logs.follow.isChecked() else "false")
        self._state.sync()


def _scrolling(widget: QWidget) -> QScrollArea:
    area = QScrollArea()
    area.setWidget(widget)
    area.setWidgetResizable(True)
    area.setFrameShape(QScrollArea.Shape.NoFrame)
    return area
