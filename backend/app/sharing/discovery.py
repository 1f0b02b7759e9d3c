"""Finding a port on the LAN without its address: mDNS / DNS-SD (python-zeroconf).

The owner's port, when it shares on the LAN with keys required and the owner asked for it
(`serve --advertise [NAME]`, or the Sharing tab), announces one service of type
`_gguf-studio._tcp.local.` under a name the owner chooses.  Its TXT record holds no
secret: the protocol and app versions, the enrolment endpoint's path, and that a key is
required.  `gguf-studio connect` browses for that type for a few seconds (`browse`).
Anyone on the LAN can announce any name: when another device already answers to the
owner's, zeroconf announces the port as "NAME-2" and the Advertiser says it was
`renamed`, which the owner is shown; `connect` never picks among such names silently.

Everything runs on the caller's asyncio loop through zeroconf's asyncio API
(`AsyncZeroconf`): announcing and answering never block the port.  Which interfaces are
used is zeroconf's choice (all of them), unless GGUF_STUDIO_MDNS_INTERFACES names
addresses (comma-separated), e.g. 127.0.0.1 to keep a test on this machine.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import socket
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ENV_INTERFACES", "SERVICE_TYPE", "Advertiser", "FoundPort", "app_version",
           "browse", "service_name"]

log = logging.getLogger("gguf_studio.discovery")

SERVICE_TYPE = "_gguf-studio._tcp.local."
ENV_INTERFACES = "GGUF_STUDIO_MDNS_INTERFACES"
#: The TXT record's protocol version: what `connect` may expect of the endpoint.
PROTOCOL = "1"


@dataclass(frozen=True)
class FoundPort:
    """A port found on the LAN: its name, addresses and port number, its TXT record."""

    name: str
    addresses: tuple[str, ...]
    port: int
    properties: dict[str, str] = field(default_factory=dict)

    @property
    def urls(self) -> list[str]:
        """Its root URLs, one per address: IPv4 first, loopback last (it names this
        machine, which is the port's only when nothing else answers)."""
        ordered = sorted(self.addresses,
                         key=lambda a: (ipaddress.ip_address(a).is_loopback, ":" in a, a))
        return [f"http://{f'[{a}]' if ':' in a else a}:{self.port}" for a in ordered]


class Advertiser:
    """One port's announcement; `start` and `stop` on the port's loop.  `name` is the
    name it is announced under, `asked` the one it was given: they differ when another
    device on the LAN answered to that name first (`renamed`)."""

    def __init__(self) -> None:
        self._zeroconf: Any = None
        self._info: Any = None
        self.name = ""
        self.asked = ""

    @property
    def running(self) -> bool:
        return self._zeroconf is not None

    @property
    def renamed(self) -> bool:
        """Announced under another name than asked: something else answers to the name
        teammates were told, maybe a device posing as this port."""
        return self.running and self.name != self.asked

    async def start(self, name: str, port: int, addresses: list[str], *, version: str,
                    enrol_path: str, keys_required: bool) -> None:
        from zeroconf import IPVersion
        from zeroconf.asyncio import AsyncServiceInfo, AsyncZeroconf

        await self.stop()
        packed = [ipaddress.ip_address(a).packed for a in addresses]
        asked = _instance(name)
        self._info = AsyncServiceInfo(
            SERVICE_TYPE, f"{asked}.{SERVICE_TYPE}", port=port, addresses=packed,
            properties={"v": PROTOCOL, "version": version, "enrol": enrol_path,
                        "keys": "required" if keys_required else "none"},
            server=f"{_host_label()}.local.")
        self._zeroconf = AsyncZeroconf(interfaces=_interfaces(), ip_version=IPVersion.V4Only)
        # Another device answers to that name: zeroconf picks "NAME-2" (and `renamed`
        # says so, for the owner to hear: that device may be posing as this port).
        await self._zeroconf.async_register_service(self._info, allow_name_change=True)
        self.name = self._info.name.removesuffix("." + SERVICE_TYPE)
        self.asked = asked

    async def stop(self) -> None:
        zeroconf, self._zeroconf = self._zeroconf, None
        if zeroconf is not None:
            try:
                await zeroconf.async_unregister_all_services()
            finally:
                await zeroconf.async_close()
        self.name = self.asked = ""


async def browse(seconds: float = 3.0) -> list[FoundPort]:
    """The ports that answer on the LAN within `seconds` (all of them: it waits)."""
    from zeroconf import IPVersion
    from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo, AsyncZeroconf

    names: list[str] = []

    def on_change(zeroconf: Any, service_type: str, name: str, state_change: Any) -> None:
        if name not in names:
            names.append(name)

    zeroconf = AsyncZeroconf(interfaces=_interfaces(), ip_version=IPVersion.V4Only)
    browser = AsyncServiceBrowser(zeroconf.zeroconf, SERVICE_TYPE, handlers=[on_change])
    found: list[FoundPort] = []
    try:
        # The whole time, even once something answered: a device that took the owner's
        # name may answer first, and a name two ports share must be seen as shared.
        await asyncio.sleep(seconds)
        for name in names:
            info = AsyncServiceInfo(SERVICE_TYPE, name)
            if not await info.async_request(zeroconf.zeroconf, 2000) or not info.port:
                continue
            properties = {_text(k): _text(v) for k, v in info.properties.items() if k}
            found.append(FoundPort(name.removesuffix("." + SERVICE_TYPE),
                                   tuple(info.parsed_addresses()), int(info.port), properties))
    finally:
        await browser.async_cancel()
        await zeroconf.async_close()
    return found


def service_name(chosen: str) -> str:
    """The name the port is announced under: the owner's, else this machine's."""
    return _instance(chosen.strip() or f"GGUF Studio on {_host_label()}")


def app_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gguf-studio")
    except PackageNotFoundError:
        return "unknown"


# --- helpers -------------------------------------------------------------------------------


def _instance(name: str) -> str:
    """A DNS-SD instance name: at most 63 bytes, no dots (they would split the name)."""
    clean = "".join(ch for ch in name.replace(".", " ") if ch.isprintable()).strip()
    encoded = (clean or "GGUF Studio").encode()[:63]
    return encoded.decode(errors="ignore")


def _host_label() -> str:
    label = socket.gethostname().split(".", 1)[0]
    return "".join(ch if ch.isalnum() or ch == "-" else "-" for ch in label) or "gguf-studio"


def _interfaces() -> Any:
    from zeroconf import InterfaceChoice

    chosen = [a.strip() for a in os.environ.get(ENV_INTERFACES, "").split(",") if a.strip()]
    return chosen or InterfaceChoice.All


def _text(value: Any) -> str:
    if value is None:
        return ""
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
