"""An upstream on a raw asyncio socket that answers with exactly the bytes it is given.

It exists because neither a real llama-server nor `tests/fake_upstream.py` (Starlette
behind uvicorn, whose HTTP writer is correct) can send a malformed HTTP answer: bad chunk
sizes, a chunk without its CRLF, odd `Transfer-Encoding`s, conflicting `Content-Length`s,
hundreds of 1xx heads, broken status lines.  Each request (head and `Content-Length`
body read in full) gets the next answer of `answers`, or `fallback` once they run out;
the connection stays open afterwards (unless the answer is a `Cut`), so that a client
which wrongly reuses it is seen in `requests` (the connection number of every request).
With `answers_per_connection`, a connection that gave that many answers is closed as its
next request arrives, every connection alike (llama-server closes its connection after
each streamed answer without a `Connection: close`: a client reusing it sees it end).
"""

from __future__ import annotations

import asyncio
from typing import Any

__all__ = ["CLOSE", "DATA16", "GOOD_EVENTS", "GOOD_STREAM", "INTERIM", "MALFORMED", "WELL_FORMED",
           "Cut", "MalformedUpstream", "chunked", "good_json", "sized"]

#: An answer that is no answer: the connection is closed as the request arrives (a server
#: closing an idle keep-alive connection just as the client reuses it).
CLOSE = b""


class Cut(bytes):
    """An answer after which the connection is closed (a killed engine: the bytes it
    wrote arrive, then the end of the connection)."""


GOOD_EVENTS = (b'data: {"choices":[{"delta":{"content":"ok"}}]}\n\n', b"data: [DONE]\n\n")
GOOD_STREAM = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
               b"Transfer-Encoding: chunked\r\n\r\n"
               + b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in GOOD_EVENTS) + b"0\r\n\r\n")


def good_json(body: bytes = b'{"object":"chat.completion","choices":[]}') -> bytes:
    return (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body))


def chunked(*body: bytes, te: bytes = b"chunked", extra: bytes = b"") -> bytes:
    return (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: " + te + b"\r\n" + extra + b"\r\n" + b"".join(body))


def sized(*lengths: bytes, body: bytes = b"hello", status: bytes = b"HTTP/1.1 200 OK") -> bytes:
    head = status + b"\r\nContent-Type: application/json\r\n"
    head += b"".join(b"Content-Length: " + n + b"\r\n" for n in lengths)
    return head + b"\r\n" + body


DATA16 = b"data: 01234567\n\n"  # 16 bytes: chunk size 10
MALFORMED = {
    # chunk sizes are hex digits only
    "chunk size 0x10": chunked(b"0x10\r\n", DATA16, b"\r\n0\r\n\r\n"),
    "chunk size +10": chunked(b"+10\r\n", DATA16, b"\r\n0\r\n\r\n"),
    "chunk size ' 10'": chunked(b" 10\r\n", DATA16, b"\r\n0\r\n\r\n"),
    "chunk size 1_0": chunked(b"1_0\r\n", DATA16, b"\r\n0\r\n\r\n"),
    "chunk size -1": chunked(b"-1\r\n", DATA16, b"\r\n0\r\n\r\n"),
    "chunk size empty": chunked(b"\r\n", DATA16, b"\r\n0\r\n\r\n"),
    "chunk size beyond 64 bits": chunked(b"10000000000000000\r\n", DATA16, b"\r\n0\r\n\r\n"),
    # the CRLF after chunk data is checked
    "chunk data without CRLF": chunked(b"10\r\n", DATA16, b"XX0\r\n\r\n"),
    "chunk data with a bare LF": chunked(b"10\r\n", DATA16, b"\n0\r\n\r\n"),
    # Transfer-Encoding parsed as tokens
    "TE chunked, gzip": chunked(b"10\r\n", DATA16, b"\r\n0\r\n\r\n", te=b"chunked, gzip"),
    "TE xchunked": chunked(b"10\r\n", DATA16, b"\r\n0\r\n\r\n", te=b"xchunked"),
    "TE gzip": chunked(DATA16, te=b"gzip"),
    "TE chunked twice": chunked(b"10\r\n", DATA16, b"\r\n0\r\n\r\n",
                                extra=b"Transfer-Encoding: chunked\r\n"),
    "TE and Content-Length": chunked(b"10\r\n", DATA16, b"\r\n0\r\n\r\n",
                                     extra=b"Content-Length: 21\r\n"),
    # duplicate or conflicting Content-Length
    "Content-Length twice": sized(b"5", b"5"),
    "Content-Length conflicting": sized(b"5", b"6"),
    "Content-Length list": sized(b"5, 5"),
    "Content-Length +5": sized(b"+5"),
    "Content-Length 0x5": sized(b"0x5"),
    "Content-Length -1": sized(b"-1"),
    # status lines
    "status 2000": sized(b"5", status=b"HTTP/1.1 2000 OK"),
    "status 20": sized(b"5", status=b"HTTP/1.1 20 OK"),
    "status +20": sized(b"5", status=b"HTTP/1.1 +20 OK"),
    "status 600": sized(b"5", status=b"HTTP/1.1 600 Odd"),
    "status 099": sized(b"5", status=b"HTTP/1.1 099 Odd"),
    "version HTTX/1.1": sized(b"5", status=b"HTTX/1.1 200 OK"),
    "version HTTP/2.0": sized(b"5", status=b"HTTP/2.0 200 OK"),
    "no status line": b"hello\r\n\r\n",
    "unasked 101 Switching Protocols": b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\n\r\n",
    # header lines
    "space before colon": sized(b"5").replace(b"Content-Length:", b"Content-Length :"),
    "obsolete line folding": sized(b"5").replace(b"Content-Type: application/json\r\n",
                                                 b"Content-Type: application/json\r\n x\r\n"),
    "header line without colon": sized(b"5").replace(b"\r\n\r\n", b"\r\nbroken\r\n\r\n"),
}
#: Interim heads before a good answer: skipped, the connection kept.
INTERIM = {
    "100 then 103": b"HTTP/1.1 100 Continue\r\n\r\n"
                    b"HTTP/1.1 103 Early Hints\r\nLink: </a>; rel=preload\r\n\r\n",
    "3000 interim heads": b"HTTP/1.1 100 Continue\r\n\r\n" * 3000,
}
#: The well-formed twins of the malformed answers (so those fail for the right reason).
WELL_FORMED = {
    "chunked": chunked(b"10;x=1\r\n", DATA16, b"\r\n0\r\nX-T: 1\r\n\r\n"),
    "sized": sized(b"5"),
    "sized with spaces around the length": sized(b" 5 "),
}


class MalformedUpstream:
    def __init__(self, answers: list[bytes] | None = None, fallback: bytes = GOOD_STREAM,
                 answers_per_connection: int = 0) -> None:
        self.answers = list(answers or [])
        self.fallback = fallback
        self.answers_per_connection = answers_per_connection
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
        answered = 0
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
                if self.answers_per_connection and answered >= self.answers_per_connection:
                    break
                answer = self.answers.pop(0) if self.answers else self.fallback
                if answer == CLOSE:
                    break
                answered += 1
                writer.write(answer)
                await writer.drain()
                if isinstance(answer, Cut):
                    break
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass
        finally:
            self._writers.discard(writer)
            writer.close()
