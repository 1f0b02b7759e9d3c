"""The gateway's own HTTP/1.1 client for its upstream leg (llama-server on loopback/LAN).

Two parts, around the sans-I/O parser of `backend.port.http1_response`:

- `_Connection`, one asyncio.Protocol per keep-alive connection: it feeds the parser and
  keeps the answer's body for its reader, pausing the socket while a slow reader leaves
  more than HIGH_WATER bytes unread.  A connection whose answer broke HTTP is closed,
  never reused.
- `UpstreamClient`, the pool: a LIFO list of idle connections per origin; a connection the
  server closed leaves it from `connection_lost`, without any per-request syscall.  A
  request on a reused connection that the server closed as it arrived (llama-server and
  uvicorn close idle ones after 5 s; llama-server also closes its connection after each
  streamed answer, without a `Connection: close`) is sent once more on a new connection,
  when nothing at all came back.

`backend.port.relay` uses what it used of httpx: `build_request`, `send(stream=True)`, and a
response with `status_code`, `headers.get`, `aiter_raw`, `aread`, `aclose`.  Failures are
`backend.port.upstream_errors`' `UpstreamError`s (their messages are for logs, not for
clients: the relay translates them); `ConnectFailed` means that nothing was sent.

Why not httpx here: per relayed chunk httpx goes through httpcore, h11 and anyio (a
cancel scope and two epoll_ctl calls per read), and per request httpcore's pool walks
every pooled connection, polling each idle socket and counting the pool again for each
idle one (O(connections^2)).  Here a chunk costs one `data_received`, a parsing step and
one future.

Why not aiohttp's client (llhttp): measured against this one in one run it is no faster,
and it takes 12 of the 38 malformed answers of `bench/strictness.py` (see bench/README.md).
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import TypeAlias, cast
from urllib.parse import urlsplit

from backend.port.http1_response import EndOfMessage, ResponseHead, ResponseParser
from backend.port.tcp_nodelay import send_at_once
from backend.port.upstream_errors import (ConnectFailed, ConnectionLost, ConnectTimeout,
                                          MalformedAnswer, UnsupportedURL, UpstreamError)

__all__ = ["UpstreamClient", "UpstreamRequest", "UpstreamResponse"]

#: Upstream bytes buffered for a slow client before reading from the upstream pauses.
HIGH_WATER = 256 * 1024
#: An idle connection older than this is closed instead of reused (servers close theirs
#: after a few seconds anyway; this guards against ones that vanished silently).
MAX_IDLE_SECONDS = 30.0

#: (scheme, host, port): the connections to one origin are interchangeable.
_Origin: TypeAlias = tuple[str, str, int]


# --- the client --------------------------------------------------------------------------


class UpstreamClient:
    """Sends requests to upstreams over pooled keep-alive connections."""

    def __init__(self, *, connect_timeout: float = 10.0, max_idle: int = 256) -> None:
        self.connect_timeout = connect_timeout
        self.max_idle = max_idle
        self._idle: dict[_Origin, list[_Connection]] = {}
        self._n_idle = 0
        self._all: set[_Connection] = set()
        self._split: dict[str, tuple[_Origin, bytes, bytes]] = {}
        self._tls: ssl.SSLContext | None = None  # made on the first https:// upstream

    def build_request(self, method: str, url: str, *, content: bytes = b"",
                      headers: dict[str, str] | None = None) -> UpstreamRequest:
        return UpstreamRequest(method, url, content, headers or {})

    async def send(self, request: UpstreamRequest, *, stream: bool = True) -> UpstreamResponse:
        """Send `request`; returns once the answer's head came (the body is read with
        `aiter_raw`/`aread`, and `aclose` must follow).  Always streams."""
        origin, path, host = self._target(request.url)
        head = [b"%s %s HTTP/1.1\r\nHost: %s\r\n" % (request.method.encode(), path, host)]
        for name, value in request.headers.items():
            head.append(b"%s: %s\r\n" % (name.encode("latin-1"), value.encode("latin-1")))
        head.append(b"Content-Length: %d\r\n\r\n" % len(request.content))
        payload = b"".join(head) + request.content
        for attempt in (0, 1):
            # The retry goes on a new connection: the server may have closed every kept
            # one at once (llama-server closes its connection after each streamed answer,
            # without saying so), and another of them would fail the same way.
            connection = self._acquire(origin) if attempt == 0 else None
            reused = connection is not None
            if connection is None:
                connection = await self._connect(origin)
            connection.start(payload)
            try:
                answer = await connection.answer_head()
            except ConnectionLost:
                connection.close()
                # A kept-alive connection the server closed just as it was reused:
                # nothing was received, so the request was not processed.  Once more.
                if reused and not connection.received and attempt == 0:
                    continue
                raise
            except BaseException:
                connection.close()
                raise
            return UpstreamResponse(connection, answer)
        raise AssertionError("unreachable")

    def pooled(self) -> int:
        """Idle connections kept for reuse."""
        return self._n_idle

    async def aclose(self) -> None:
        for connection in list(self._all):
            connection.close()
        self._idle.clear()
        self._n_idle = 0

    # --- the pool, for its connections and their answers ---------------------------------

    def release(self, connection: _Connection) -> None:
        """A connection whose answer came to its end, for the next request."""
        if self._n_idle >= self.max_idle:
            connection.close()
            return
        connection.rest()
        self._idle.setdefault(connection.origin, []).append(connection)
        self._n_idle += 1

    def forget(self, connection: _Connection) -> None:
        """A connection that ended."""
        self._all.discard(connection)
        if connection.idle_since is not None:
            connection.idle_since = None
            idle = self._idle.get(connection.origin)
            if idle and connection in idle:
                idle.remove(connection)
                self._n_idle -= 1

    # --- helpers -------------------------------------------------------------------------

    def _target(self, url: str) -> tuple[_Origin, bytes, bytes]:
        """(origin, request target, Host header) of `url`."""
        cached = self._split.get(url)
        if cached is None:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise UnsupportedURL(f"Not an http(s) URL: {url}")
            default = 443 if parts.scheme == "https" else 80
            port = parts.port or default
            path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            name = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
            host = name if port == default else f"{name}:{port}"
            cached = ((parts.scheme, parts.hostname, port), path.encode(), host.encode())
            if len(self._split) < 1024:
                self._split[url] = cached
        return cached

    async def _connect(self, origin: _Origin) -> _Connection:
        loop = asyncio.get_running_loop()
        connection = _Connection(self, origin)
        scheme, hostname, port = origin
        tls = None
        if scheme == "https":
            if self._tls is None:
                self._tls = ssl.create_default_context()
            tls = self._tls
        try:
            await asyncio.wait_for(
                loop.create_connection(lambda: connection, hostname, port, ssl=tls,
                                       server_hostname=hostname if tls else None),
                self.connect_timeout)
        except asyncio.TimeoutError:
            raise ConnectTimeout("Connecting to the upstream timed out.") from None
        except OSError as exc:  # ssl.SSLError included
            raise ConnectFailed(f"Cannot connect to the upstream: {exc}") from None
        self._all.add(connection)
        return connection

    def _acquire(self, origin: _Origin) -> _Connection | None:
        idle = self._idle.get(origin)
        if not idle:
            return None
        now = time.monotonic()
        while idle:
            connection = idle.pop()  # the most recently used first
            self._n_idle -= 1
            since, connection.idle_since = connection.idle_since, None
            if connection.lost:
                continue
            if since is not None and now - since > MAX_IDLE_SECONDS:
                connection.close()
                continue
            return connection
        return None


class UpstreamRequest:
    __slots__ = ("method", "url", "content", "headers")

    def __init__(self, method: str, url: str, content: bytes, headers: dict[str, str]) -> None:
        self.method = method
        self.url = url
        self.content = content
        self.headers = headers


class UpstreamResponse:
    """An answer whose head came; its body is read with `aiter_raw` or `aread`, and
    `aclose` must follow (it closes the connection of an unfinished answer, which stops
    the upstream generating)."""

    def __init__(self, connection: _Connection, head: ResponseHead) -> None:
        self._connection = connection
        self.status_code = head.status
        self.headers = head.headers
        self._closed = False

    async def arrived(self, timeout: float | None) -> bool:
        """Whether more of the body (or its end, or an error) came within `timeout`
        seconds; at once when it already had.  No task of its own: the caller's wakes
        when the bytes come (for the first chunk of each answer, on the clock that
        counts the time to a client's first token)."""
        connection = self._connection
        if not (connection.body or connection.ended or connection.error is not None):
            await connection.wait(timeout)
        return bool(connection.body or connection.ended or connection.error is not None)

    def read(self) -> bytes | None:
        """The body's bytes that came since the last read, at once: b"" while nothing
        more came, None once the whole body was read; raises the error that came
        instead."""
        connection = self._connection
        if connection.body:
            return connection.take()
        if connection.ended:
            return None
        if connection.error is not None:
            raise connection.error
        return b""

    def unread(self, data: bytes) -> None:
        """Put `data` (read, not used) back before the rest: the next read has it first."""
        if data:
            self._connection.body.appendleft(data)

    def on_arrival(self, callback: Callable[[], None] | None) -> None:
        """Have `callback` called, from the connection's own callbacks, each time more
        of the body (or its end, or an error) comes, instead of waking a reader; None
        goes back to readers.  It reads with `read` and must not raise."""
        self._connection.on_arrival = callback

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        connection = self._connection
        while True:
            data = self.read()
            if data is None:
                return
            if data:
                yield data
            else:
                await connection.wait()

    async def aread(self) -> bytes:
        return b"".join([chunk async for chunk in self.aiter_raw()])

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        connection = self._connection
        if connection.ended and connection.keep_alive and not connection.lost:
            connection.pool.release(connection)
        else:
            connection.close()  # unfinished: the upstream stops generating


# --- helpers -----------------------------------------------------------------------------


class _Connection(asyncio.Protocol):
    """One keep-alive connection: feeds each answer's bytes to a `ResponseParser` and
    keeps what came for the answer's reader."""

    def __init__(self, pool: UpstreamClient, origin: _Origin) -> None:
        self.pool = pool
        self.origin = origin
        self.requests = 0
        self.lost = False
        #: When it went back to the pool; None while in use.
        self.idle_since: float | None = None
        self._transport: asyncio.Transport | None = None
        self._waiter: asyncio.Future[None] | None = None
        #: Called instead of waking a waiter when more came (see `UpstreamResponse.on_arrival`).
        self.on_arrival: Callable[[], None] | None = None
        self._paused = False
        # The answer being read (`_parser` is None while none is expected):
        self._parser: ResponseParser | None = None
        self.head: ResponseHead | None = None
        self.body: deque[bytes] = deque()
        self._buffered = 0
        self.ended = False
        self.keep_alive = False
        self.error: UpstreamError | None = None
        #: Whether any byte came back since the request was sent.
        self.received = False

    # --- the answer's reader -------------------------------------------------------------

    def start(self, payload: bytes) -> None:
        """Send a request; its answer is read from now on."""
        self.requests += 1
        self.head = None
        self.ended = False
        self.keep_alive = False
        self.error = None
        self.received = False
        if self.lost or self._transport is None:  # it ended while being connected
            self._parser = None
            self.error = ConnectionLost("The upstream closed the connection.")
            return
        self._parser = ResponseParser()
        self._transport.write(payload)

    async def answer_head(self) -> ResponseHead:
        """The answer's head, once it came; raises the error that came instead."""
        while self.head is None:
            if self.error is not None:
                raise self.error
            await self.wait()
        return self.head

    async def wait(self, timeout: float | None = None) -> None:
        """Until something more came (events, an error, the end of the connection), or
        `timeout` seconds passed."""
        loop = asyncio.get_running_loop()
        self._waiter = waiter = loop.create_future()
        timer = None if timeout is None else loop.call_later(timeout, _resolve, waiter)
        try:
            await waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()

    def take(self) -> bytes:
        """The body bytes that came since the last call."""
        body = self.body
        data = body.popleft() if len(body) == 1 else b"".join(body)
        body.clear()
        self._buffered = 0
        if self._paused:
            self._resume()
        return data

    def rest(self) -> None:
        """Back in the pool: what was not read of the answer is dropped."""
        self.body.clear()
        self._buffered = 0
        if self._paused:
            self._resume()
        self.idle_since = time.monotonic()

    def close(self) -> None:
        self.keep_alive = False
        if self._transport is not None:
            self._transport.close()

    # --- asyncio.Protocol ----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # a stream's, from create_connection
        send_at_once(transport)

    def data_received(self, data: bytes) -> None:
        self.received = True
        parser = self._parser
        if parser is None:  # nothing was asked: the connection is unusable
            self.close()
            return
        try:
            for event in parser.feed(data):
                if type(event) is bytes:
                    self.body.append(event)
                    self._buffered += len(event)
                elif isinstance(event, EndOfMessage):
                    self._parser = None
                    self.ended = True
                    self.keep_alive = event.keep_alive
                elif isinstance(event, ResponseHead):
                    self.head = event
        except MalformedAnswer as error:
            self._parser = None
            self.error = error
            self.close()
        if self._buffered > HIGH_WATER and not self._paused and self._transport is not None:
            self._paused = True
            self._transport.pause_reading()
        self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.pool.forget(self)
        parser, self._parser = self._parser, None
        if parser is not None:
            try:
                for event in parser.feed_eof():  # the end of a body delimited by the close
                    if isinstance(event, EndOfMessage):
                        self.ended = True
                        self.keep_alive = event.keep_alive
            except ConnectionLost as error:
                self.error = error
        self._wake()

    def _wake(self) -> None:
        if self.on_arrival is not None:
            self.on_arrival()
            return
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _resume(self) -> None:
        self._paused = False
        if not self.lost and self._transport is not None:
            self._transport.resume_reading()


def _resolve(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)
