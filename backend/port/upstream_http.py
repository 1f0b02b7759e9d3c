"""A lean HTTP/1.1 client for the gateway's upstream leg (llama-server on loopback/LAN).

Only what `backend.port.relay.Exchange` uses of httpx: `build_request`, `send(stream=True)`,
and a response with `status_code`, `headers.get`, `aiter_raw`, `aread`, `aclose`; errors
are httpx's own exception types, so the relay's `except httpx.HTTPError` still holds.

Why not httpx here: per relayed chunk httpx goes through httpcore, h11 and anyio (a
cancel scope and two epoll_ctl calls per read), and per request httpcore's pool walks
every pooled connection, polling each idle socket and counting the pool again for each
idle one (O(connections^2)).  This client is one asyncio.Protocol per connection: a
chunk costs one `data_received`, a chunked-decoding step and one future; the pool is a
LIFO list of idle connections per origin, and a connection the server closed leaves it
from `connection_lost`, without any per-request syscall.  A request on a reused
connection that the server closed as it arrived (llama-server and uvicorn close idle
ones after 5 s, httpx's own expiry) is sent once more on a new connection, when nothing
at all came back; httpx answers that race with an error, which the port turned into 502.

Parsing is strict (RFC 9112): status and header lines, hex-only chunk sizes, the CRLF
after chunk data, a single `chunked` as the only Transfer-Encoding, one digits-only
Content-Length; interim 1xx heads are skipped in a loop.  Anything else raises
`MalformedAnswer` and closes the connection, which is never reused.

Why not aiohttp's client (llhttp): measured against this one in one run it is no faster,
and it takes 12 of the 38 malformed answers of `bench/strictness.py` (see bench/README.md).
"""

from __future__ import annotations

import asyncio
import re
import ssl
import time
from collections import deque
from typing import AsyncIterator
from urllib.parse import urlsplit

import httpx

__all__ = ["MalformedAnswer", "UpstreamClient", "UpstreamResponse"]

#: Upstream bytes buffered for a slow client before reading from the upstream pauses.
HIGH_WATER = 256 * 1024
#: An idle connection older than this is closed instead of reused (servers close theirs
#: after a few seconds anyway; this guards against ones that vanished silently).
MAX_IDLE_SECONDS = 30.0
MAX_HEAD = 64 * 1024
#: The largest chunk size accepted (a bigger one is a malformed or hostile answer).
MAX_CHUNK = 1 << 62

# RFC 9112: status-line = HTTP-version SP 3DIGIT SP [reason-phrase]; the SP before an
# empty reason is often left out, and accepted.  field-line = token ":" OWS value OWS.
# (No regex with nested repetition here: those backtrack quadratically on hostile input.)
_STATUS_LINE = re.compile(rb"HTTP/1\.([01]) ([1-5][0-9][0-9])(?: [\t\x20-\x7e\x80-\xff]*)?")
_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_NOT_FIELD_TEXT = re.compile(rb"[^\t\x20-\x7e\x80-\xff]")
_HEX_DIGITS = b"0123456789abcdefABCDEF"
_CRLF = b"\r\n"


class MalformedAnswer(httpx.RemoteProtocolError):
    """The upstream's answer broke HTTP/1.1 (its connection is closed, never reused)."""


class _Request:
    __slots__ = ("method", "url", "content", "headers")

    def __init__(self, method: str, url: str, content: bytes, headers: dict[str, str]) -> None:
        self.method = method
        self.url = url
        self.content = content
        self.headers = headers


class _Connection(asyncio.Protocol):
    """One keep-alive connection; parses one response at a time."""

    def __init__(self, client: "UpstreamClient", key: tuple[str, str, int]) -> None:
        self.client = client
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.lost = False
        self.idle = False
        self.idle_since = 0.0
        self.requests = 0
        self._waiter: asyncio.Future | None = None
        self._reset()

    def _reset(self) -> None:
        self.head = b""
        self.in_head = True
        self.status = 0
        self.headers: dict[str, str] = {}
        self.chunked = False
        self.remaining: int | None = None
        self.need = 0
        self.skip = 0
        self.trailer = False
        self.raw = b""
        self.body: deque[bytes] = deque()
        self.buffered = 0
        self.received = False
        self.complete = False
        self.error: str | None = None
        self.malformed = False
        self.keep_alive = True
        self.paused = False

    # --- asyncio.Protocol ----------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.received = True
        if self.idle or self.complete:  # nothing was asked: the connection is unusable
            self.keep_alive = False
            self.transport.close()
            return
        if self.in_head:
            data = self.head + data if self.head else data
            pos = 0
            while True:  # interim 1xx heads (100 Continue, 103 Early Hints) are skipped
                end = data.find(b"\r\n\r\n", pos)
                if end < 0:
                    if len(data) - pos > MAX_HEAD:
                        self._fail("The upstream sent an oversized header.")
                        return
                    self.head = data[pos:]
                    return
                if not self._parse_head(data[pos:end]):
                    return
                pos = end + 4
                if self.status >= 200:
                    break
                self.headers = {}
            data = data[pos:]
            self.head = b""
            self.in_head = False
            if self.remaining == 0 or self.status in (204, 304):
                self.complete = True
        if data and not self.complete:
            if self.chunked:
                self._dechunk(data)
            elif self.remaining is not None:
                if len(data) >= self.remaining:
                    if len(data) > self.remaining:
                        self.keep_alive = False
                    data = data[:self.remaining]
                    self.complete = True
                self.remaining -= len(data)
                self._push(data)
            else:
                self._push(data)
        if self.buffered > HIGH_WATER and not self.paused:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.client._forget(self)
        if not self.complete and self.error is None:
            if not self.in_head and not self.chunked and self.remaining is None:
                self.complete = True  # a body delimited by the end of the connection
            else:
                self.error = "The upstream closed the connection."
        self._wake()

    # --- parsing -----------------------------------------------------------------------

    def _parse_head(self, head: bytes) -> bool:
        """Parse one response head strictly; anything off fails the connection.
        Sets `status`, `headers` (names in lower case; repeated ones joined by ", "),
        the body's framing (`chunked` or `remaining`) and `keep_alive`."""
        lines = head.split(b"\r\n")
        status = _STATUS_LINE.fullmatch(lines[0])
        if status is None:
            return self._fail("The upstream sent a malformed status line.")
        self.status = int(status.group(2))
        if self.status == 101:  # never asked for: the connection is not HTTP any more
            return self._fail("The upstream switched protocols unasked.")
        headers: dict[str, str] = {}
        lengths = 0
        for line in lines[1:]:
            field = _field(line)
            if field is None:  # no colon, a space before it, a folded line, a control byte
                return self._fail("The upstream sent a malformed header line.")
            name, value = field
            if name == "content-length":
                lengths += 1
            if name in headers:
                value = headers[name] + ", " + value
            headers[name] = value
        self.headers = headers
        if self.status < 200:
            return True
        self.chunked = False
        self.remaining = None
        transfer = headers.get("transfer-encoding")
        if transfer is not None:
            # Only `chunked`, once: no coding was asked for (Accept-Encoding: identity),
            # and any other list leaves the body's end unknown.
            codings = [token.strip().lower() for token in transfer.split(",")]
            if codings != ["chunked"] or lengths:
                return self._fail("The upstream sent an unsupported Transfer-Encoding.")
            self.chunked = True
        elif lengths:
            length = headers["content-length"]
            if lengths > 1 or not length.isdigit() or not length.isascii() or len(length) > 18:
                return self._fail("The upstream sent a malformed Content-Length.")
            self.remaining = int(length)
        connection = headers.get("connection", "").lower()
        if "close" in connection or (status.group(1) == b"0" and "keep-alive" not in connection):
            self.keep_alive = False
        if self.remaining is None and not self.chunked:
            self.keep_alive = False
        return True

    def _dechunk(self, data: bytes) -> None:
        buf = self.raw + data if self.raw else data
        pos, end = 0, len(buf)
        while pos < end:
            if self.need:
                take = self.need if self.need <= end - pos else end - pos
                self._push(buf[pos:pos + take] if (pos or take != end) else buf)
                pos += take
                self.need -= take
                if not self.need:
                    self.skip = 2
            elif self.skip:  # the CRLF that ends a chunk's data
                take = self.skip if self.skip <= end - pos else end - pos
                if buf[pos:pos + take] != _CRLF[2 - self.skip:2 - self.skip + take]:
                    self._fail("The upstream sent a chunk without its CRLF.")
                    return
                pos += take
                self.skip -= take
            else:
                eol = buf.find(b"\r\n", pos)
                if eol < 0:
                    if end - pos > 1024:
                        self._fail("The upstream sent a malformed chunk.")
                    break
                line = buf[pos:eol]
                pos = eol + 2
                if self.trailer:
                    if not line:
                        self.complete = True
                        if pos < end:
                            self.keep_alive = False
                        pos = end
                    elif _field(line) is None:
                        self._fail("The upstream sent a malformed trailer.")
                        return
                    continue
                # chunk-size [BWS ";" chunk-ext]: hex digits only (int() would also take
                # "0x10", "+10", " 10" and "1_0")
                digits = line.split(b";", 1)[0].rstrip(b" \t") if b";" in line else line
                if not digits or digits.strip(_HEX_DIGITS):
                    self._fail("The upstream sent a malformed chunk size.")
                    return
                size = int(digits, 16)
                if size > MAX_CHUNK:
                    self._fail("The upstream sent a malformed chunk size.")
                    return
                if size == 0:
                    self.trailer = True
                else:
                    self.need = size
        self.raw = buf[pos:] if pos < end else b""

    def _push(self, data: bytes) -> None:
        if data:
            self.body.append(data)
            self.buffered += len(data)

    def _fail(self, message: str) -> bool:
        """Fail this response; its connection is closed, never reused.  Returns False."""
        self.error = message
        self.malformed = True
        self.keep_alive = False
        if self.transport is not None:
            self.transport.close()
        return False

    # --- waiting -------------------------------------------------------------------------

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait(self) -> None:
        self._waiter = waiter = asyncio.get_running_loop().create_future()
        try:
            await waiter
        finally:
            self._waiter = None

    def take(self) -> bytes:
        body = self.body
        data = body.popleft() if len(body) == 1 else b"".join(body)
        body.clear()
        self.buffered = 0
        if self.paused and not self.lost:
            self.paused = False
            self.transport.resume_reading()
        return data

    def failure(self) -> httpx.RemoteProtocolError:
        if self.malformed:
            return MalformedAnswer(self.error or "The upstream sent a malformed answer.")
        return httpx.RemoteProtocolError(self.error or "The upstream closed the connection.")

    def close(self) -> None:
        self.keep_alive = False
        if self.transport is not None:
            self.transport.close()


def _field(line: bytes) -> tuple[str, str] | None:
    """(lower-case name, value) of a header line, or None if it is malformed."""
    name, colon, value = line.partition(b":")
    if not colon or _TOKEN.fullmatch(name) is None or _NOT_FIELD_TEXT.search(value):
        return None
    return name.lower().decode("ascii"), value.strip(b" \t").decode("latin-1")


class _Headers(dict):
    """Lower-case header names; `get` as httpx's."""

    def get(self, key: str, default: str | None = None) -> str | None:  # type: ignore[override]
        return super().get(key.lower(), default)


class UpstreamResponse:
    def __init__(self, conn: _Connection) -> None:
        self._conn = conn
        self.status_code = conn.status
        self.headers = _Headers(conn.headers)
        self._closed = False

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        conn = self._conn
        while True:
            if conn.body:
                yield conn.take()
            elif conn.complete:
                return
            elif conn.error is not None:
                raise conn.failure()
            else:
                await conn.wait()

    async def aread(self) -> bytes:
        return b"".join([chunk async for chunk in self.aiter_raw()])

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        conn = self._conn
        if conn.complete and conn.keep_alive and not conn.lost and conn.error is None:
            self._conn.client._release(conn)
        else:
            conn.close()  # unfinished: the upstream stops generating


class UpstreamClient:
    def __init__(self, *, connect_timeout: float = 10.0, max_idle: int = 256) -> None:
        self.connect_timeout = connect_timeout
        self.max_idle = max_idle
        self._idle: dict[tuple[str, str, int], list[_Connection]] = {}
        self._n_idle = 0
        self._all: set[_Connection] = set()
        self._split: dict[str, tuple[tuple[str, str, int], bytes, bytes]] = {}
        self._tls: ssl.SSLContext | None = None  # made on the first https:// upstream

    def build_request(self, method: str, url: str, *, content: bytes = b"",
                      headers: dict[str, str] | None = None) -> _Request:
        return _Request(method, url, content, headers or {})

    def _target(self, url: str) -> tuple[tuple[str, str, int], bytes, bytes]:
        cached = self._split.get(url)
        if cached is None:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise httpx.UnsupportedProtocol(f"Not an http(s) URL: {url}")
            default = 443 if parts.scheme == "https" else 80
            port = parts.port or default
            path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            name = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
            host = name if port == default else f"{name}:{port}"
            cached = ((parts.scheme, parts.hostname, port), path.encode(), host.encode())
            if len(self._split) < 1024:
                self._split[url] = cached
        return cached

    async def send(self, request: _Request, *, stream: bool = True) -> UpstreamResponse:
        """Send `request`; returns once the response head arrived (the body is read with
        `aiter_raw`/`aread`, and `aclose` must follow).  Always streams."""
        key, path, host = self._target(request.url)
        head = [b"%s %s HTTP/1.1\r\nHost: %s\r\n" % (request.method.encode(), path, host)]
        for name, value in request.headers.items():
            head.append(b"%s: %s\r\n" % (name.encode("latin-1"), value.encode("latin-1")))
        head.append(b"Content-Length: %d\r\n\r\n" % len(request.content))
        payload = b"".join(head) + request.content
        for attempt in (0, 1):
            conn = self._acquire(key)
            reused = conn is not None
            if conn is None:
                conn = await self._connect(key)
            conn.requests += 1
            conn.transport.write(payload)
            try:
                while conn.in_head and conn.error is None and not conn.lost:
                    await conn.wait()
            except BaseException:
                conn.close()
                raise
            if conn.in_head:
                conn.close()
                # A kept-alive connection the server closed just as it was reused:
                # nothing was received, so the request was not processed. Once more.
                if reused and not conn.received and attempt == 0:
                    continue
                raise conn.failure()
            return UpstreamResponse(conn)
        raise AssertionError("unreachable")

    async def _connect(self, key: tuple[str, str, int]) -> _Connection:
        loop = asyncio.get_running_loop()
        conn = _Connection(self, key)
        scheme, hostname, port = key
        tls = None
        if scheme == "https":
            if self._tls is None:
                self._tls = ssl.create_default_context()
            tls = self._tls
        try:
            await asyncio.wait_for(
                loop.create_connection(lambda: conn, hostname, port, ssl=tls,
                                       server_hostname=hostname if tls else None),
                self.connect_timeout)
        except asyncio.TimeoutError:
            raise httpx.ConnectTimeout("Connecting to the upstream timed out.") from None
        except OSError as exc:  # ssl.SSLError included
            raise httpx.ConnectError(f"Cannot connect to the upstream: {exc}") from None
        self._all.add(conn)
        return conn

    def _acquire(self, key: tuple[str, str, int]) -> _Connection | None:
        idle = self._idle.get(key)
        if not idle:
            return None
        now = time.monotonic()
        while idle:
            conn = idle.pop()  # the most recently used first
            self._n_idle -= 1
            conn.idle = False
            if conn.lost:
                continue
            if now - conn.idle_since > MAX_IDLE_SECONDS:
                conn.close()
                continue
            conn._reset()
            return conn
        return None

    def _release(self, conn: _Connection) -> None:
        if self._n_idle >= self.max_idle:
            conn.close()
            return
        conn.idle = True
        conn.idle_since = time.monotonic()
        self._idle.setdefault(conn.key, []).append(conn)
        self._n_idle += 1

    def _forget(self, conn: _Connection) -> None:
        self._all.discard(conn)
        if conn.idle:
            conn.idle = False
            idle = self._idle.get(conn.key)
            if idle and conn in idle:
                idle.remove(conn)
                self._n_idle -= 1

    def pooled(self) -> int:
        """Idle connections kept for reuse."""
        return self._n_idle

    async def aclose(self) -> None:
        for conn in list(self._all):
            conn.close()
        self._idle.clear()
        self._n_idle = 0
