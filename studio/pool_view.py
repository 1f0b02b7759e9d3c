"""The models the port serves, side by side, and the engines elsewhere it serves through.

Renders a `PoolState` and emits what the user asks for; what a cell says is the
backend's (`backend.app.pool.pool_state`).  Rows are updated in place, so a pin box or an
idle TTL being edited is not replaced under the user's hands by the next picture.
"""

from __future__ import annotations

from typing import Callable, TypeVar

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QIcon
from PySide6.QtWidgets import (
    QAbstractItemView,
    QCheckBox,
    QComboBox,
    QGroupBox,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QLineEdit,
    QPushButton,
    QSpinBox,
    QStyle,
    QTableWidget,
    QTableWidgetItem,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from backend.app.pool.pool_status import ModelStatus, UpstreamStatus
from backend.app.pool.pool_state import (PoolState, describe_health, describe_kv, describe_requests,
                                    describe_slots, describe_where, model_actions)
from backend.port.metrics import ModelTotals
from backend.url_credentials import hide_url_credentials

from studio.widgets import plain_tooltip, secondary_label

__all__ = ["ModelRow", "PoolView", "UpstreamRow"]

MODEL_COLUMNS = ("Model", "Runs on", "State", "Slots busy", "KV in use", "Requests", "Pinned",
                 "Idle TTL", "Last decision", "")
UPSTREAM_COLUMNS = ("Engine", "Address", "Health", "Models", "Slots busy", "KV in use", "Note", "")
KV_LAYOUTS = (("Not stated (assumed safe)", ""), ("Split (each slot its own)", "split"),
              ("Unified (one shared pool)", "unified"))
MAX_TTL = 7 * 24 * 3600

Row = TypeVar("Row")


class PoolView(QWidget):
    load_requested = Signal(str)  # model
    unload_requested = Signal(str)
    remove_requested = Signal(str)
    pinned_changed = Signal(str, bool)
    idle_ttl_changed = Signal(str, int)  # seconds; 0: never
    upstream_added = Signal(str, str, str)  # url, key, layout ("", "split", "unified")
    upstream_removed = Signal(str)  # url

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.state = PoolState()
        self.model_rows: dict[str, ModelRow] = {}
        self.upstream_rows: dict[str, UpstreamRow] = {}

        self.models = _table(MODEL_COLUMNS, "Models in the pool")
        self.models_empty = secondary_label(
            "No model yet. Load one, or pick one on the left and press \"Add beside\" to serve "
            "it next to the others.")
        # Each model's last decision in full below the table (a cell cut them off).
        self.decisions = secondary_label("")
        self.decisions.setAccessibleName("Last decisions")
        self.decisions.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        models_box = QGroupBox("Models")
        models_layout = QVBoxLayout(models_box)
        models_layout.addWidget(self.models)
        models_layout.addWidget(self.models_empty)
        models_layout.addWidget(self.decisions)

        self.url = QLineEdit()
        self.url.setPlaceholderText("http://192.168.1.20:8080")
        self.url.setAccessibleName("Upstream address")
        self.key = QLineEdit()
        self.key.setEchoMode(QLineEdit.EchoMode.Password)
        self.key.setPlaceholderText("its API key, if it needs one")
        self.key.setAccessibleName("Upstream API key")
        self.layout_box = QComboBox()
        self.layout_box.setAccessibleName("Upstream KV layout")
        layout_label = QLabel("KV &layout:")
        layout_label.setBuddy(self.layout_box)
        for label, value in KV_LAYOUTS:
            self.layout_box.addItem(label, value)
        self.layout_box.setToolTip(
            "How a plain llama-server's KV cache is laid out (its /props cannot tell): split "
            "is its default with -np N, unified is --kv-unified. Not stated assumes one shared "
            "pool of one slot's context, which is safe but may hold requests back. A GGUF "
            "Studio port says it itself.")
        self.add_upstream_button = QPushButton("Add engine")
        self.add_upstream_button.setAccessibleName("Add engine elsewhere")
        self.add_upstream_button.clicked.connect(self._add_upstream)
        self.url.returnPressed.connect(self._add_upstream)
        self.upstream_problem = QLabel()
        self.upstream_problem.setWordWrap(True)
        self.upstream_problem.setAccessibleName("Upstream problem")
        self.upstream_problem.hide()
        form = QHBoxLayout()
        form.addWidget(QLabel("Address:"))
        form.addWidget(self.url, 3)
        form.addWidget(QLabel("Key:"))
        form.addWidget(self.key, 2)
        form.addWidget(layout_label)
        form.addWidget(self.layout_box)
        form.addWidget(self.add_upstream_button)
        self.upstreams = _table(UPSTREAM_COLUMNS, "Engines elsewhere")
        upstreams_box = QGroupBox("Engines elsewhere (a llama-server or another GGUF Studio port)")
        upstreams_layout = QVBoxLayout(upstreams_box)
        upstreams_layout.addLayout(form)
        upstreams_layout.addWidget(self.upstream_problem)
        upstreams_layout.addWidget(self.upstreams)

        layout = QVBoxLayout(self)
        layout.addWidget(models_box, 3)
        layout.addWidget(upstreams_box, 2)
        self.set_state(self.state)

    # --- render -------------------------------------------------------------------------

    def set_state(self, state: PoolState) -> None:
        self.state = state
        names = [m.name for m in state.models]
        if names != list(self.model_rows):
            self.model_rows = _rebuild(self.models, names,
                                       lambda row, name: ModelRow(self, row, name))
        for row, status in zip(self.model_rows.values(), state.models):
            row.show(status, state.requests.get(status.name))
        self.models_empty.setVisible(not names)
        # Per model, in full: its requests as every tab words them, its last decision.
        told = [f"{m.name}: {describe_requests(state.requests.get(m.name))} requests since "
                f"start" + (f"; last decision: {m.decision}" if m.decision else "")
                for m in state.models]
        self.decisions.setText("\n".join(told))
        self.decisions.setVisible(bool(told))
        # Where each model runs says something only once an engine elsewhere serves one.
        self.models.setColumnHidden(MODEL_COLUMNS.index("Runs on"),
                                    all(m.local for m in state.models))
        urls = [u.url for u in state.upstreams]
        if urls != list(self.upstream_rows):
            self.upstream_rows = _rebuild(self.upstreams, urls,
                                          lambda row, url: UpstreamRow(self, row, url))
        for upstream_row, upstream in zip(self.upstream_rows.values(), state.upstreams):
            upstream_row.show(upstream)
        self.upstreams.setVisible(bool(urls))

    def show_upstream_problem(self, message: str) -> None:
        self.upstream_problem.setText(message)
        self.upstream_problem.setVisible(bool(message))

    def upstream_added_ok(self) -> None:
        """The engine joined the pool's watch: the form is ready for the next one."""
        self.url.clear()
        self.key.clear()
        self.show_upstream_problem("")

    # --- intent -------------------------------------------------------------------------

    def _add_upstream(self) -> None:
        url = self.url.text().strip()
        if not url:
            self.show_upstream_problem("Type the engine's address, like http://host:8080.")
            return
        self.upstream_added.emit(url, self.key.text(), str(self.layout_box.currentData()))


class ModelRow:
    """One model's row: text cells, a pin box, an idle TTL and its buttons."""

    def __init__(self, view: PoolView, row: int, name: str) -> None:
        self.name = name
        table = view.models
        self.cells = [QTableWidgetItem() for _ in range(len(MODEL_COLUMNS))]
        for column, cell in enumerate(self.cells):
            table.setItem(row, column, cell)
        self.pinned = QCheckBox()
        self.pinned.setAccessibleName(f"Pin {name}")
        self.pinned.setToolTip("A pinned model is never unloaded, neither to make room nor for "
                               "idleness (pinning drops its idle TTL).")
        self.pinned.toggled.connect(lambda on: view.pinned_changed.emit(name, on))
        self.idle_ttl = QSpinBox()
        self.idle_ttl.setRange(0, MAX_TTL)
        self.idle_ttl.setSingleStep(60)
        self.idle_ttl.setSuffix(" s")
        self.idle_ttl.setSpecialValueText("Never")
        self.idle_ttl.setAccessibleName(f"Idle TTL of {name}")
        self.idle_ttl.setToolTip("Unload the model after this long without requests "
                                 "(it loads again on the next one).")
        self.idle_ttl.setKeyboardTracking(False)
        self.idle_ttl.editingFinished.connect(self._ttl_edited)
        self._view = view
        # Icons, each named on hover and to a screen reader: three words of buttons made
        # the table wider than the window.
        style = view.style()
        self.load = _icon_button(style.standardIcon(QStyle.StandardPixmap.SP_MediaPlay),
                                 f"Load {name}", lambda: view.load_requested.emit(name))
        self.unload = _icon_button(style.standardIcon(QStyle.StandardPixmap.SP_MediaStop),
                                   f"Unload {name} (it loads again on its next request)",
                                   lambda: view.unload_requested.emit(name))
        self.remove = _icon_button(style.standardIcon(QStyle.StandardPixmap.SP_DialogDiscardButton),
                                   f"Remove {name} from the pool",
                                   lambda: view.remove_requested.emit(name))
        actions = QWidget()
        buttons = QHBoxLayout(actions)
        buttons.setContentsMargins(2, 0, 2, 0)
        for button in (self.load, self.unload, self.remove):
            buttons.addWidget(button)
        table.setCellWidget(row, MODEL_COLUMNS.index("Pinned"), _centred(self.pinned))
        table.setCellWidget(row, MODEL_COLUMNS.index("Idle TTL"), _holding(self.idle_ttl))
        table.setCellWidget(row, len(MODEL_COLUMNS) - 1, actions)
        self._ttl_shown = -1

    def show(self, status: ModelStatus, requests: ModelTotals | None = None) -> None:
        name = status.name + (" (default)" if status.default else "")
        # An engine elsewhere keeps its model as its operator says: no pin, TTL or buttons.
        managed_here = "" if status.local else "—"
        counted = f"{requests.answered:,}" if requests is not None else "—"
        texts = (name, describe_where(status.engines), status.residency.value,
                 describe_slots(status.engines), describe_kv(status.engines),
                 counted, managed_here, managed_here, status.decision, "")
        for cell, text in zip(self.cells, texts):
            if cell.text() != text:
                cell.setText(text)
                cell.setToolTip(plain_tooltip(text))
        actions = model_actions(status)
        self.load.setEnabled(actions.load)
        self.unload.setEnabled(actions.unload)
        self.remove.setEnabled(actions.remove)
        # Cell widgets are shown by the table itself: what they hold is hidden instead.
        for widget in (self.pinned, self.idle_ttl, self.load, self.unload, self.remove):
            widget.setVisible(status.local)
        self.pinned.setEnabled(actions.options)
        # A pinned model is never unloaded for idleness: its TTL is "Never" until unpinned.
        self.idle_ttl.setEnabled(actions.options and not status.pinned)
        self.pinned.blockSignals(True)
        self.pinned.setChecked(status.pinned)
        self.pinned.blockSignals(False)
        ttl = int(status.idle_ttl)
        if ttl != self._ttl_shown and not self.idle_ttl.hasFocus():
            self.idle_ttl.blockSignals(True)
            self.idle_ttl.setValue(ttl)
            self.idle_ttl.blockSignals(False)
            self._ttl_shown = ttl

    def _ttl_edited(self) -> None:
        value = self.idle_ttl.value()
        if value != self._ttl_shown:
            self._ttl_shown = value
            self._view.idle_ttl_changed.emit(self.name, value)


class UpstreamRow:
    """One engine elsewhere: its health, models, slots and KV, and a Remove button."""

    def __init__(self, view: PoolView, row: int, url: str) -> None:
        self.url = url
        table = view.upstreams
        self.cells = [QTableWidgetItem() for _ in range(len(UPSTREAM_COLUMNS))]
        for column, cell in enumerate(self.cells):
            table.setItem(row, column, cell)
        self.remove = _small_button("Remove", f"Remove the engine at {url}",
                                    lambda: view.upstream_removed.emit(url))
        table.setCellWidget(row, len(UPSTREAM_COLUMNS) - 1, self.remove)

    def show(self, upstream: UpstreamStatus) -> None:
        engine = upstream.engine
        texts = (engine.where, hide_url_credentials(upstream.url), describe_health(upstream),
                 ", ".join(upstream.models) or "—", describe_slots(engine), describe_kv(engine),
                 engine.note or "", "")
        for cell, text in zip(self.cells, texts):
            if cell.text() != text:
                cell.setText(text)
                cell.setToolTip(plain_tooltip(text))


def _rebuild(table: QTableWidget, keys: list[str], make: Callable[[int, str], Row]
             ) -> dict[str, Row]:
    """The table again, one row per key (the set or the order changed)."""
    table.setRowCount(0)
    table.setRowCount(len(keys))
    return {key: make(row, key) for row, key in enumerate(keys)}


def _table(columns: tuple[str, ...], name: str) -> QTableWidget:
    table = QTableWidget(0, len(columns))
    table.setHorizontalHeaderLabels(list(columns))
    table.setAccessibleName(name)
    table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
    table.setSelectionMode(QAbstractItemView.SelectionMode.NoSelection)
    table.verticalHeader().hide()
    header = table.horizontalHeader()
    header.setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
    header.setStretchLastSection(False)
    # The name takes what is left, elided in its middle; a model's last decision is said
    # in full below the table, not in a cell cut off at the window's edge.
    stretch = columns.index("Model") if "Model" in columns else columns.index("Note")
    header.setSectionResizeMode(stretch, QHeaderView.ResizeMode.Stretch)
    if "Last decision" in columns:
        table.setColumnHidden(columns.index("Last decision"), True)
    table.setTextElideMode(Qt.TextElideMode.ElideMiddle)
    table.setWordWrap(False)
    return table


def _icon_button(icon: QIcon, accessible: str, clicked: Callable[[], None]) -> QToolButton:
    button = QToolButton()
    button.setIcon(icon)
    button.setAutoRaise(True)
    button.setAccessibleName(accessible)
    button.setToolTip(plain_tooltip(accessible))
    button.clicked.connect(lambda _=False: clicked())
    return button


def _small_button(text: str, accessible: str, clicked: Callable[[], None]) -> QPushButton:
    button = QPushButton(text)
    button.setAccessibleName(accessible)
    button.setToolTip(plain_tooltip(accessible))
    button.clicked.connect(lambda _=False: clicked())
    return button


def _centred(widget: QWidget) -> QWidget:
    return _holding(widget, Qt.AlignmentFlag.AlignCenter)


def _holding(widget: QWidget, alignment: Qt.AlignmentFlag | None = None) -> QWidget:
    """`widget` in a plain cell widget, so that it can be hidden (the table shows the
    cell widgets it holds)."""
    holder = QWidget()
    layout = QHBoxLayout(holder)
    layout.setContentsMargins(0, 0, 0, 0)
    if alignment is not None:
        layout.setAlignment(alignment)
    layout.addWidget(widget)
    return holder
