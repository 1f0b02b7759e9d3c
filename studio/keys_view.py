"""Named API keys in the Sharing tab: the keys with their limits and usage, Create, Edit
and Revoke, a new key's secret shown once with its client set-up, and a chart of usage
over time.  What the form means, what a row says and what the chart sums are
backend.app.sharing.key_table's; this module shows them and says what the person asked for."""

from __future__ import annotations

from typing import Callable

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtGui import QHideEvent, QPalette, QShowEvent
from PySide6.QtWidgets import (
    QAbstractItemView,
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QDoubleSpinBox,
    QFormLayout,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QLineEdit,
    QMessageBox,
    QPlainTextEdit,
    QPushButton,
    QSpinBox,
    QTableWidget,
    QTableWidgetItem,
    QTabWidget,
    QVBoxLayout,
    QWidget,
)

from backend.app.sharing.key_table import (
    CHART_SPANS,
    COLUMNS,
    KeyForm,
    KeyRow,
    KeyTable,
    WEIGHT_STEP,
    describe_key,
    first_key_warning,
    key_target,
)
from backend.app.sharing.snippets import (ClientTarget, Snippet, claude_code_snippet,
                                          codex_snippet, opencode_snippet)
from backend.errors import KeyStoreError
from backend.keys.key_store import KeyRecord, Priority

from studio.activity_view import describe_rejections
from studio.key_usage_chart import KeyUsageChart
from studio.widgets import CopyButton, monospace_font, secondary_label

__all__ = ["KeyDialog", "KeysView", "SecretDialog"]

#: How often the table and the chart are asked for while they are on screen.
REFRESH_INTERVAL_MS = 1000
_STATE_COLUMN = COLUMNS.index("State")
#: The columns the Sharing tab shows.
GLANCE_COLUMNS = ("Name", "Models", "State", "Requests", "Refused", "Last used")
_REFUSED_COLUMN = COLUMNS.index("Refused")


class KeysView(QWidget):
    create_requested = Signal(str, dict)  # name, KeyStore.add's settings
    edit_requested = Signal(str, dict)  # name, KeyStore.edit's changes
    revoke_requested = Signal(str)  # name
    refresh_requested = Signal(object, int)  # the chart's key (None: every key), span in minutes
    named_keys_changed = Signal(int)  # how many named keys there are (revoked ones too)

    def __init__(self, client_target: Callable[[], ClientTarget],
                 parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self._client_target = client_target
        self.table_shown: KeyTable | None = None
        self.dialog: KeyDialog | None = None
        self.secret_dialog: SecretDialog | None = None
        self._named_keys = -1

        self.hint = secondary_label(
            "A key for each person or agent, with its own models, limits and share of the "
            "model; its secret is shown once, when it is made.")
        self.problem = QLabel()
        self.problem.setWordWrap(True)
        self.problem.setAccessibleName("Keys problem")
        self.problem.hide()
        self.table = QTableWidget(0, len(COLUMNS))
        self.table.setHorizontalHeaderLabels(list(COLUMNS))
        self.table.setAccessibleName("Named API keys")
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.table.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        self.table.verticalHeader().hide()
        self.table.horizontalHeader().setSectionResizeMode(
            QHeaderView.ResizeMode.ResizeToContents)
        self.table.setMinimumHeight(140)
        # At a glance: who, in what state, how much; the limits are the row's hover and
        # its Edit dialog (all the columns are still the table's, for copying).
        for column, name in enumerate(COLUMNS):
            self.table.setColumnHidden(column, name not in GLANCE_COLUMNS)
        self.table.horizontalHeader().setStretchLastSection(True)
        self.table.itemSelectionChanged.connect(self._on_selection)
        self.table.itemDoubleClicked.connect(lambda _item: self.edit_selected())

        self.create_button = QPushButton("&Create key…")
        self.create_button.clicked.connect(self.create_key)
        self.edit_button = QPushButton("E&dit…")
        self.edit_button.clicked.connect(self.edit_selected)
        self.revoke_button = QPushButton("Re&voke…")
        self.revoke_button.clicked.connect(self.revoke_selected)
        buttons = QHBoxLayout()
        buttons.addWidget(self.create_button)
        buttons.addWidget(self.edit_button)
        buttons.addWidget(self.revoke_button)
        buttons.addStretch(1)

        self.chart_key = QComboBox()
        self.chart_key.setAccessibleName("Usage of")
        self.chart_key.addItem("All keys", None)
        self.chart_key.currentIndexChanged.connect(lambda _i: self.request_refresh())
        self.chart_span = QComboBox()
        self.chart_span.setAccessibleName("Usage over")
        for minutes, label in CHART_SPANS:
            self.chart_span.addItem(label, minutes)
        self.chart_span.currentIndexChanged.connect(lambda _i: self.request_refresh())
        chart_row = QHBoxLayout()
        chart_row.addWidget(QLabel("Usage of"))
        chart_row.addWidget(self.chart_key)
        chart_row.addWidget(self.chart_span)
        chart_row.addStretch(1)
        self.chart = KeyUsageChart()
        self.chart_summary = secondary_label()

        layout = QVBoxLayout(self)
        layout.addWidget(self.hint)
        layout.addWidget(self.problem)
        layout.addWidget(self.table)
        layout.addLayout(buttons)
        layout.addLayout(chart_row)
        layout.addWidget(self.chart)
        layout.addWidget(self.chart_summary)

        self._timer = QTimer(self)
        self._timer.setInterval(REFRESH_INTERVAL_MS)
        self._timer.timeout.connect(self.request_refresh)
        self._on_selection()

    # --- rendering ------------------------------------------------------------------------

    def show_table(self, table: KeyTable) -> None:
        """The keys, their usage and the chart, as the service has them now."""
        self.table_shown = table
        selected = self.selected_name()
        if self.table.rowCount() != len(table.rows):
            self.table.setRowCount(len(table.rows))
        for index, row in enumerate(table.rows):
            self._show_row(index, row)
        if selected is not None and table.row(selected) is not None:
            self.table.selectRow(next(i for i, r in enumerate(table.rows) if r.name == selected))
        self._show_chart_keys(table.chart_keys)
        if self.chart_key.currentData() == table.chart.key \
                and self.chart_span.currentData() == table.chart.span:
            self.chart.set_chart(table.chart)
            self.chart_summary.setText(table.chart.summary)
        self._on_selection()
        if table.named_keys != self._named_keys:
            self._named_keys = table.named_keys
            self.named_keys_changed.emit(table.named_keys)

    def rows(self) -> list[tuple[str, ...]]:
        """What the table shows, row by row."""
        return [tuple(item.text() if (item := self.table.item(row, column)) is not None else ""
                      for column in range(self.table.columnCount()))
                for row in range(self.table.rowCount())]

    def selected_name(self) -> str | None:
        rows = self.table.selectionModel().selectedRows()
        if not rows or self.table_shown is None or rows[0].row() >= len(self.table_shown.rows):
            return None
        return self.table_shown.rows[rows[0].row()].name

    def select(self, name: str) -> bool:
        """Select the key called `name`; False if the table does not show it (yet)."""
        shown = self.table_shown.rows if self.table_shown is not None else ()
        for index, row in enumerate(shown):
            if row.name == name:
                self.table.selectRow(index)
                return True
        return False

    # --- answers from the service ------------------------------------------------------

    def show_created(self, made: tuple[KeyRecord, str]) -> None:
        """The key was made: its secret, shown this once with the client set-up."""
        record, secret = made
        if self.dialog is not None:
            self.dialog.close()
        self.secret_dialog = SecretDialog(record, secret, key_target(self._client_target(),
                                                                     record, secret), self)
        self.secret_dialog.finished.connect(self._on_secret_closed)
        self.secret_dialog.open()
        self.request_refresh()

    def show_edited(self, _record: KeyRecord) -> None:
        if self.dialog is not None:
            self.dialog.close()
        self.request_refresh()

    def show_dialog_error(self, message: str) -> None:
        """A change the service refused: said in the open dialog (else on the panel)."""
        if self.dialog is not None and self.dialog.isVisible():
            self.dialog.show_error(message)
        else:
            self.problem.setText(message)
            self.problem.show()

    # --- intent ---------------------------------------------------------------------------

    def create_key(self) -> None:
        table = self.table_shown
        warning = first_key_warning(owner_key_set=table.owner_key_set if table else False,
                                    named_keys=table.named_keys if table else 0)
        self._open_dialog(KeyDialog(None, warning, self))

    def edit_selected(self) -> None:
        row = self._selected_row()
        if row is None or not row.editable:
            return
        self._open_dialog(KeyDialog(row.record, "", self))

    def revoke_selected(self) -> None:
        row = self._selected_row()
        if row is None or not row.revocable:
            return
        if self.confirm(f"Revoke the key {row.name!r}?",
                        f"Requests with the key {row.name!r} get 401 from now on, also those "
                        "waiting in line, and its running ones end. A revoked key stays "
                        "revoked: make a new key to let "
                        "its holder back in."):
            self.revoke_requested.emit(row.name)

    def confirm(self, title: str, text: str) -> bool:
        answer = QMessageBox.question(self, title, text,
                                      QMessageBox.StandardButton.Yes | QMessageBox.StandardButton.No,
                                      QMessageBox.StandardButton.No)
        return answer == QMessageBox.StandardButton.Yes

    def request_refresh(self) -> None:
        key = self.chart_key.currentData()
        self.refresh_requested.emit(key, int(self.chart_span.currentData()))

    # --- behaviour ------------------------------------------------------------------------

    def showEvent(self, event: QShowEvent) -> None:
        super().showEvent(event)
        self.request_refresh()
        self._timer.start()

    def hideEvent(self, event: QHideEvent) -> None:
        super().hideEvent(event)
        self._timer.stop()

    def _open_dialog(self, dialog: "KeyDialog") -> None:
        self.problem.hide()
        if self.dialog is not None:
            self.dialog.close()
        self.dialog = dialog
        dialog.submitted.connect(self._on_submitted)
        dialog.finished.connect(lambda _result, d=dialog: self._on_dialog_closed(d))
        dialog.open()

    def _on_submitted(self, form: KeyForm) -> None:
        dialog = self.dialog
        if dialog is None:
            return
        try:
            if dialog.record is None:
                limits = form.limits()
                self.create_requested.emit(form.name.strip(), limits)
                return
            changes = form.changes(dialog.record)
        except KeyStoreError as exc:
            dialog.show_error(str(exc))
            return
        if changes:
            self.edit_requested.emit(dialog.record.name, changes)
        else:
            dialog.close()  # nothing changed

    def _on_dialog_closed(self, dialog: "KeyDialog") -> None:
        if self.dialog is dialog:
            self.dialog = None
        dialog.deleteLater()

    def _on_secret_closed(self) -> None:
        dialog, self.secret_dialog = self.secret_dialog, None
        if dialog is not None:
            dialog.forget()
            dialog.deleteLater()

    def _selected_row(self) -> KeyRow | None:
        name = self.selected_name()
        return self.table_shown.row(name) if name is not None and self.table_shown else None

    def _on_selection(self) -> None:
        row = self._selected_row()
        self.edit_button.setEnabled(row is not None and row.editable)
        self.revoke_button.setEnabled(row is not None and row.revocable)
        if row is not None and row.owner:
            self.edit_button.setToolTip("The owner's key is the one in Access, on the left; it has "
                                        "no limits.")
        else:
            self.edit_button.setToolTip("Change the selected key's models and limits.")

    def _show_row(self, index: int, row: KeyRow) -> None:
        muted = row.state != "active"
        for column, text in enumerate(row.cells):
            item = self.table.item(index, column)
            if item is None:
                item = QTableWidgetItem(text)
                self.table.setItem(index, column, item)
            elif item.text() != text:
                item.setText(text)
            item.setToolTip(describe_rejections(dict(row.refusals))
                            if column == _REFUSED_COLUMN else row.summary)
            if muted or column == _STATE_COLUMN:
                role = QPalette.ColorRole.PlaceholderText if muted else QPalette.ColorRole.Text
                item.setForeground(self.palette().color(role))

    def _show_chart_keys(self, names: tuple[str, ...]) -> None:
        shown = tuple(self.chart_key.itemData(i) for i in range(1, self.chart_key.count()))
        if shown == names:
            return
        current = self.chart_key.currentData()
        self.chart_key.blockSignals(True)
        while self.chart_key.count() > 1:
            self.chart_key.removeItem(1)
        for name in names:
            self.chart_key.addItem(name, name)
        index = self.chart_key.findData(current) if current is not None else 0
        self.chart_key.setCurrentIndex(max(index, 0))
        self.chart_key.blockSignals(False)
        if index < 0:  # the key shown went away: every key
            self.request_refresh()


class KeyDialog(QDialog):
    """The settings of a new key (`record` None) or of one to edit, as `keys add|edit`
    takes them.  Stays open until the view closes it, so that a refusal (a name taken, a
    date past) is said here and the person corrects it."""

    submitted = Signal(object)  # KeyForm

    def __init__(self, record: KeyRecord | None, warning: str = "",
                 parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.record = record
        form = KeyForm.of(record) if record is not None else KeyForm()
        self.setWindowTitle("Create a key" if record is None else f"Edit the key {record.name!r}")

        self.name = QLineEdit(form.name)
        self.name.setAccessibleName("Key name")
        self.name.setPlaceholderText("who or what uses it: alice, ci-bot, laptop@home")
        self.name.setReadOnly(record is not None)
        self.models = QLineEdit(form.models)
        self.models.setAccessibleName("Models")
        self.models.setPlaceholderText("all (or e.g. qwen2.5-coder-7b, llama-3*)")
        self.models.setToolTip("Models the key may use, comma-separated; shell patterns such "
                               "as 'qwen*' allowed. Empty or 'all': every model.")
        self.max_concurrent = _limit_box(10_000, "Requests of this key running at once; more "
                                         "wait. No limit: 0.")
        self.tokens_per_minute = _limit_box(2_000_000_000, "Prompt plus output tokens per "
                                            "minute. No limit: 0.")
        self.tokens_per_day = _limit_box(2_000_000_000, "Prompt plus output tokens in any 24 "
                                         "hours. No limit: 0.")
        self.max_concurrent.setValue(form.max_concurrent)
        self.tokens_per_minute.setValue(form.tokens_per_minute)
        self.tokens_per_day.setValue(form.tokens_per_day)
        self.priority = QComboBox()
        self.priority.setAccessibleName("Priority")
        for band in Priority:
            self.priority.addItem(band.value, band.value)
        self.priority.setCurrentIndex(self.priority.findData(form.priority))
        self.priority.setToolTip("Band: interactive before normal before batch.")
        self.weight = QDoubleSpinBox()
        self.weight.setAccessibleName("Weight")
        self.weight.setRange(WEIGHT_STEP, 1000.0)
        self.weight.setDecimals(2)
        self.weight.setSingleStep(0.25)
        self.weight.setValue(form.weight)
        self.weight.setToolTip("Share of the model against other keys of its band (1).")
        self.expires = QLineEdit(form.expires)
        self.expires.setAccessibleName("Expires")
        self.expires.setPlaceholderText("never, 30d, 12h, 2w, 2026-03-31 or 2026-03-31T18:00")
        self.expires.setToolTip("never; a span from now (30d, 12h, 2w); a day (the key works "
                                "through it, local time); or a local time 2026-03-31T18:00.")
        self.warning = secondary_label(warning)
        self.warning.setVisible(bool(warning))
        self.error = QLabel()
        self.error.setWordWrap(True)
        self.error.setAccessibleName("Key problem")
        self.error.hide()

        self.buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Ok
                                        | QDialogButtonBox.StandardButton.Cancel)
        self.ok_button = self.buttons.button(QDialogButtonBox.StandardButton.Ok)
        self.ok_button.setText("Create" if record is None else "Save")
        self.buttons.accepted.connect(self.submit)
        self.buttons.rejected.connect(self.reject)

        layout = QFormLayout(self)
        layout.addRow("&Name:", self.name)
        layout.addRow("&Models:", self.models)
        layout.addRow("At &once:", self.max_concurrent)
        layout.addRow("Tokens per &minute:", self.tokens_per_minute)
        layout.addRow("Tokens per &day:", self.tokens_per_day)
        layout.addRow("&Priority:", self.priority)
        layout.addRow("&Weight:", self.weight)
        layout.addRow("&Expires:", self.expires)
        layout.addRow(self.warning)
        layout.addRow(self.error)
        layout.addRow(self.buttons)
        self.setMinimumWidth(self.fontMetrics().horizontalAdvance("x") * 72)
        (self.models if record is not None else self.name).setFocus()

    def form(self) -> KeyForm:
        return KeyForm(name=self.name.text(), models=self.models.text(),
                       max_concurrent=self.max_concurrent.value(),
                       tokens_per_minute=self.tokens_per_minute.value(),
                       tokens_per_day=self.tokens_per_day.value(),
                       priority=str(self.priority.currentData()), weight=self.weight.value(),
                       expires=self.expires.text())

    def submit(self) -> None:
        self.show_error("")
        self.submitted.emit(self.form())

    def show_error(self, message: str) -> None:
        self.error.setText(message)
        self.error.setVisible(bool(message))


class SecretDialog(QDialog):
    """A new key's secret, shown this once, with the Codex CLI and OpenCode set-up that
    uses it.  Nothing keeps the secret but this dialog, until it closes (`forget`)."""

    def __init__(self, record: KeyRecord, secret: str, target: ClientTarget,
                 parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle(f"Key {record.name!r} made")
        self._secret = secret
        self._snippets: list[Snippet] = [codex_snippet(target), opencode_snippet(target),
                                         claude_code_snippet(target)]

        notice = QLabel(f"<b>Copy the secret now.</b> This is the only time it is shown: "
                        f"GGUF Studio keeps only a hash of it. Give it to the person or agent "
                        f"as their API key.")
        notice.setTextFormat(Qt.TextFormat.RichText)
        notice.setWordWrap(True)
        self.secret = QLineEdit(secret)
        self.secret.setReadOnly(True)
        self.secret.setFont(monospace_font())
        self.secret.setAccessibleName("Secret of the new key")
        self.secret.setMinimumWidth(self.secret.fontMetrics().horizontalAdvance(secret) + 16)
        self.copy_secret = CopyButton(lambda: self._secret, accessible_name="Copy the secret")
        secret_row = QHBoxLayout()
        secret_row.addWidget(self.secret, 1)
        secret_row.addWidget(self.copy_secret)
        limits = secondary_label(f"{record.name}: {describe_key(record)}.")

        self.snippet_tabs = QTabWidget()
        self.snippet_tabs.setDocumentMode(True)
        self.texts: list[QPlainTextEdit] = []
        self.shells: list[QLineEdit] = []
        for index, snippet in enumerate(self._snippets):
            self.snippet_tabs.addTab(self._snippet_page(index, snippet), snippet.client)

        close = QDialogButtonBox(QDialogButtonBox.StandardButton.Close)
        close.rejected.connect(self.reject)

        layout = QVBoxLayout(self)
        layout.addWidget(notice)
        layout.addLayout(secret_row)
        layout.addWidget(limits)
        layout.addWidget(self.snippet_tabs, 1)
        layout.addWidget(close)
        self.resize(720, 560)

    def snippets(self) -> list[Snippet]:
        """The snippets as they are copied (with the secret, until `forget`)."""
        return list(self._snippets)

    def forget(self) -> None:
        """Drop the secret from every field of the dialog (it is closing)."""
        self._secret = ""
        self._snippets = []
        self.secret.clear()
        for shell in self.shells:
            shell.clear()
        for text in self.texts:
            text.clear()

    def _snippet_page(self, index: int, snippet: Snippet) -> QWidget:
        page = QWidget()
        where = secondary_label(f"Run the first line in the agent's shell, then paste the "
                                f"configuration into {snippet.where}.")
        shell = QLineEdit(snippet.shell)
        shell.setReadOnly(True)
        shell.setFont(monospace_font())
        shell.setAccessibleName(f"{snippet.client} environment line")
        shell.setCursorPosition(0)
        shell_row = QHBoxLayout()
        shell_row.addWidget(shell, 1)
        shell_row.addWidget(CopyButton(
            lambda: self._snippets[index].shell if self._snippets else "",
            accessible_name=f"Copy the {snippet.client} environment line"))
        text = QPlainTextEdit(snippet.text)
        text.setReadOnly(True)
        text.setFont(monospace_font())
        text.setLineWrapMode(QPlainTextEdit.LineWrapMode.NoWrap)
        text.setAccessibleName(f"{snippet.client} configuration")
        text.setTabChangesFocus(True)
        copy = CopyButton(lambda: self._snippets[index].text if self._snippets else "",
                          label="Copy configuration",
                          accessible_name=f"Copy the {snippet.client} configuration")
        layout = QVBoxLayout(page)
        layout.addWidget(where)
        layout.addLayout(shell_row)
        layout.addWidget(text, 1)
        layout.addWidget(copy, 0, Qt.AlignmentFlag.AlignRight)
        self.shells.append(shell)
        self.texts.append(text)
        return page


def _limit_box(top: int, tip: str) -> QSpinBox:
    box = QSpinBox()
    box.setRange(0, top)
    box.setSpecialValueText("No limit")
    box.setGroupSeparatorShown(True)
    box.setToolTip(tip)
    return box
