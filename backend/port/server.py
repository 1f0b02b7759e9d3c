"""Serving the port: uvicorn on the running loop, on a socket bound up front.

`GatewayServer.start(served, host, port)` serves an app and the port around it (`Served`:
the gateway, or `PlainApp` for any other ASGI app), with no signal handlers (the service owns the process's signals and its loop), and
`stop()` gives running requests a grace period.  The h11 protocol adds the limits uvicorn
lacks (a deadline for each request head, a connection cap) and lets each request drop
its connection (`ABORT_EXTENSION`), write a streamed body straight to it
(`BODY_WRITER_EXTENSION`), and say that it is held without a key (`KEYLESS_EXTENSION`:
such a connection is closed first when the port is full, after the idle ones).  `bind_socket` turns a port that cannot be opened
into a SettingsError a person can act on.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import logging
import os
import socket
from typing import TYPE_CHECKING, Any, Callable, Protocol

import uvicorn
from starlette.types import ASGIApp
from uvicorn.protocols.http.h11_impl import H11Protocol, RequestResponseCycle

from backend.errors import RequestError, SettingsError
from backend.port.tcp_nodelay import send_at_once
from backend.settings import Settings

if TYPE_CHECKING:
    from uvicorn._types import HTTPScope

__all__ = ["ABORT_EXTENSION", "BODY_WRITER_EXTENSION", "KEYLESS_EXTENSION", "BodyWriter",
           "GatewayServer", "PlainApp", "Served", "bind_socket"]

log = logging.getLogger("gguf_studio.gateway")

#: Scope extension: drops the request's connection at once, unsent bytes discarded
#: (uvicorn's own close waits for a client that stopped reading for ever).
ABORT_EXTENSION = "gguf_studio.abort_connection"
#: Scope extension: a `BodyWriter` for the request's answer.
BODY_WRITER_EXTENSION = "gguf_studio.body_writer"
#: Scope extension: a function of no argument that marks the request's connection as
#: held by a request without a key (until its answer ends): when the port is full, such
#: connections are closed before the newcomer is refused.
KEYLESS_EXTENSION = "gguf_studio.keyless"


class Served(Protocol):
    """What the server runs: an ASGI app and the port's hooks around it."""

    @property
    def app(self) -> ASGIApp: ...

    @property
    def settings(self) -> Settings: ...

    closing: bool

    def abort_load(self, key: str, error: RequestError) -> int: ...

    async def aclose(self) -> None: ...


class PlainApp:
    """Any ASGI app served with default limits and no port hooks (test and bench peers)."""

    closing = False

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.settings = Settings()

    def abort_load(self, key: str, error: RequestError) -> int:
        return 0

    async def aclose(self) -> None:
        pass


class GatewayServer:
    """uvicorn serving an app on the current loop, on a socket bound up front."""

    def __init__(self, served: Served, server: _Server, task: asyncio.Task[None],
                 port: int) -> None:
        self.served = served
        self.port = port
        self._server = server
        self._task = task

    def abort_load(self, key: str, error: RequestError) -> int:
        """End every request running on the engine with admission key `key` with
        `error`; how many."""
        return self.served.abort_load(key, error)

    @classmethod
    async def start(cls, served: Served, host: str, port: int, *,
                    shutdown_grace: float = 3.0) -> "GatewayServer":
        """Listening when this returns; `port` 0 picks a free one (see `.port`)."""
        sock = bind_socket(host, port)
        protocol = type("GatewayProtocol", (_Protocol,),
                        {"settings": staticmethod(lambda: served.settings)})
        config = uvicorn.Config(
            served.app, lifespan="off", log_config=None, access_log=False, ws="none", http=protocol,
            proxy_headers=False, server_header=False,
            # uvicorn annotates it int but waits with asyncio.wait_for, so seconds may be
            # fractional (the tests stop in a fraction of one).
            timeout_graceful_shutdown=shutdown_grace)  # type: ignore[arg-type]
        server = _Server(config)
        task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]),
                                                      name=f"gateway {host}:{port}")
        listening = asyncio.ensure_future(server.listening.wait())
        try:
            await asyncio.wait((task, listening), return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # cancelled while starting: leave nothing open
            listening.cancel()
            task.cancel()
            sock.close()
            raise
        if not server.listening.is_set():
            listening.cancel()
            sock.close()
            try:
                task.result()
            except BaseException as exc:
                raise SettingsError(f"The port {port} on {host} could not be opened.") from exc
            raise SettingsError(f"The port {port} on {host} could not be opened.")
        return cls(served, server, task, sock.getsockname()[1])

    async def stop(self, grace: float | None = None) -> None:
        """Stop listening, give running requests `grace` seconds (default: the one given
        to `start`), then end what still runs with a clean error."""
        self.served.closing = True
        if grace is not None:
            # Fractional seconds, as in `start`: uvicorn's int annotation is narrower than it is.
            self._server.config.timeout_graceful_shutdown = grace  # type: ignore[assignment]
        self._server.should_exit = True
        self._server.exit_now.set()
        try:
            await self._task
        except (Exception, SystemExit):
            log.exception("the port did not shut down cleanly")
        # uvicorn cancels requests still running after the grace period without waiting
        # for them: let them send their last words before the upstream client goes.
        leftovers = list(self._server.server_state.tasks)
        if leftovers:
            await asyncio.wait(leftovers, timeout=2.0)
        await self.served.aclose()


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket, or a SettingsError a person can act on."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror:
        raise SettingsError(f"The address {host!r} is not known on this machine.") from None
    infos.sort(key=lambda info: info[0] != socket.AF_INET)  # IPv4 first for "localhost"
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        if os.name != "nt":  # on Windows SO_REUSEADDR would let two servers share a port
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6 and host in {"::", ""}:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(address)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        if exc.errno in {errno.EADDRINUSE, getattr(errno, "WSAEADDRINUSE", -1)}:
            raise SettingsError(
                f"Port {port} on {host} is already in use by another program. Choose another "
                "port, or stop the other program.") from None
        if exc.errno == errno.EADDRNOTAVAIL:
            raise SettingsError(f"The address {host} does not belong to this machine.") from None
        if exc.errno in {errno.EACCES, errno.EPERM}:
            raise SettingsError(f"Not allowed to listen on port {port} (ports below 1024 "
                                "need administrator rights).") from None
        raise SettingsError(f"Cannot listen on {host} port {port}: {exc.strerror}.") from None
    return sock


class _Protocol(H11Protocol):
    """uvicorn's h11 protocol with the limits uvicorn lacks (as nginx's
    `client_header_timeout` and a connection cap), and a way for each request to drop
    its connection (`ABORT_EXTENSION`).

    A connection is *idle* from its start, and again after each answer, until a whole
    request head has arrived.  An idle connection gets `header_timeout` seconds (bytes
    arriving do not extend it: a slowloris client sends a byte at a time).  Past
    `max_connections`, the idle connection idle the longest is closed to make room;
    if none is idle, the one whose request without a key (`KEYLESS_EXTENSION`) runs the
    longest: anyone on the network can open those, and they must not keep out a client
    with a key.  If there is neither, the newcomer is closed.  Settings are read live,
    per connection.
    """

    settings: Callable[[], Settings]
    _warned_at = float("-inf")

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # H11Protocol narrows asyncio's BaseTransport to Transport (with its own ignore);
        # the loop gives it a Transport.
        super().connection_made(transport)  # type: ignore[arg-type]
        send_at_once(transport)
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_scope: object = None
        self._idle_since = self.loop.time()
        #: Since when its running request, which has no key, holds it (None: it has one).
        self._keyless_since: float | None = None
        self._wait_for_head()
        limit = self.settings().max_connections
        if limit > 0 and len(self.connections) > limit:
            self._make_room()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._head_timer is None and self._idle():  # the next request starts
            self._idle_since = self.loop.time()
            self._wait_for_head()
        super().data_received(data)

    def handle_events(self) -> None:
        super().handle_events()
        scope: HTTPScope | None = self.scope  # None until the first head (uvicorn's own start)
        if scope is not None and scope is not self._head_scope:  # a whole head arrived
            self._head_scope = scope
            self._keyless_since = None
            self._stop_head_timer()
            # Our extensions' values are functions, not the dicts ASGI's types expect.
            extensions: dict[str, Any] = scope.setdefault("extensions", {})
            extensions[ABORT_EXTENSION] = self.transport.abort
            extensions[KEYLESS_EXTENSION] = functools.partial(self._mark_keyless, scope)
            if self.cycle is not None and self.cycle.scope is scope:
                extensions[BODY_WRITER_EXTENSION] = BodyWriter(self.cycle)

    def on_response_complete(self) -> None:
        # The writer refers to the request's cycle and the keyless mark to its scope,
        # which hold them: let go once the answer is complete, so that a request's
        # objects are freed by their reference counts, not left to the garbage collector.
        cycle = self.cycle
        if cycle is not None:
            extensions = cycle.scope.get("extensions")
            if extensions is not None:
                extensions.pop(BODY_WRITER_EXTENSION, None)
                extensions.pop(KEYLESS_EXTENSION, None)
        super().on_response_complete()

    def _idle(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _mark_keyless(self, scope: object) -> None:
        if scope is self._head_scope and self._keyless_since is None:
            self._keyless_since = self.loop.time()

    def _wait_for_head(self) -> None:
        timeout = self.settings().header_timeout
        if timeout > 0:
            self._head_timer = self.loop.call_later(timeout, self._head_too_slow)

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_too_slow(self) -> None:
        self._head_timer = None
        if self._idle():
            log.debug("closing a connection that sent no whole request head in time")
            self.transport.abort()

    def _make_room(self) -> None:
        """O(connections), only past the cap."""
        others = [c for c in self.connections if isinstance(c, _Protocol) and c is not self
                  and not c.transport.is_closing()]
        idle = [c for c in others if c._idle()]
        keyless = [c for c in others if c._keyless_since is not None] if not idle else []
        victim: _Protocol = self
        if idle:
            victim = min(idle, key=lambda c: c._idle_since)
        elif keyless:
            victim = min(keyless, key=lambda c: c._keyless_since or 0.0)
        now = self.loop.time()
        if now - _Protocol._warned_at > 60:  # once a minute, not once per connection
            _Protocol._warned_at = now
            log.warning("more than %d connections to the port: closing the ones that "
                        "send no request, then those of requests without a key",
                        self.settings().max_connections)
        victim.transport.abort()


class BodyWriter:
    """Writes the body of a streamed answer straight to its connection.

    The answer's start goes through ASGI `send` as usual (headers, CORS, status noted);
    its body chunks, one per upstream read, can then skip the chain of `send` wrappers
    and h11's event machinery (a third of the port's Python time per relayed chunk on a
    busy port): HTTP/1.1 chunk framing is one format string.  The last message (the
    end of the body) goes through `send` again, so h11 ends the answer and the
    connection's keep-alive state stays its own.

    `write` returns False when the client's buffer is full: await `drain()` before the
    next write (as uvicorn's `send` would).  After a disconnect writes are dropped, as
    uvicorn drops them.
    """

    __slots__ = ("_cycle", "_transport", "_flow", "_chunked")

    def __init__(self, cycle: RequestResponseCycle) -> None:
        self._cycle = cycle
        self._transport = cycle.transport
        self._flow = cycle.flow
        # h11 frames an answer without a length in chunks for an HTTP/1.1 client and
        # delimits it by closing the connection for an HTTP/1.0 one.
        self._chunked = cycle.conn.their_http_version == b"1.1"

    def ready(self) -> bool:
        """Whether the answer's start was sent and its body may be written here."""
        cycle = self._cycle
        return cycle.response_started and not cycle.response_complete

    def write(self, data: bytes) -> bool:
        if self._cycle.disconnected or not data:
            return True
        if self._chunked:
            self._transport.write(b"%x\r\n%b\r\n" % (len(data), data))
        else:
            self._transport.write(data)
        return not self._flow.write_paused

    async def drain(self) -> None:
        await self._flow.drain()


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.listening = asyncio.Event()
        self.exit_now = asyncio.Event()

    @contextlib.contextmanager
    def capture_signals(self) -> Any:
        yield  # the service owns the process's signals and its loop

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        self.listening.set()

    async def main_loop(self) -> None:
        """uvicorn's tick loop, but a stop request ends it at once, not at the next tick."""
        counter = 0
        should_exit = await self.on_tick(counter)
        while not should_exit:
            counter = (counter + 1) % 864000
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.exit_now.wait(), 0.1)
            should_exit = await self.on_tick(counter)
