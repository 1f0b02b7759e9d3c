"""The floor for `bench/relay.py`: a byte-forwarding TCP proxy that does nothing else.

One asyncio.Protocol pair per connection, bytes passed on as they come (with flow
control), no HTTP parsing at all.  Whatever it adds to time-to-first-token or takes
from throughput is the price of one more process hop on this machine at this moment
(scheduling, loopback TCP), which no HTTP relay written in Python can go below.

    python bench/tcp_proxy.py --upstream http://127.0.0.1:8081 [--port 0]

Prints `tcp proxy on http://127.0.0.1:PORT` once it listens.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
from urllib.parse import urlsplit


class _Side(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.peer: "_Side | None" = None
        self.pending: list[bytes] = []
        self.eof = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        no_delay(transport)

    def data_received(self, data: bytes) -> None:
        peer = self.peer
        if peer is not None and peer.transport is not None:
            peer.transport.write(data)
        else:
            self.pending.append(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.close()

    def pause_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.resume_reading()


def no_delay(transport: asyncio.BaseTransport) -> None:
    """TCP_NODELAY on the connection's socket.  asyncio's loop sets it by itself only on
    sockets made with proto IPPROTO_TCP, which the connections accepted from the plain
    `socket.socket(AF_INET, SOCK_STREAM)` below are not: with Nagle's algorithm on, a
    small write waits for the ACK of the one before, which a peer in a request/response
    pattern delays by up to 40 ms, so every answer on a kept-alive connection came about
    20 ms late (measured by `bench/pool.py`'s closed loop)."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class _Downstream(_Side):
    def __init__(self, host: str, port: int) -> None:
        super().__init__()
        self.host = host
        self.port = port

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        asyncio.get_running_loop().create_task(self._connect())

    async def _connect(self) -> None:
        loop = asyncio.get_running_loop()
        upstream = _Side()
        upstream.peer = self
        try:
            await loop.create_connection(lambda: upstream, self.host, self.port)
        except OSError:
            self.transport.close()
            return
        self.peer = upstream
        for data in self.pending:
            upstream.transport.write(data)
        self.pending.clear()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    target = urlsplit(args.upstream)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    sock.listen(2048)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Downstream(target.hostname, target.port), sock=sock)
    print(f"tcp proxy on http://{args.host}:{sock.getsockname()[1]}", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        pass
