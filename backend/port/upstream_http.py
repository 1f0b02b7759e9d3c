"""The gateway's own HTTP/1.1 client for its upstream leg (llama-server on loopback/LAN).

Three parts, in h11's style:

- `ResponseParser`, sans-I/O: the bytes of one answer in (`feed`, `feed_eof`), events out
  (`ResponseHead`, body `bytes`, `EndOfMessage`).  Strict (RFC 9112): status and header
  lines, hex-only chunk sizes, the CRLF after chunk data, a single `chunked` as the only
  Transfer-Encoding, one digits-only Content-Length; interim 1xx heads are checked and
  skipped.  Anything else raises `MalformedAnswer`, after the events of the bytes before.
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
this module's own `UpstreamError`s, declared here beside the code that raises them (their
messages are for logs, not for clients: the relay translates them); `ConnectFailed` means
that nothing was sent.

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
import re
import ssl
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TypeAlias, cast
from urllib.parse import urlsplit

from backend.port.tcp_nodelay import send_at_once

__all__ = [
    "ConnectFailed", "ConnectTimeout", "ConnectionLost", "EndOfMessage", "Event", "Headers",
    "MalformedAnswer", "ResponseHead", "ResponseParser", "UnsupportedURL", "UpstreamClient",
    "UpstreamError", "UpstreamRequest", "UpstreamResponse",
]

#: Upstream bytes buffered for a slow client before reading from the upstream pauses.
HIGH_WATER = 256 * 1024
#: An idle connection older than this is closed instead of reused (servers close theirs
#: after a few seconds anyway; this guards against ones that vanished silently).
MAX_IDLE_SECONDS = 30.0
MAX_HEAD = 64 * 1024
#: The largest chunk size accepted (a bigger one is a malformed or hostile answer).
MAX_CHUNK = 1 << 62
#: The longest chunk-size or trailer line accepted.
MAX_CHUNK_LINE = 1024

# RFC 9112: status-line = HTTP-version SP 3DIGIT SP [reason-phrase]; the SP before an
# empty reason is often left out, and accepted.  field-line = token ":" OWS value OWS.
# (No regex with nested repetition here: those backtrack quadratically on hostile input.)
_STATUS_LINE = re.compile(rb"HTTP/1\.([01]) ([1-5][0-9][0-9])(?: [\t\x20-\x7e\x80-\xff]*)?")
_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_NOT_FIELD_TEXT = re.compile(rb"[^\t\x20-\x7e\x80-\xff]")
_HEX_DIGITS = b"0123456789abcdefABCDEF"
_CRLF = b"\r\n"

# Where a parser is in its answer.
_HEAD, _CHUNK_SIZE, _CHUNK_DATA, _CHUNK_CRLF, _TRAILER, _SIZED, _UNTIL_CLOSE, _DONE = range(8)

#: (scheme, host, port): the connections to one origin are interchangeable.
_Origin: TypeAlias = tuple[str, str, int]


# --- errors ------------------------------------------------------------------------------


class UpstreamError(Exception):
    """The exchange with the upstream failed; `str()` says how (for logs, not clients)."""


class UnsupportedURL(UpstreamError):
    """Not an http(s) URL with a host: nothing was sent."""


class ConnectFailed(UpstreamError):
    """No connection could be made: nothing of the request was sent, so it may be sent
    again, here or elsewhere."""


class ConnectTimeout(ConnectFailed):
    """Connecting took longer than the client's connect timeout."""


class MalformedAnswer(UpstreamError):
    """The upstream's answer broke HTTP/1.1 (its connection is closed, never reused), or
    was not the answer asked for."""


class ConnectionLost(UpstreamError):
    """The connection ended before the answer did."""


# --- events ------------------------------------------------------------------------------


class Headers(Mapping[str, str]):
    """An answer's header fields; names are case-insensitive, repeated ones joined by ", "."""

    __slots__ = ("_fields",)

    def __init__(self, fields: dict[str, str]) -> None:
        self._fields = fields  # lower-case names

    def __getitem__(self, name: str) -> str:
        return self._fields[name.lower()]

    def __iter__(self) -> Iterator[str]:
        return iter(self._fields)

    def __len__(self) -> int:
        return len(self._fields)

    def __repr__(self) -> str:
        return f"Headers({self._fields!r})"


@dataclass(frozen=True, slots=True)
class ResponseHead:
    """The final (non-1xx) status line and header fields of an answer."""

    status: int
    headers: Headers


@dataclass(frozen=True, slots=True)
class EndOfMessage:
    """The answer is complete.  `keep_alive`: the connection may carry the next request
    (False after `Connection: close`, HTTP/1.0, a body ended by the close, or bytes
    after the answer's end)."""

    keep_alive: bool


#: Body bytes come as `bytes` (transfer coding removed), not wrapped like h11's `Data`:
#: an object per relayed chunk costs about a microsecond here, against ~5 µs of the
#: port's whole CPU per chunk at saturation (bench/README.md).
Event: TypeAlias = ResponseHead | bytes | EndOfMessage


# --- the parser --------------------------------------------------------------------------


class ResponseParser:
    """The bytes of one HTTP/1.1 answer in, its events out; no I/O.

    `feed(data)` gives the events `data` completes, in order: one `ResponseHead`, body
    `bytes`, one `EndOfMessage`; bytes that break HTTP/1.1 raise `MalformedAnswer` once
    the events before them are taken.  The parser moves on as the events are taken:
    take them all before feeding more.  `feed_eof()` says that the connection ended.
    One parser per answer (the client never pipelines)."""

    def __init__(self) -> None:
        self._state = _HEAD
        self._rest = b""  # bytes of an unfinished head, chunk-size or trailer line
        self._scanned = 0  # how far into `_rest` no head end was found
        self._left = 0  # bytes of the body, of the chunk, or of its CRLF still to come
        self._keep_alive = True

    @property
    def done(self) -> bool:
        return self._state == _DONE

    def feed(self, data: bytes) -> Iterator[Event]:
        if self._rest:
            data = self._rest + data
            self._rest = b""
        end = len(data)
        pos = 0
        state = self._state
        if state == _HEAD:
            found = self._final_head(data)
            if found is None:
                return
            head, pos = found
            yield head
            state = self._state
            if state == _DONE:
                yield EndOfMessage(self._keep_alive and pos == end)
                return
        elif state == _DONE:
            raise MalformedAnswer("The upstream sent bytes after its answer.")
        left = self._left
        try:
            while pos < end:
                if state == _CHUNK_DATA or state == _SIZED:
                    take = left if left <= end - pos else end - pos
                    piece = data if take == end else data[pos:pos + take]
                    pos += take
                    left -= take
                    if left:
                        yield piece
                    elif state == _CHUNK_DATA:
                        state, left = _CHUNK_CRLF, 2
                        yield piece
                    else:
                        state = _DONE
                        yield piece
                        yield EndOfMessage(self._keep_alive and pos == end)
                        break
                elif state == _CHUNK_CRLF:  # the CRLF that ends a chunk's data
                    take = left if left <= end - pos else end - pos
                    if data[pos:pos + take] != _CRLF[2 - left:2 - left + take]:
                        raise MalformedAnswer("The upstream sent a chunk without its CRLF.")
                    pos += take
                    left -= take
                    if not left:
                        state = _CHUNK_SIZE
                elif state == _CHUNK_SIZE:
                    eol = data.find(b"\r\n", pos)
                    if eol < 0:
                        _check_line_length(end - pos)
                        break
                    # chunk-size [BWS ";" chunk-ext]: hex digits only (int() would also
                    # take "0x10", "+10", " 10" and "1_0")
                    digits = data[pos:eol]
                    if b";" in digits:
                        digits = digits.split(b";", 1)[0].rstrip(b" \t")
                    if not digits or digits.strip(_HEX_DIGITS):
                        raise MalformedAnswer("The upstream sent a malformed chunk size.")
                    left = int(digits, 16)
                    if left > MAX_CHUNK:
                        raise MalformedAnswer("The upstream sent a malformed chunk size.")
                    pos = eol + 2
                    state = _CHUNK_DATA if left else _TRAILER
                elif state == _TRAILER:
                    eol = data.find(b"\r\n", pos)
                    if eol < 0:
                        _check_line_length(end - pos)
                        break
                    line = data[pos:eol]
                    pos = eol + 2
                    if line and _field(line) is None:
                        raise MalformedAnswer("The upstream sent a malformed trailer.")
                    if not line:
                        state = _DONE
                        yield EndOfMessage(self._keep_alive and pos == end)
                        break
                else:  # _UNTIL_CLOSE
                    piece = data if pos == 0 else data[pos:]
                    pos = end
                    yield piece
        finally:
            self._state = state
            self._left = left
            if state != _DONE and pos < end:
                self._rest = data[pos:]

    def feed_eof(self) -> list[Event]:
        """The connection ended: the end of a body delimited by it, else `ConnectionLost`
        (no event once the answer is complete)."""
        if self._state == _UNTIL_CLOSE:
            self._state = _DONE
            return [EndOfMessage(False)]
        if self._state != _DONE:
            raise ConnectionLost("The upstream closed the connection.")
        return []

    # --- the head ------------------------------------------------------------------------

    def _final_head(self, data: bytes) -> tuple[ResponseHead, int] | None:
        """The final head in `data` and where its blank line ends, interim 1xx heads
        before it checked and skipped; None while it has not all come (kept for later)."""
        pos = 0
        scanned, self._scanned = self._scanned, 0
        while True:
            end = data.find(b"\r\n\r\n", max(pos, scanned))
            if end < 0:
                if len(data) - pos > MAX_HEAD:
                    raise MalformedAnswer("The upstream sent an oversized header.")
                self._rest = data[pos:]
                self._scanned = max(len(self._rest) - 3, 0)
                return None
            status, fields, version, lengths = _parse_head(data[pos:end])
            pos = end + 4
            if status >= 200:
                head = ResponseHead(status, Headers(fields))
                self._frame(head, version, lengths)
                return head, pos

    def _frame(self, head: ResponseHead, version: bytes, lengths: int) -> None:
        """How the body after `head` ends (and whether the connection stays open)."""
        transfer = head.headers.get("transfer-encoding")
        if transfer is not None:
            # Only `chunked`, once: no coding was asked for (Accept-Encoding: identity),
            # and any other list leaves the body's end unknown.
            codings = [token.strip().lower() for token in transfer.split(",")]
            if codings != ["chunked"] or lengths:
                raise MalformedAnswer("The upstream sent an unsupported Transfer-Encoding.")
            self._state = _CHUNK_SIZE
        elif lengths:
            length = head.headers["content-length"]
            if lengths > 1 or not length.isdigit() or not length.isascii() or len(length) > 18:
                raise MalformedAnswer("The upstream sent a malformed Content-Length.")
            self._left = int(length)
            self._state = _SIZED if self._left else _DONE
        else:
            self._state = _UNTIL_CLOSE
            self._keep_alive = False
        if head.status in (204, 304):  # no body, whatever the framing fields say
            self._state = _DONE
        connection = head.headers.get("connection", "").lower()
        if "close" in connection or (version == b"0" and "keep-alive" not in connection):
            self._keep_alive = False


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


def _parse_head(head: bytes) -> tuple[int, dict[str, str], bytes, int]:
    """One head (status line and field lines, no blank line), strictly: its status, its
    fields (lower-case names), its HTTP minor version (b"0" or b"1") and how many
    Content-Length fields it had."""
    lines = head.split(b"\r\n")
    status_line = _STATUS_LINE.fullmatch(lines[0])
    if status_line is None:
        raise MalformedAnswer("The upstream sent a malformed status line.")
    status = int(status_line.group(2))
    if status == 101:  # never asked for: the connection is not HTTP any more
        raise MalformedAnswer("The upstream switched protocols unasked.")
    fields: dict[str, str] = {}
    lengths = 0
    for line in lines[1:]:
        field = _field(line)
        if field is None:  # no colon, a space before it, a folded line, a control byte
            raise MalformedAnswer("The upstream sent a malformed header line.")
        name, value = field
        if name == "content-length":
            lengths += 1
        if name in fields:
            value = fields[name] + ", " + value
        fields[name] = value
    return status, fields, status_line.group(1), lengths


def _field(line: bytes) -> tuple[str, str] | None:
    """(lower-case name, value) of a header line, or None if it is malformed."""
    name, colon, value = line.partition(b":")
    if not colon or _TOKEN.fullmatch(name) is None or _NOT_FIELD_TEXT.search(value):
        return None
    return name.lower().decode("ascii"), value.strip(b" \t").decode("latin-1")


def _check_line_length(length: int) -> None:
    """An unfinished chunk-size or trailer line may not grow past MAX_CHUNK_LINE."""
    if length > MAX_CHUNK_LINE:
        raise MalformedAnswer("The upstream sent a malformed chunk.")
