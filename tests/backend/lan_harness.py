"""Devices on the LAN that pose as the owner's port, built of real parts on this machine's
loopback: an `Impostor` announces a name over mDNS (a real zeroconf responder, host
"impostor.local"), a `Relay` passes TCP connections on to the port from an address of
its own (loopback has a whole /8 of addresses, standing in for LAN hosts)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from typing import Any

from backend.app.sharing.discovery import SERVICE_TYPE

__all__ = ["Impostor", "Relay"]


class Impostor:
    """Announces `name` before the owner's port does, or instead of it."""

    def __init__(self) -> None:
        self.zeroconf: Any = None

    async def announce(self, name: str, port: int, address: str = "127.0.0.1") -> None:
        from zeroconf import IPVersion
        from zeroconf.asyncio import AsyncServiceInfo, AsyncZeroconf

        self.zeroconf = AsyncZeroconf(interfaces=["127.0.0.1"], ip_version=IPVersion.V4Only)
        await self.zeroconf.async_register_service(AsyncServiceInfo(
            SERVICE_TYPE, f"{name}.{SERVICE_TYPE}", port=port,
            addresses=[socket.inet_aton(address)], server="impostor.local.",
            properties={"v": "1", "enrol": "/v1/enrolments", "keys": "required"}))

    async def leave(self) -> None:
        if self.zeroconf is not None:
            zeroconf, self.zeroconf = self.zeroconf, None
            await zeroconf.async_unregister_all_services()
            await zeroconf.async_close()


class Relay:
    """Listens at `listen` and passes every connection on, byte for byte, to `target`,
    connecting from `source`: what a device posing as the port does to read its traffic."""

    def __init__(self, target: tuple[str, int], listen: str, source: str) -> None:
        self.target, self.listen, self.source = target, listen, source
        self.server: asyncio.Server | None = None
        self.connections = 0
        self._pipes: set[asyncio.Task[None]] = set()

    @property
    def url(self) -> str:
        assert self.server is not None
        host, port = self.server.sockets[0].getsockname()[:2]
        return f"http://{host}:{port}"

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, self.listen, 0)

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
        for pipe in list(self._pipes):
            pipe.cancel()
        await asyncio.gather(*self._pipes, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        up_reader, up_writer = await asyncio.open_connection(*self.target,
                                                             local_addr=(self.source, 0))
        pipes = [asyncio.ensure_future(_pipe(reader, up_writer)),
                 asyncio.ensure_future(_pipe(up_reader, writer))]
        self._pipes.update(pipes)
        await asyncio.gather(*pipes, return_exceptions=True)
        self._pipes.difference_update(pipes)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while chunk := await reader.read(65536):
            writer.write(chunk)
            await writer.drain()
    except ConnectionError:
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()
