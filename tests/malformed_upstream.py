"""An upstream on a raw asyncio socket that answers with exactly the bytes it is given.

It exists because neither a real llama-server nor `tests/fake_upstream.py` (Starlette
behind uvicorn, whose HTTP writer is correct) can send a malformed HTTP answer: bad chunk
sizes, a chunk without its CRLF, odd `Transfer-Encoding`s, conflicting `Content-Length`s,
hundreds of 1xx heads, broken status lines.  Each request (head and `Content-Length`
body read in full) gets the next answer of `answers`, or `fallback` once they run out;
the connection stays open afterwards, so that a client which wrongly reuses it is seen
in `requests` (the connection number of every request).
"""

from __future__ import annotations

import asyncio
from typing import Any

__all__ = ["MalformedUpstream", "GOOD_EVENTS", "GOOD_STREAM", "good_json"]

GOOD_EVENTS = (b'data: {"choices":[{"delta":{"content":"ok"}}]}\n\n', b"data: [DONE]\n\n")
GOOD_STREAM = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
               b"Transfer-Encoding: chunked\r\n\r\n"
               + b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in GOOD_EVENTS) + b"0\r\n\r\n")


def good_json(body: bytes = b'{"object":"chat.completion","choices":[]}') -> bytes:
    return (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body))


class MalformedUpstream:
    def __init__(self, answers: list[bytes] | None = None, fallback: bytes = GOOD_STREAM) -> None:
        self.answers = list(answers or [])
        self.fallback = fallback
        self.connections = 0
        self.requests: list[int] = []  # the connection number of each request, from 1
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def base_url(self) -> str:
        assert self._server is not None
        port = self._server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def __aenter__(self) -> "MalformedUpstream":
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: Any) -> None:
        assert self._server is not None
        self._server.close()
        for writer in list(self._writers):
            writer.close()
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        number = self.connections
        self._writers.add(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                await reader.readexactly(length)
                self.requests.append(number)
                writer.write(self.answers.pop(0) if self.answers else self.fallback)
                await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass
        finally:
            self._writers.discard(writer)
            writer.close()
