"""Who may use the model, at which addresses, with which keys, and how to set up clients."""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QPalette, QPixmap
from PySide6.QtWidgets import (
    QButtonGroup,
    QCheckBox,
    QDialog,
    QDoubleSpinBox,
    QFormLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPlainTextEdit,
    QPushButton,
    QRadioButton,
    QSpinBox,
    QSplitter,
    QTabWidget,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from backend.keys.enrolment_window import DEFAULT_ACCEPT_MINUTES, MAX_ACCEPT_MINUTES, EnrolmentWindow
from backend.settings import Settings, parse_names
from backend.models.model_names import DEFAULT_MODEL_ALIAS
from backend.app.sharing.snippets import ClientTarget, Snippet, client_snippets, key_requirement

from backend.app.sharing.key_table import KeyForm
from backend.keys.enrolments import SharedRequest
from backend.errors import KeyStoreError
from backend.keys.expiry import describe_time

from studio.advanced_limits import MiB, AdvancedLimits
from studio.keys_view import KeyDialog, KeysView
from studio.widgets import CopyButton, monospace_font, secondary_label

__all__ = ["SharingView"]

LOOPBACK = "127.0.0.1"
ALL_INTERFACES = "0.0.0.0"


class SharingView(QWidget, AdvancedLimits):
    scope_changed = Signal(bool)  # True: the local network
    port_changed = Signal(int)
    generate_key_requested = Signal()
    limits_changed = Signal(dict)  # setting name -> value
    #: The request the owner checked (SharedRequest: name, code, time asked), the limits.
    enrolment_approved = Signal(object, dict)
    enrolment_refused = Signal(object)  # SharedRequest
    accept_enrolments_changed = Signal(int)  # minutes from now teammates may ask (0: stop)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self._key = ""
        self._model: tuple[str | None, int | None] = (None, None)
        self._snippets: list[Snippet] = []
        self._named_keys = 0
        self.urls: list[str] = []
        self.qr_dialog: QDialog | None = None
        self.approval: KeyDialog | None = None

        # --- who
        self.local_only = QRadioButton("T&his computer only")
        self.local_only.setToolTip("Listen on 127.0.0.1: only programs on this computer can connect.")
        self.lan = QRadioButton("Local &network")
        self.lan.setToolTip("Listen on every network address of this computer. "
                            "Clients must send the API key.")
        self._scope = QButtonGroup(self)
        self._scope.addButton(self.local_only)
        self._scope.addButton(self.lan)
        self.local_only.toggled.connect(self._on_scope)
        self.port = QSpinBox()
        self.port.setRange(1, 65535)
        self.port.setToolTip("The port clients connect to.")
        self.port.setAccessibleName("Port")
        self.port.editingFinished.connect(lambda: self.port_changed.emit(self.port.value()))
        self.problem = QLabel()
        self.problem.setWordWrap(True)
        self.problem.setAccessibleName("Sharing problem")
        self.problem.hide()

        scope_row = QHBoxLayout()
        scope_row.addWidget(self.local_only)
        scope_row.addWidget(self.lan)
        scope_row.addStretch(1)

        # --- key
        self.key = QLineEdit()
        self.key.setReadOnly(True)
        self.key.setFont(monospace_font())
        self.key.setEchoMode(QLineEdit.EchoMode.Password)
        self.key.setAccessibleName("API key")
        # Room for the start of it (the rest scrolls): the named keys beside need the width.
        self.key.setMinimumWidth(self.key.fontMetrics().horizontalAdvance("gs-" + "x" * 9))
        self.show_key = QPushButton("&View")
        self.show_key.setCheckable(True)
        self.show_key.toggled.connect(self._on_show_key)
        self.copy_key = CopyButton(lambda: self._key, accessible_name="Copy the API key")
        self.generate_key = QPushButton("Generate &key")
        self.generate_key.clicked.connect(self.generate_key_requested)
        self.key_hint = secondary_label()
        key_row = QHBoxLayout()
        key_row.addWidget(self.key, 1)
        key_row.addWidget(self.show_key)
        key_row.addWidget(self.copy_key)
        key_row.addWidget(self.generate_key)

        # --- announced on the LAN (mDNS), for `gguf-studio connect`
        self.advertise = QCheckBox("Announce on the &network as")
        self.advertise.setToolTip(
            "Teammates find the port with `gguf-studio connect` (mDNS). Only while it is "
            "shared on the local network with a key; nothing secret is announced.")
        self.advertise_name = QLineEdit()
        self.advertise_name.setAccessibleName("Announced name")
        self.advertise_name.setPlaceholderText("this computer's name")
        self.advertise.toggled.connect(self._on_advertise)
        self.advertise_name.editingFinished.connect(self._on_advertise)
        advertise_row = QHBoxLayout()
        advertise_row.addWidget(self.advertise)
        advertise_row.addWidget(self.advertise_name, 1)
        self.announcement = secondary_label()
        self.announcement.setAccessibleName("Announcement")
        self.announcement.hide()

        # --- teammates may ask for a key: while announced, or for the minutes given here
        self.accept = QCheckBox("Accept &requests from teammates for")
        self.accept.setToolTip(
            "Teammates may ask for a key with `gguf-studio connect` for this long (while the "
            "port is announced, they always may). You still approve each request.")
        self.accept_minutes = QSpinBox()
        self.accept_minutes.setRange(1, MAX_ACCEPT_MINUTES)
        self.accept_minutes.setValue(DEFAULT_ACCEPT_MINUTES)
        self.accept_minutes.setSuffix(" min")
        self.accept_minutes.setAccessibleName("Minutes to accept requests")
        self.accept.toggled.connect(self._on_accept)
        self.accept_minutes.editingFinished.connect(
            lambda: self._on_accept(True) if self.accept.isChecked() else None)
        accept_row = QHBoxLayout()
        accept_row.addWidget(self.accept)
        accept_row.addWidget(self.accept_minutes)
        accept_row.addStretch(1)
        self.enrolment_state = secondary_label()
        self.enrolment_state.setAccessibleName("Enrolment")
        self.lan_wait = QLabel("Shared on the network once a model is loaded: until then, this "
                               "computer only.")
        self.lan_wait.setWordWrap(True)
        self.lan_wait.setAccessibleName("Network sharing waits for a model")
        self.lan_wait.hide()

        access = QGroupBox("Access")
        form = QFormLayout(access)
        form.addRow("Share with:", scope_row)
        form.addRow("Po&rt:", self.port)
        form.addRow("API key:", key_row)
        form.addRow("", self.key_hint)
        form.addRow("", advertise_row)
        form.addRow("", self.announcement)
        form.addRow("", accept_row)
        form.addRow("", self.enrolment_state)
        form.addRow(self.lan_wait)
        form.addRow(self.problem)

        # --- teammates asking for a key (`gguf-studio connect`)
        self.enrolments_box = QGroupBox("Teammates asking for a key")
        self._enrolments_layout = QVBoxLayout(self.enrolments_box)
        self._enrolments_layout.addWidget(secondary_label(
            "Check the code with the person before you approve; Approve asks for the key's "
            "limits."))
        self.enrolment_rows: list[QWidget] = []
        self.enrolments_box.hide()

        # --- addresses
        self.urls_box = QGroupBox("Base URLs")
        self._urls_layout = QVBoxLayout(self.urls_box)
        self.url_rows: list[QLineEdit] = []
        self._no_urls = secondary_label("The port is not open.")
        self._urls_layout.addWidget(self._no_urls)

        # --- limits
        self.max_queue = QSpinBox()
        self.max_queue.setRange(0, 100_000)
        self.max_queue.setSpecialValueText("Auto (16 per slot, ≥ 64)")
        self.queue_timeout = QDoubleSpinBox()
        self.queue_timeout.setRange(0, 86_400)
        self.queue_timeout.setDecimals(0)
        self.queue_timeout.setSuffix(" s")
        self.queue_timeout.setSpecialValueText("No limit")
        self.max_output = QSpinBox()
        self.max_output.setRange(0, 1_000_000)
        self.max_output.setSpecialValueText("No cap")
        self.max_output.setToolTip("Default and ceiling for the tokens one request may generate, "
                                   "so one client cannot hold a slot for a very long answer.")
        self.default_output = QSpinBox()
        self.default_output.setRange(16, 1_000_000)
        self.default_output.setToolTip(
            "Output tokens set aside in the model's memory for a request that sends no limit "
            "of its own (Codex sends none). Not a limit: a longer answer is not cut. Larger "
            "values let fewer long requests run at once.")
        for box in (self.max_queue, self.queue_timeout, self.max_output, self.default_output):
            box.editingFinished.connect(self._on_limits)
        limits = QGroupBox("Limits")
        limits_form = QFormLayout(limits)
        limits_form.addRow("&Queue size:", self.max_queue)
        limits_form.addRow("Max &wait:", self.queue_timeout)
        limits_form.addRow("Output cap (tokens):", self.max_output)
        limits_form.addRow("Output &budget (tokens):", self.default_output)

        advanced = self._advanced_limits()

        # The limits are for later: folded away until asked for.
        self.limits_button = QToolButton()
        self.limits_button.setText("Limits and protection")
        self.limits_button.setCheckable(True)
        self.limits_button.setAutoRaise(True)
        self.limits_button.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextBesideIcon)
        self.limits_button.setAccessibleName("Show the port's limits")
        self.limits_button.toggled.connect(self._show_limits)
        self._limit_boxes = (limits, advanced)

        access_column = QWidget()
        left = QVBoxLayout(access_column)
        left.setContentsMargins(0, 0, 0, 0)
        left.addWidget(access)
        left.addWidget(self.enrolments_box)
        left.addWidget(self.urls_box)
        left.addWidget(self.limits_button, 0, Qt.AlignmentFlag.AlignLeft)
        left.addWidget(limits)
        left.addWidget(advanced)
        left.addStretch(1)
        self._show_limits(False)

        # --- snippets
        self.snippet_tabs = QTabWidget()
        self.snippet_tabs.setDocumentMode(True)
        self._snippet_widgets: list[tuple[QLabel, QLineEdit, QWidget, QPlainTextEdit]] = []
        for client in ("Codex CLI", "OpenCode", "Claude Code", "curl"):
            page = QWidget()
            where = secondary_label()
            shell = QLineEdit()
            shell.setReadOnly(True)
            shell.setFont(monospace_font())
            shell.setAccessibleName(f"{client} environment line")
            index = len(self._snippet_widgets)
            shell_row = QWidget()
            row = QHBoxLayout(shell_row)
            row.setContentsMargins(0, 0, 0, 0)
            row.addWidget(shell, 1)
            row.addWidget(CopyButton(lambda i=index: self._snippets[i].shell if self._snippets else "",
                                     accessible_name=f"Copy the {client} environment line"))
            text = QPlainTextEdit()
            text.setReadOnly(True)
            text.setFont(monospace_font())
            text.setLineWrapMode(QPlainTextEdit.LineWrapMode.NoWrap)
            text.setAccessibleName(f"{client} configuration")
            text.setTabChangesFocus(True)
            copy = CopyButton(lambda i=index: self._snippets[i].text if self._snippets else "",
                              label="Copy configuration",
                              accessible_name=f"Copy the {client} configuration")
            page_layout = QVBoxLayout(page)
            page_layout.addWidget(where)
            page_layout.addWidget(shell_row)
            page_layout.addWidget(text, 1)
            page_layout.addWidget(copy, 0, Qt.AlignmentFlag.AlignRight)
            self.snippet_tabs.addTab(page, client)
            self._snippet_widgets.append((where, shell, shell_row, text))
        snippets_box = QWidget()
        snippets_layout = QVBoxLayout(snippets_box)
        self.snippets_hint = secondary_label()
        snippets_layout.addWidget(self.snippets_hint)
        snippets_layout.addWidget(self.snippet_tabs, 1)

        # --- named keys: one per person or agent, with limits and usage
        self.keys = KeysView(self.client_target)
        self.keys.named_keys_changed.connect(self._on_named_keys)

        # Beside the access: the named keys first, then the clients' set-up, one click
        # apart and both in view without scrolling.
        self.side = QTabWidget()
        self.side.addTab(self.keys, "Named keys")
        self.side.addTab(snippets_box, "Client set-up")
        # Side by side in a splitter the window remembers: half each.
        self.split = QSplitter()
        self.split.setObjectName("sharing_split")
        self.split.addWidget(access_column)
        self.split.addWidget(self.side)
        self.split.setStretchFactor(0, 1)
        self.split.setStretchFactor(1, 1)
        self.split.setSizes([10_000, 10_000])  # half each, whatever the width
        self.split.setChildrenCollapsible(False)
        columns = QHBoxLayout(self)
        columns.addWidget(self.split)

    # --- rendering ------------------------------------------------------------------------

    def set_settings(self, settings: Settings) -> None:
        lan = settings.host not in (LOOPBACK, "localhost", "::1")
        for button, checked in ((self.lan, lan), (self.local_only, not lan)):
            button.blockSignals(True)
            button.setChecked(checked)
            button.blockSignals(False)
        self.port.blockSignals(True)
        self.port.setValue(settings.port)
        self.port.blockSignals(False)
        self._key = settings.api_key
        self.key.setText(settings.api_key)
        self.key.setCursorPosition(0)
        self.key.setPlaceholderText("No key yet")
        self.generate_key.setText("New &key" if settings.api_key else "Generate &key")
        self.generate_key.setToolTip("Make a new key; clients using the old one stop working."
                                     if settings.api_key else "Make a key for clients to send.")
        self._show_key_hint(settings)
        for widget, value in ((self.advertise, settings.advertise),
                              (self.advertise_name, settings.advertise_name)):
            widget.blockSignals(True)
            if isinstance(widget, QCheckBox):
                widget.setChecked(bool(value))
            else:
                widget.setText(str(value))
            widget.blockSignals(False)
        self.max_queue.setValue(settings.max_queue)
        self.queue_timeout.setValue(settings.queue_timeout)
        self.max_output.setValue(settings.max_output_tokens)
        self.default_output.setValue(settings.default_output_tokens)
        self._settings = settings
        self.max_connections.setValue(settings.max_connections)
        self.header_timeout.setValue(settings.header_timeout)
        self.client_stall.setValue(settings.client_stall_timeout)
        self.max_body.setValue(round(settings.max_body_bytes / MiB))
        self.waiting_bodies.setValue(round(settings.max_waiting_body_bytes / MiB))
        self.incoming_bodies.setValue(round(settings.max_incoming_body_bytes / MiB))
        self.prompt_counts.setValue(settings.max_prompt_counts)
        for line, names in ((self.allow_origins, settings.allow_origins),
                            (self.allow_hosts, settings.allow_hosts)):
            line.setText(", ".join(parse_names(" ".join(names))))
            line.setCursorPosition(0)
        self._render_snippets()

    def set_urls(self, urls: list[str]) -> None:
        for shown in self.url_rows:
            holder = shown.parentWidget()
            if holder is not None:
                holder.deleteLater()
        self.url_rows = []
        self._no_urls.setVisible(not urls)
        for url in urls:
            holder = QWidget(self.urls_box)
            line = QHBoxLayout(holder)
            line.setContentsMargins(0, 0, 0, 0)
            field = QLineEdit(url)
            field.setReadOnly(True)
            field.setFont(monospace_font())
            field.setAccessibleName("Base URL")
            line.addWidget(field, 1)
            line.addWidget(CopyButton(lambda u=url: u, accessible_name=f"Copy {url}"))
            qr = QPushButton("QR")
            qr.setAccessibleName(f"Show {url} as a QR code")
            qr.setToolTip("The address as a QR code, for a device that can scan it.")
            qr.clicked.connect(lambda _=False, u=url: self.show_qr(u))
            line.addWidget(qr)
            self._urls_layout.addWidget(holder)
            self.url_rows.append(field)
        self.urls = list(urls)
        self._render_snippets()

    def set_model(self, model_id: str | None, context_length: int | None) -> None:
        self._model = (model_id, context_length)
        self._render_snippets()

    def show_lan_wait(self, waiting: bool) -> None:
        """Whether sharing on the network waits for a model to be loaded."""
        self.lan_wait.setVisible(waiting)

    def show_keys(self) -> None:
        """Bring the named keys into view."""
        self.side.setCurrentWidget(self.keys)

    def show_client_setup(self) -> None:
        self.side.setCurrentIndex(1)

    def _show_limits(self, shown: bool) -> None:
        self.limits_button.setArrowType(Qt.ArrowType.DownArrow if shown else Qt.ArrowType.RightArrow)
        for box in self._limit_boxes:
            box.setVisible(shown)

    def show_qr(self, url: str) -> QDialog:
        dialog = QDialog(self)
        dialog.setWindowTitle("Base URL as a QR code")
        layout = QVBoxLayout(dialog)
        image = QLabel()
        image.setPixmap(qr_pixmap(url))
        image.setAccessibleName(f"QR code of {url}")
        layout.addWidget(image, 0, Qt.AlignmentFlag.AlignCenter)
        caption = QLabel(url)
        caption.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        layout.addWidget(caption, 0, Qt.AlignmentFlag.AlignCenter)
        dialog.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
        dialog.show()
        self.qr_dialog = dialog
        return dialog

    def approve_dialog(self, request: SharedRequest) -> KeyDialog:
        """The key dialog for the request it was opened on: its limits, then Approve.  It
        keeps that request (name, code, time asked): a request of the same name made
        since, with another code, is never the one approved."""
        dialog = KeyDialog(None, "", self)
        dialog.setWindowTitle(f"Approve {request.name}'s request")
        dialog.name.setText(request.name)
        dialog.name.setReadOnly(True)
        dialog.ok_button.setText("Approve")
        checked = QLabel(f"Code {request.code}, from {request.address}, asked "
                         f"{describe_time(request.requested_at)}. Approve only if the person "
                         "reads you this code from their screen.")
        checked.setTextFormat(Qt.TextFormat.PlainText)  # the name is the requester's
        checked.setWordWrap(True)
        checked.setAccessibleName("Request code")
        layout = dialog.layout()
        assert isinstance(layout, QFormLayout)
        layout.insertRow(0, checked)

        def submitted(form: KeyForm) -> None:
            try:
                limits = form.limits()
            except KeyStoreError as exc:
                dialog.show_error(str(exc))
                return
            self.enrolment_approved.emit(request, limits)
            dialog.accept()

        dialog.submitted.connect(submitted)
        dialog.finished.connect(dialog.deleteLater)
        dialog.open()
        self.approval = dialog
        return dialog

    def show_announcement(self, text: str, warning: bool = False) -> None:
        """Under which name the port is announced on the LAN, or why it is not; a
        `warning` (another device took the name) in the text's own colour, not grey."""
        self.announcement.setText(("⚠ " if warning else "") + text)
        self.announcement.setForegroundRole(QPalette.ColorRole.WindowText if warning
                                            else QPalette.ColorRole.PlaceholderText)
        self.announcement.setVisible(bool(text))

    def show_enrolment_window(self, window: EnrolmentWindow) -> None:
        """Whether teammates may ask for a key now, why, and until when."""
        self.accept.blockSignals(True)
        self.accept.setChecked(window.until is not None)
        self.accept.blockSignals(False)
        self.enrolment_state.setText(window.describe())

    def set_enrolments(self, waiting: list[SharedRequest]) -> None:
        """The requests waiting, each with its code, Approve and Refuse (which act on that
        request, not on whichever has its name later)."""
        for row in self.enrolment_rows:
            row.deleteLater()
        self.enrolment_rows = []
        for request in waiting:
            name = request.name
            row = QWidget(self.enrolments_box)
            line = QHBoxLayout(row)
            line.setContentsMargins(0, 0, 0, 0)
            label = QLabel(f"{name} from {request.address} — code {request.code}")
            label.setTextFormat(Qt.TextFormat.PlainText)  # the name is the requester's
            label.setAccessibleName(f"Request of {name}")
            line.addWidget(label, 1)
            approve = QPushButton("Approve")
            approve.setAccessibleName(f"Approve {name}")
            approve.clicked.connect(lambda _=False, r=request: self.approve_dialog(r))
            refuse = QPushButton("Refuse")
            refuse.setAccessibleName(f"Refuse {name}")
            refuse.clicked.connect(lambda _=False, r=request: self.enrolment_refused.emit(r))
            line.addWidget(approve)
            line.addWidget(refuse)
            self._enrolments_layout.addWidget(row)
            self.enrolment_rows.append(row)
        self.enrolments_box.setVisible(bool(waiting))

    def show_problem(self, message: str) -> None:
        self.problem.setText(message)
        self.problem.setVisible(bool(message))

    def client_target(self, api_key: str | None = None) -> ClientTarget:
        """What a client needs to reach the model now: the first address, the model, its
        context and the output limits; the owner's key unless another is given."""
        model_id, context = self._model
        base_url = self.urls[0] if self.urls else f"http://127.0.0.1:{self.port.value()}/v1"
        # The default model by its stable alias: the snippets survive loading another model.
        return ClientTarget(base_url, model_id or "MODEL", self._key if api_key is None else api_key,
                            context, self.max_output.value(), self.default_output.value(),
                            default_alias=DEFAULT_MODEL_ALIAS if model_id else "")

    def snippets(self) -> list[Snippet]:
        """The snippets as they are copied: with the real key."""
        return list(self._snippets)

    # --- behaviour ------------------------------------------------------------------------

    def _render_snippets(self) -> None:
        urls = self.urls
        model_id, _context = self._model
        self._snippets = client_snippets(self.client_target())
        shown = self._snippets if self.show_key.isChecked() else [s.masked() for s in self._snippets]
        for (where, shell, shell_row, text), snippet in zip(self._snippet_widgets, shown):
            where.setText(f"Paste into {snippet.where}." if snippet.client != "curl" else
                          "Run in a terminal to check that the model answers.")
            shell.setText(snippet.shell)
            shell.setCursorPosition(0)
            shell_row.setVisible(bool(snippet.shell))
            text.setPlainText(snippet.text)
        hints = []
        if not model_id:
            hints.append("Load a model to fill in its name.")
        if len(urls) > 1:
            hints.append("Snippets use the first address; use whichever your clients can reach.")
        self.snippets_hint.setText(" ".join(hints))
        self.snippets_hint.setVisible(bool(hints))

    def _show_key_hint(self, settings: Settings) -> None:
        lan = settings.host not in (LOOPBACK, "localhost", "::1")
        self.key_hint.setText(key_requirement(shared_on_network=lan, has_key=bool(settings.api_key),
                                              named_keys=self._named_keys))

    def _on_named_keys(self, count: int) -> None:
        self._named_keys = count
        self._show_key_hint(self._settings)

    def _on_advertise(self) -> None:
        self.limits_changed.emit({"advertise": self.advertise.isChecked(),
                                  "advertise_name": self.advertise_name.text().strip()})

    def _on_accept(self, accepting: bool) -> None:
        self.accept_enrolments_changed.emit(self.accept_minutes.value() if accepting else 0)

    def _on_scope(self) -> None:
        self.scope_changed.emit(self.lan.isChecked())

    def _on_show_key(self, shown: bool) -> None:
        self.key.setEchoMode(QLineEdit.EchoMode.Normal if shown else QLineEdit.EchoMode.Password)
        self.show_key.setText("H&ide" if shown else "&View")
        self._render_snippets()

    def _on_limits(self) -> None:
        self.limits_changed.emit({"max_queue": self.max_queue.value(),
                                  "queue_timeout": float(self.queue_timeout.value()),
                                  "max_output_tokens": self.max_output.value(),
                                  "default_output_tokens": self.default_output.value()})


def qr_pixmap(text: str) -> QPixmap:
    """`text` as a QR code (segno), for a phone or tablet to scan."""
    import io

    import segno

    png = io.BytesIO()
    segno.make(text, micro=False).save(png, kind="png", scale=6, border=4)
    pixmap = QPixmap()
    pixmap.loadFromData(png.getvalue(), "PNG")
    return pixmap
