"""The port's advanced limits in the Sharing tab (mixed into `studio.sharing_view.SharingView`):
connections, timeouts, bodies, prompt counts, allowed origins and host names, each with
what it does and its default; an edit is handed on as the settings' fields."""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar

from PySide6.QtWidgets import QDoubleSpinBox, QFormLayout, QGroupBox, QLineEdit, QSpinBox

from backend.settings import Settings, parse_names

if TYPE_CHECKING:
    from PySide6.QtCore import SignalInstance

__all__ = ["MiB", "AdvancedLimits"]

MiB = 1024 * 1024


class AdvancedLimits:
    if TYPE_CHECKING:  # the Sharing tab's
        limits_changed: SignalInstance
        _settings: Settings

    def _advanced_limits(self) -> QGroupBox:
        """The port's protection limits, each with what it does and its default."""
        default = Settings()
        self._settings = default
        self.max_connections = _limit_box(QSpinBox(), 1_000_000, "No limit", (
            "Connections the port keeps open at once. Past it, the oldest connection that has "
            "not sent a whole request is closed to make room, else the newcomer is refused. "
            f"0 = no limit. Default {default.max_connections}."))
        self.header_timeout = _limit_box(QDoubleSpinBox(), 86_400, "No limit", (
            "Seconds a client may take to send a request's head, and to send each next part "
            "of its body (the whole body: this plus a second per KiB), before the port closes "
            f"the connection (408). 0 = no limit. "
            f"Default {default.header_timeout:g} s."), suffix=" s")
        self.client_stall = _limit_box(QDoubleSpinBox(), 86_400, "Never", (
            "Seconds a client may leave its answer unread before the port drops it and frees "
            f"its slot for others. 0 = never. Default {default.client_stall_timeout:g} s."),
            suffix=" s")
        self.waiting_bodies = _limit_box(QSpinBox(), 1_048_576, "No bound", (
            "Request bodies that requests waiting in line may hold in memory together; past "
            "it a request that would have to wait is refused (429). 0 = no bound. "
            f"Default {default.max_waiting_body_bytes // MiB} MiB."), suffix=" MiB")
        self.incoming_bodies = _limit_box(QSpinBox(), 1_048_576, "No bound", (
            "Request bodies the port reads, checks and has counted at once, before they wait "
            "in line or run (each takes several times its size in memory meanwhile); past it "
            "a request is refused (429). 0 = no bound. "
            f"Default {default.max_incoming_body_bytes // MiB} MiB."), suffix=" MiB")
        self.prompt_counts = _limit_box(QSpinBox(), 100_000, "Auto (2 per slot)", (
            "Prompts the model's server is asked to count at once (the port counts long "
            "prompts before admitting them); past it a request is refused (429). "
            "0 = twice the slots."))
        self.max_body = _limit_box(
            QSpinBox(), 1_048_576, f"Default ({default.max_body_bytes // MiB} MiB)", (
                "The largest request body the port takes (413 past it). 0 = the default, "
                f"{default.max_body_bytes // MiB} MiB: a port never takes unlimited bodies."),
            suffix=" MiB")
        self.allow_origins = _names_line(
            "Allowed web origins", "e.g. https://app.example.com, http://*.local:3000",
            "Web pages (origins) allowed to call the port from a browser, separated by commas; "
            "* wildcards allowed. Pages served from this computer are always allowed. "
            "Default: none.")
        self.allow_hosts = _names_line(
            "Allowed host names", "e.g. studio.lan, *",
            "Host names clients may use to reach the port beyond this computer's own names and "
            "addresses, separated by commas; * allows any. Checked only when no API key is "
            "set (it guards against DNS rebinding). Default: none.")
        group = QGroupBox("Advanced limits")
        form = QFormLayout(group)
        for label, box in (("Max &connections:", self.max_connections),
                           ("Request &head timeout:", self.header_timeout),
                           ("Unread answer &timeout:", self.client_stall),
                           ("Largest b&ody:", self.max_body),
                           ("Waiting &bodies:", self.waiting_bodies),
                           ("&Incoming bodies:", self.incoming_bodies),
                           ("Prompt co&unts at once:", self.prompt_counts),
                           ("Allowed &origins:", self.allow_origins),
                           ("Allowed &host names:", self.allow_hosts)):
            box.editingFinished.connect(self._on_advanced_limits)
            form.addRow(label, box)
        return group

    def _on_advanced_limits(self) -> None:
        def in_bytes(box: QSpinBox, now: int) -> int:
            return now if box.value() == round(now / MiB) else box.value() * MiB  # shown rounded

        settings = self._settings
        self.limits_changed.emit({
            "max_connections": self.max_connections.value(),
            "header_timeout": float(self.header_timeout.value()),
            "client_stall_timeout": float(self.client_stall.value()),
            "max_body_bytes": in_bytes(self.max_body, settings.max_body_bytes),
            "max_waiting_body_bytes": in_bytes(self.waiting_bodies, settings.max_waiting_body_bytes),
            "max_incoming_body_bytes": in_bytes(self.incoming_bodies,
                                                settings.max_incoming_body_bytes),
            "max_prompt_counts": self.prompt_counts.value(),
            "allow_origins": parse_names(self.allow_origins.text()),
            "allow_hosts": parse_names(self.allow_hosts.text())})


SpinBox = TypeVar("SpinBox", QSpinBox, QDoubleSpinBox)


def _limit_box(box: SpinBox, top: int, zero_text: str, tip: str, *, suffix: str = "") -> SpinBox:
    """A whole-number limit from 0 to `top`, where 0 shows `zero_text` (no limit, default...)."""
    box.setRange(0, top)
    if isinstance(box, QDoubleSpinBox):
        box.setDecimals(0)
    box.setSuffix(suffix)
    box.setSpecialValueText(zero_text)
    box.setToolTip(tip)
    return box


def _names_line(name: str, example: str, tip: str) -> QLineEdit:
    """A comma-separated list of names (origins, hosts) typed in one line."""
    line = QLineEdit()
    line.setAccessibleName(name)
    line.setPlaceholderText(example)
    line.setToolTip(tip)
    return line
