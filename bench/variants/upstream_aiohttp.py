"""The upstream leg's client on aiohttp, with `backend.port.upstream_http.UpstreamClient`'s
interface: `build_request`, `send(stream=True)`, a response with `status_code`,
`headers.get`, `aiter_raw`, `aread`, `aclose`; errors are that module's `UpstreamError`s,
so `backend.port.relay` needs no change.

It exists to measure aiohttp's client (its llhttp-based C parser) against the
hand-written one: speed with `bench/relay.py --aiohttp`, strictness with
`bench/strictness.py` (see bench/README.md for why the port keeps its own client).
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

import aiohttp

from backend.port.upstream_errors import (ConnectFailed, ConnectionLost, ConnectTimeout,
                                          MalformedAnswer, UnsupportedURL)

__all__ = ["AiohttpUpstreamClient", "AiohttpUpstreamResponse"]

#: Upstream bytes buffered for a slow client before reading from the upstream pauses
#: (aiohttp pauses the socket at twice this).
READ_BUFSIZE = 128 * 1024
MAX_IDLE_SECONDS = 30.0


class _Request:
    __slots__ = ("method", "url", "content", "headers")

    def __init__(self, method: str, url: str, content: bytes, headers: dict[str, str]) -> None:
        self.method = method
        self.url = url
        self.content = content
        self.headers = headers


class AiohttpUpstreamResponse:
    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response
        self.status_code = response.status
        self.headers = response.headers  # a case-insensitive multidict: `get` as ours
        self._closed = False

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        content = self._response.content
        try:
            while True:
                data = await content.readany()
                if not data:
                    return
                yield data
        except aiohttp.ClientError as exc:
            raise ConnectionLost(_say(exc)) from None

    async def aread(self) -> bytes:
        return b"".join([chunk async for chunk in self.aiter_raw()])

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        response = self._response
        if response.content.at_eof() and response.content.exception() is None:
            response.release()  # back to the pool, if the server keeps it alive
        else:
            response.close()  # unfinished: the upstream stops generating


class AiohttpUpstreamClient:
    def __init__(self, *, connect_timeout: float = 10.0, max_idle: int = 256) -> None:
        self.connect_timeout = connect_timeout
        self.max_idle = max_idle
        self._session: aiohttp.ClientSession | None = None

    def build_request(self, method: str, url: str, *, content: bytes = b"",
                      headers: dict[str, str] | None = None) -> _Request:
        return _Request(method, url, content, headers or {})

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(limit=0, limit_per_host=0,
                                             keepalive_timeout=MAX_IDLE_SECONDS)
            timeout = aiohttp.ClientTimeout(total=None, connect=self.connect_timeout)
            self._session = aiohttp.ClientSession(
                connector=connector, timeout=timeout, auto_decompress=False,
                trust_env=False, cookie_jar=aiohttp.DummyCookieJar(),
                read_bufsize=READ_BUFSIZE, skip_auto_headers=("User-Agent",))
        return self._session

    async def send(self, request: _Request, *, stream: bool = True) -> AiohttpUpstreamResponse:
        session = self._open()
        try:
            response = await session.request(request.method, request.url,
                                             data=request.content, headers=request.headers)
        except aiohttp.InvalidURL as exc:
            raise UnsupportedURL(_say(exc)) from None
        except (aiohttp.ConnectionTimeoutError, asyncio.TimeoutError):
            raise ConnectTimeout("Connecting to the upstream timed out.") from None
        except aiohttp.ClientConnectorError as exc:
            raise ConnectFailed(f"Cannot connect to the upstream: {_say(exc)}") from None
        except aiohttp.ClientResponseError as exc:  # the parser refused the head
            raise MalformedAnswer(_say(exc)) from None
        except aiohttp.ClientError as exc:
            raise ConnectionLost(_say(exc)) from None
        return AiohttpUpstreamResponse(response)

    def pooled(self) -> int:
        """Idle connections kept for reuse."""
        connector = self._session.connector if self._session is not None else None
        if connector is None:
            return 0
        return sum(len(idle) for idle in connector._conns.values())  # noqa: SLF001

    async def aclose(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()


def _say(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
