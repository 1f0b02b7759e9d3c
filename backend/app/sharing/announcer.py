"""The port's announcement on the LAN: made, remade and withdrawn as the settings say, in
the background, and what it is now in words.

The owner asks for it (`serve --advertise [NAME]`, or the Sharing tab); it is made only
while the port listens beyond loopback with keys required, under the name the owner
chose (`backend.app.sharing.discovery`).  Zeroconf's announcements take a second or two,
which no caller waits for: `announced` returns once the latest is made or given up, and
the listeners hear what it is then.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

from backend.addresses import client_urls, is_loopback
from backend.api_paths import ENROLMENTS
from backend.app.sharing.discovery import Advertiser, app_version, service_name
from backend.listeners import Listeners
from backend.settings import Settings

__all__ = ["Announcer", "client_hosts"]

log = logging.getLogger("gguf_studio.service")


class Announcer:
    """The port's one announcement on the LAN (`advertiser`), and why it is not made
    although asked for (`problem`)."""

    def __init__(self) -> None:
        self.advertiser = Advertiser()
        #: Why the port is not announced although asked to be ("" when it is, or not asked).
        self.problem = ""
        self._advertising: asyncio.Task[None] | None = None
        self._listeners: Listeners[[str, bool]] = Listeners(log, "announce listener")

    def advertise(self, settings: Callable[[], Settings], port: Callable[[], int | None],
                  keys_required: Callable[[], bool]) -> None:
        """(Re)announce the port as the settings say, in the background (no port: none)."""
        if self._advertising is not None and not self._advertising.done():
            self._advertising.cancel()
        self._advertising = asyncio.ensure_future(self._announce(settings, port, keys_required))

    async def announced(self) -> None:
        """Return once the port's announcement on the LAN is made (or given up)."""
        task = self._advertising
        if task is not None:
            await asyncio.gather(task, return_exceptions=True)

    def add_listener(self, listener: Callable[[str, bool], None]) -> None:
        """Called with what the announcement is now: "" (not asked for), the name it is
        announced under, or why it is not; and whether that is a warning (the name was
        taken: `text`)."""
        self._listeners.add(listener)

    def text(self) -> str:
        advertiser = self.advertiser
        if advertiser.renamed:
            return (f"Announced as {advertiser.name!r}, not {advertiser.asked!r}: another "
                    f"device on the network already answers to {advertiser.asked!r} and may "
                    "be posing as this port. Teammates who connect to that name are shown both and "
                    "asked to choose: give them this port's address instead.")
        if advertiser.running:
            return f"Announced as {advertiser.name!r}: teammates run gguf-studio connect."
        return self.problem

    async def stop(self) -> None:
        task, self._advertising = self._advertising, None
        if task is not None and not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await self.advertiser.stop()

    async def _announce(self, settings: Callable[[], Settings], port: Callable[[], int | None],
                        keys_required: Callable[[], bool]) -> None:
        try:
            await self._announce_now(settings, port, keys_required)
        finally:
            self._listeners(self.text(), self.advertiser.renamed)

    async def _announce_now(self, settings_now: Callable[[], Settings],
                            port_now: Callable[[], int | None],
                            keys_required_now: Callable[[], bool]) -> None:
        await self.advertiser.stop()
        settings, port = settings_now(), port_now()
        self.problem = ""
        if not settings.advertise or port is None:
            return
        keys_required = keys_required_now()
        if is_loopback(settings.host) or not keys_required:
            self.problem = (
                "Not announced on the network: the port " + (
                    "listens on this computer only." if is_loopback(settings.host) else
                    "requires no key; make one first."))
            log.warning("%s", self.problem)
            return
        # Never this machine's loopback to other machines: it would name *their* own.
        everywhere = client_hosts(settings.host)
        addresses = [a for a in everywhere if not is_loopback(a)] or everywhere
        try:
            await self.advertiser.start(service_name(settings.advertise_name), port,
                                        addresses, version=app_version(), enrol_path=ENROLMENTS,
                                        keys_required=keys_required)
        except (OSError, ValueError, RuntimeError) as exc:
            self.problem = f"Could not announce the port on the network: {exc}"
            log.error("%s", self.problem)


def client_hosts(host: str) -> list[str]:
    """The addresses a client reaches a port bound to `host` at (all of this machine's
    for 0.0.0.0), as the base URLs name them."""
    return [url.split("//", 1)[1].rsplit(":", 1)[0].strip("[]") for url in client_urls(host, 1)]
