"""The main window's sharing (mixed into `studio.window.MainWindow`): the port opened on
this computer at once and on the network only once a model is ready after a relaunch, the
scope, the port and the owner's key as the Sharing tab changes them, the settings saved
and handed to the service, and the named keys and teammates' requests wired to the
bridge."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from PySide6.QtWidgets import QLabel

from backend.addresses import is_loopback
from backend.api_keys import generate_api_key
from backend.app.pool.pool_state import PoolState
from backend.app.pool.pool_status import Residency
from backend.keys.enrolment_window import accepting_until
from backend.settings import Settings

from studio.bridge import ServiceBridge
from studio.chat_view import ChatView
from studio.sharing_view import ALL_INTERFACES, LOOPBACK, SharingView

__all__ = ["SharingWiring"]


class SharingWiring:
    if TYPE_CHECKING:  # the window's
        bridge: ServiceBridge
        settings: Settings
        sharing: SharingView
        chat: ChatView
        status_url: QLabel
        _lan_waits: bool
        _settings_path: Path | None

        def ask(self, title: str, text: str) -> bool: ...

        def show_message(self, message: str) -> None: ...

    def start(self) -> None:
        """Start the service and open the port: on this computer at once; on the network,
        when the settings share it there, only once a model is ready (a relaunch does not
        put a port with nothing to serve on the LAN)."""
        self._lan_waits = not is_loopback(self.settings.host)
        self.chat.set_shared(self._lan_waits)
        self.bridge.start(open_port=False)
        self.bridge.apply_settings(self._served(self.settings), on_error=self._on_port_error)
        self.sharing.show_lan_wait(self._lan_waits)

    def _served(self, settings: Settings) -> Settings:
        """The settings the port runs with: this computer only while the LAN waits for a
        model (nothing announced meanwhile)."""
        return settings.replace(host=LOOPBACK, advertise=False) if self._lan_waits else settings

    def _share_once_ready(self, state: PoolState) -> None:
        if self._lan_waits and any(m.residency is Residency.READY for m in state.models):
            self._lan_waits = False
            self.sharing.show_lan_wait(False)
            self.bridge.apply_settings(self.settings, on_error=self._on_port_error)

    def set_lan(self, lan: bool) -> None:
        self._lan_waits = False  # the owner's word: now
        self.sharing.show_lan_wait(False)
        changes: dict[str, str] = {"host": ALL_INTERFACES if lan else LOOPBACK}
        if lan and not self.settings.api_key:
            # Nobody may reach the model from the network without a key.
            changes["api_key"] = generate_api_key()
        self.apply_settings(self.settings.replace(**changes))

    def regenerate_key(self) -> None:
        if self.settings.api_key and not self.ask(
                "Make a new API key?",
                "Clients that use the current key will be refused until they get the new one."):
            return
        self.apply_settings(self.settings.replace(api_key=generate_api_key()))

    def _on_port(self, port: int) -> None:
        if port != self.settings.port:
            self.apply_settings(self.settings.replace(port=port))

    def apply_settings(self, settings: Settings) -> None:
        """Remember `settings` (the bridge writes them off this thread) and hand them to
        the service."""
        self.settings = settings
        self.bridge.save_settings(settings, self._settings_path, on_error=lambda message:
                                  self.show_message(f"The settings could not be saved: {message}"))
        self.sharing.set_settings(settings)
        self.chat.set_shared(not is_loopback(settings.host))
        self.bridge.apply_settings(self._served(settings), on_error=self._on_port_error)

    def _on_port_error(self, message: str) -> None:
        # A failed reopen leaves no port open: the old addresses no longer work.
        if self.bridge.gateway_port is None:
            self.sharing.set_urls([])
            self.status_url.setText("")
        self.sharing.show_problem(message)

    def _on_urls(self, urls: list[str]) -> None:
        self.sharing.show_problem("")
        self.sharing.set_urls(urls)
        self.status_url.setText(urls[0] if urls else "")

    def _connect_keys(self) -> None:
        keys, b = self.sharing.keys, self.bridge
        keys.refresh_requested.connect(lambda chart_key, span: b.key_table(
            chart_key, span, on_done=keys.show_table))
        keys.create_requested.connect(lambda name, limits: b.add_key(
            name, limits, on_done=keys.show_created, on_error=keys.show_dialog_error))
        keys.edit_requested.connect(lambda name, changes: b.edit_key(
            name, changes, on_done=keys.show_edited, on_error=keys.show_dialog_error))
        keys.revoke_requested.connect(lambda name: b.revoke_key(
            name, on_done=lambda _record: keys.request_refresh(), on_error=self.show_message))
        b.enrolments_changed.connect(self.sharing.set_enrolments)
        b.announcement_changed.connect(self.sharing.show_announcement)
        b.enrolment_window_changed.connect(self.sharing.show_enrolment_window)
        self.sharing.accept_enrolments_changed.connect(lambda minutes: self.apply_settings(
            self.settings.replace(accept_enrolments_until=accepting_until(minutes))))
        self.sharing.enrolment_approved.connect(lambda request, limits: b.approve_enrolment(
            request, limits, on_error=self.show_message))
        self.sharing.enrolment_refused.connect(lambda request: b.refuse_enrolment(
            request, on_error=self.show_message))
