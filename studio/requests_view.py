"""The Requests tab: the port's recent requests, as its inspector keeps them, live.

Thin: it shows the records it is given (`add_records`), filtered by key, model and
status, and a row's details below the table; while shown it asks once a second for the
records after the last one it has (`refresh_wanted`), which the window forwards to the
backend (`backend.port.request_log`), and says in a line what the requests under way
do (`show_under_way`: a long prompt being read, and the time left).
"""

from __future__ import annotations

import time

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtGui import QHideEvent, QShowEvent
from PySide6.QtWidgets import (
    QComboBox,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QPlainTextEdit,
    QSplitter,
    QTreeWidget,
    QTreeWidgetItem,
    QVBoxLayout,
    QWidget,
)

from backend.app.session_rows import session_label
from backend.port.access_log import status_words
from backend.port.request_log import RequestRecord
from studio.widgets import monospace_font

__all__ = ["COLUMNS", "RequestsView", "under_way_text"]

#: Rows kept in the table (the oldest go first).
MAX_ROWS = 2000
#: Milliseconds between two asks for new records while the tab is shown.
REFRESH_MS = 1000
#: What fits the default window without scrolling sideways; the rest is in the details.
COLUMNS = ("Time", "Key", "Model", "Status", "Waited", "Prompt (cached)", "Output",
           "First token", "Tokens/s")
#: A typical cell of each column, for its width.
_TYPICAL = ("00:00:00", "teammate", "", "499 stopped", "0.80 s slots full", "12,345 (12,000)",
            "1,234", "850 ms", "123.4")
ALL = "All"
STATUSES = (ALL, "Answered", "Errors", "Waited")
#: The details pane's lines: a record field and how it is called.
_DETAILS = (("time", "Arrived"), ("route", "Route"), ("key", "Key"), ("session", "Session"),
            ("model", "Model"), ("engine", "Engine"), ("slot", "Slot"), ("band", "Band"),
            ("stream", "Streamed"), ("wait", "Waited"), ("wait_reason", "Why it waited"),
            ("waited_behind", "Behind key"), ("prompt_tokens", "Prompt tokens"),
            ("cached_tokens", "Cached by the engine"), ("computed_tokens", "Computed"),
            ("cache_miss", "Why the cache missed"), ("output_tokens", "Output tokens"),
            ("prefill_ms", "Prefill"), ("time_to_first_token", "Time to first token"),
            ("tokens_per_second", "Tokens per second"), ("longest_gap", "Longest gap"),
            ("status", "Status"), ("error", "Error"), ("prefilled", "Prompt read"),
            ("joined", "Resent, joined"))
_REASONS = {"slots_full": "slots full", "kv_full": "KV cache full",
            "key_concurrency": "key's concurrency", "fair_share": "fair share",
            "model_loading": "model loading", "prefill_budget": "prefill budget",
            "session_engine": "session's engine", "slot_seating": "a turn being seated"}


class RequestsView(QWidget):
    #: The id of the newest record shown: the window answers with the newer ones.
    refresh_wanted = Signal(int)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self._last_id = 0
        self._records: dict[int, RequestRecord] = {}

        self.key_filter = _filter_box("Filter by key")
        self.model_filter = _filter_box("Filter by model")
        self.status_filter = QComboBox()
        self.status_filter.setAccessibleName("Filter by status")
        self.status_filter.addItems(STATUSES)
        for box in (self.key_filter, self.model_filter, self.status_filter):
            box.currentIndexChanged.connect(self._refilter)
        self.count = QLabel()
        #: The requests under way, in one line (`show_under_way`).
        self.under_way = QLabel()
        self.under_way.setAccessibleName("Requests under way")

        self.table = QTreeWidget()
        self.table.setColumnCount(len(COLUMNS))
        self.table.setHeaderLabels(list(COLUMNS))
        self.table.setRootIsDecorated(False)
        self.table.setUniformRowHeights(True)
        self.table.setAlternatingRowColors(True)
        self.table.setAccessibleName("Recent requests")
        # Widths from typical cells, not from every row (2,000 rows measured on each new
        # one would cost the window its smoothness); the model's name takes what is left,
        # elided in its middle: the table fits the window.
        header = self.table.header()
        header.setStretchLastSection(False)
        header.setSectionResizeMode(QHeaderView.ResizeMode.Interactive)
        metrics = self.table.fontMetrics()
        for column, sample in enumerate(_TYPICAL):
            width = max(metrics.horizontalAdvance(sample), metrics.horizontalAdvance(COLUMNS[column]))
            header.resizeSection(column, width + 18)
        header.setSectionResizeMode(COLUMNS.index("Model"), QHeaderView.ResizeMode.Stretch)
        self.table.setTextElideMode(Qt.TextElideMode.ElideMiddle)
        self.table.currentItemChanged.connect(lambda item, _old: self._show_details(item))
        self.table.itemActivated.connect(lambda item, _column: self._show_details(item))

        self.details = QPlainTextEdit()
        self.details.setReadOnly(True)
        self.details.setFont(monospace_font())
        self.details.setAccessibleName("Request details")
        self.details.setPlaceholderText("Select a request to see its details.")
        self.details.setTabChangesFocus(True)
        self.details.setMinimumHeight(self.details.fontMetrics().lineSpacing() * 13)

        bar = QHBoxLayout()
        for label, box in (("&Key", self.key_filter), ("Mo&del", self.model_filter),
                           ("S&tatus", self.status_filter)):
            text = QLabel(label)
            text.setBuddy(box)
            bar.addWidget(text)
            bar.addWidget(box)
        bar.addStretch(1)
        bar.addWidget(self.under_way)
        bar.addWidget(self.count)
        self.split = QSplitter(Qt.Orientation.Vertical)
        self.split.setObjectName("requests_split")  # the window remembers its place
        self.split.addWidget(self.table)
        self.split.addWidget(self.details)
        self.split.setStretchFactor(0, 3)
        self.split.setStretchFactor(1, 1)
        layout = QVBoxLayout(self)
        layout.addLayout(bar)
        layout.addWidget(self.split, 1)

        self._timer = QTimer(self)
        self._timer.setInterval(REFRESH_MS)
        self._timer.timeout.connect(lambda: self.refresh_wanted.emit(self._last_id))
        self._update_count()

    @property
    def last_id(self) -> int:
        return self._last_id

    def add_records(self, records: list[RequestRecord]) -> None:
        """Show these records (newer than the last shown), newest on top."""
        for record in records:
            if record.id <= self._last_id:
                continue
            self._last_id = record.id
            self._records[record.id] = record
            item = _row(record)
            self.table.insertTopLevelItem(0, item)
            _add_choice(self.key_filter, record.key)
            _add_choice(self.model_filter, record.model)
            item.setHidden(not self._passes(record))
        while self.table.topLevelItemCount() > MAX_ROWS:
            old = self.table.takeTopLevelItem(self.table.topLevelItemCount() - 1)
            if old is not None:
                self._records.pop(old.data(0, Qt.ItemDataRole.UserRole), None)
        self._update_count()

    def show_under_way(self, records: list[RequestRecord]) -> None:
        """Say what the requests under way (`RequestLog.under_way`) are doing."""
        self.under_way.setText(under_way_text(records))

    def record_of(self, item: QTreeWidgetItem) -> RequestRecord | None:
        return self._records.get(item.data(0, Qt.ItemDataRole.UserRole))

    def showEvent(self, event: QShowEvent) -> None:
        super().showEvent(event)
        self.refresh_wanted.emit(self._last_id)
        self._timer.start()

    def hideEvent(self, event: QHideEvent) -> None:
        self._timer.stop()
        super().hideEvent(event)

    # --- helpers ------------------------------------------------------------------------

    def _passes(self, record: RequestRecord) -> bool:
        key = self.key_filter.currentText()
        model = self.model_filter.currentText()
        status = self.status_filter.currentText()
        if key != ALL and record.key != key:
            return False
        if model != ALL and record.model != model:
            return False
        failed = record.error is not None or record.status >= 400
        return (status == ALL or (status == "Answered" and not failed)
                or (status == "Errors" and failed)
                or (status == "Waited" and record.wait_reason is not None))

    def _refilter(self) -> None:
        for item in self._items():
            record = self.record_of(item)
            item.setHidden(record is None or not self._passes(record))
        self._update_count()

    def _items(self) -> list[QTreeWidgetItem]:
        table = self.table
        return [item for i in range(table.topLevelItemCount())
                if (item := table.topLevelItem(i)) is not None]

    def _update_count(self) -> None:
        items = self._items()
        shown = sum(not item.isHidden() for item in items)
        self.count.setText(f"{shown} of {len(items)} requests")

    def _show_details(self, item: QTreeWidgetItem | None) -> None:
        record = None if item is None else self.record_of(item)
        if record is None:
            self.details.clear()
            return
        entries = [f"{label + ':':<22}{_detail(name, getattr(record, name))}"
                   for name, label in _DETAILS if getattr(record, name) is not None]
        # Two columns: who and where on the left, what it cost on the right.
        half = (len(entries) + 1) // 2
        left, right = entries[:half], entries[half:]
        width = max(len(entry) for entry in left) + 4
        self.details.setPlainText("\n".join(
            f"{a:<{width}}{b}".rstrip() for a, b in zip(left, right + [""] * (half - len(right)))))


def under_way_text(records: list[RequestRecord]) -> str:
    """"2 under way; reading a prompt: 2,048 of 6,000 tokens, about 40 s left" (the
    longest prompt being read), or nothing when none is."""
    if not records:
        return ""
    text = f"{len(records)} under way"
    reading = [r for r in records if r.prefill_eta is not None and r.prefilled is not None
               and r.prompt_tokens]
    if reading:
        longest = max(reading, key=lambda r: r.prefill_eta or 0.0)
        text += (f"; reading a prompt: {longest.prefilled:,} of {longest.prompt_tokens:,} "
                 f"tokens, about {longest.prefill_eta:.0f} s left")
    return text


def _filter_box(name: str) -> QComboBox:
    box = QComboBox()
    box.setAccessibleName(name)
    box.addItem(ALL)
    box.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToContents)
    return box


def _add_choice(box: QComboBox, value: str | None) -> None:
    if value and box.findText(value) < 0:
        box.addItem(value)


def _row(record: RequestRecord) -> QTreeWidgetItem:
    item = QTreeWidgetItem([
        time.strftime("%H:%M:%S", time.localtime(record.time)), record.key, record.model or "",
        _status(record), _waited(record), _prompt(record), _number(record.output_tokens),
        _seconds(record.time_to_first_token),
        "" if record.tokens_per_second is None else f"{record.tokens_per_second:.1f}"])
    item.setData(0, Qt.ItemDataRole.UserRole, record.id)
    for column in range(COLUMNS.index("Prompt (cached)"), len(COLUMNS)):
        item.setTextAlignment(column, Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
    return item


def _status(record: RequestRecord) -> str:
    """"200", "499 stopped by the client", "429 rate_limit_exceeded"."""
    words = status_words(record.status)
    return " ".join(part for part in (str(record.status), words, record.error or "") if part)


def _waited(record: RequestRecord) -> str:
    """"0.8 s slots full": how long and why, or nothing when it did not wait."""
    if record.wait_reason is None:
        return _seconds(record.wait) if record.wait >= 0.01 else ""
    reason = _REASONS.get(record.wait_reason, record.wait_reason)
    if record.waited_behind:
        reason += f" (behind {record.waited_behind})"
    return f"{_seconds(record.wait)} {reason}"


def _prompt(record: RequestRecord) -> str:
    if record.prompt_tokens is None:
        return ""
    if not record.cached_tokens:
        return f"{record.prompt_tokens:,}"
    return f"{record.prompt_tokens:,} ({record.cached_tokens:,})"


def _detail(name: str, value: object) -> str:
    if name == "time" and isinstance(value, float):
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(value))
    if name in ("wait", "time_to_first_token", "longest_gap") and isinstance(value, float):
        return _seconds(value)
    if name == "prefill_ms" and isinstance(value, float):
        return f"{value:.0f} ms"
    if name == "tokens_per_second" and isinstance(value, float):
        return f"{value:.1f}"
    if name == "wait_reason" and isinstance(value, str):
        return _REASONS.get(value, value)
    if name == "stream":
        return "yes" if value else "no"
    if name == "session" and isinstance(value, str):
        return session_label(value)
    if name == "status" and isinstance(value, int) and status_words(value):
        return f"{value} — {status_words(value)}"
    return str(value)


def _number(value: int | None) -> str:
    return "" if value is None else str(value)


def _seconds(value: float | None) -> str:
    if value is None:
        return ""
    if value < 0.01:
        return f"{value * 1000:.1f} ms"
    return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.2f} s"
