"""The relay benchmark's load generator: a lean asyncio HTTP/1.1 client, the same code for
every target.  One `asyncio.Protocol` per stream over its own connection; it counts
content chunks and notes the time to the first one.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from bench.processes import HOST, Target, cpu_times

CHAT = "/v1/chat/completions"

CONTENT = b'"content":"'
EMPTY_CONTENT = b'"content":""'


class StreamClient(asyncio.Protocol):
    """One streamed request over its own connection: HTTP/1.1, chunked or not.

    Counts content chunks (SSE events carrying a non-empty `"content":"…"`), and notes
    when the request was written, when the first content chunk arrived and when the
    answer ended.  Whole events only: bytes after the last blank line wait for the next
    read.
    """

    def __init__(self, request: bytes, done: asyncio.Future) -> None:
        self.request = request
        self.done = done
        self.transport: asyncio.Transport | None = None
        self.head = b""
        self.in_head = True
        self.status = 0
        self.chunked = False
        self.remaining: int | None = None  # Content-Length left, when not chunked
        self.raw = b""      # undecoded chunked bytes
        self.need = 0       # chunk data bytes still to come
        self.skip = 0       # CRLF bytes after a chunk still to skip
        self.tail = b""     # a partial event
        self.tokens = 0
        self.saw_done = False
        self.t_send = self.t_first = self.t_end = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.t_send = time.perf_counter()
        self.transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        if self.in_head:
            data = self.head + data
            end = data.find(b"\r\n\r\n")
            if end < 0:
                self.head = data
                return
            head, data = data[:end], data[end + 4:]
            self.in_head = False
            lines = head.split(b"\r\n")
            self.status = int(lines[0].split(b" ", 2)[1])
            for line in lines[1:]:
                name, _, value = line.partition(b":")
                name = name.strip().lower()
                if name == b"transfer-encoding" and b"chunked" in value.lower():
                    self.chunked = True
                elif name == b"content-length":
                    self.remaining = int(value)
        if self.chunked:
            self._dechunk(data)
        else:
            self._body(data)
            if self.remaining is not None:
                self.remaining -= len(data)
                if self.remaining <= 0:
                    self._finish()

    def _dechunk(self, data: bytes) -> None:
        buf = self.raw + data if self.raw else data
        pos, end = 0, len(buf)
        parts = []
        last = False
        while pos < end:
            if self.need:
                take = min(self.need, end - pos)
                parts.append(buf[pos:pos + take])
                pos += take
                self.need -= take
                if not self.need:
                    self.skip = 2
            elif self.skip:
                take = min(self.skip, end - pos)
                pos += take
                self.skip -= take
            else:
                eol = buf.find(b"\r\n", pos)
                if eol < 0:
                    break
                size = int(buf[pos:eol].split(b";", 1)[0], 16)
                pos = eol + 2
                if size == 0:
                    last = True
                    break
                self.need = size
        self.raw = buf[pos:] if pos < end else b""
        if parts:
            self._body(parts[0] if len(parts) == 1 else b"".join(parts))
        if last:
            self._finish()

    def _body(self, data: bytes) -> None:
        if self.tail:
            data = self.tail + data
        end = data.rfind(b"\n\n")
        if end < 0:
            self.tail = data
            return
        end += 2
        self.tail = data[end:]
        n = data.count(CONTENT, 0, end)
        if n:
            n -= data.count(EMPTY_CONTENT, 0, end)
            if n:
                if not self.tokens:
                    self.t_first = time.perf_counter()
                self.tokens += n
        if not self.saw_done and data.find(b"data: [DONE]", 0, end) >= 0:
            self.saw_done = True

    def _finish(self) -> None:
        if not self.done.done():
            self.t_end = time.perf_counter()
            self.done.set_result(None)
        if self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.t_end = time.perf_counter()
            self.done.set_result(None)


@dataclass
class Run:
    target: str
    wall: float
    chunks: int
    ttfts: list[float]
    errors: int
    cpu: dict[str, float]  # seconds: relay, upstream, client

    @property
    def rate(self) -> float:
        return self.chunks / self.wall if self.wall > 0 else 0.0


def chat_request(port: int, body: bytes, api_key: str = "") -> bytes:
    auth = f"Authorization: Bearer {api_key}\r\n" if api_key else ""
    return (f"POST {CHAT} HTTP/1.1\r\nHost: {HOST}:{port}\r\n{auth}"
            f"Content-Type: application/json\r\nAccept: text/event-stream\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


async def one_stream(port: int, request: bytes, timeout: float, start_after: float) -> StreamClient:
    client = StreamClient(request, asyncio.get_running_loop().create_future())
    await _stream(client, port, timeout, start_after)
    return client


def start_stream(port: int, request: bytes, timeout: float,
                 start_after: float = 0.0) -> tuple[StreamClient, asyncio.Task]:
    """`one_stream`, but the client is returned at once, so its progress can be read."""
    loop = asyncio.get_running_loop()
    client = StreamClient(request, loop.create_future())
    return client, loop.create_task(_stream(client, port, timeout, start_after))


async def run_load(target: Target, upstream_pid: int, streams: int, body: bytes,
                   expect_tokens: int | None, timeout: float, spread: float = 0.0) -> Run:
    """`streams` concurrent streams; stream i starts i*spread/streams seconds in."""
    request = chat_request(target.port, body)
    pids = {"upstream": upstream_pid}
    if target.pid is not None:
        pids["relay"] = target.pid
    before = {k: cpu_times(p) for k, p in pids.items()}
    client_before = time.process_time()
    started = time.perf_counter()
    clients = await asyncio.gather(*(one_stream(target.port, request, timeout, i * spread / streams)
                                     for i in range(streams)))
    wall = time.perf_counter() - started
    cpu = {}
    for k, p in pids.items():
        user, system = cpu_times(p)
        cpu[k] = user + system - sum(before[k])
        cpu[k + "_sys"] = system - before[k][1]
    cpu["client"] = time.process_time() - client_before
    errors = 0
    ttfts = []
    for c in clients:
        ok = c.status == 200 and c.saw_done and c.tokens > 0
        if expect_tokens is not None and c.tokens != expect_tokens:
            ok = False
        if ok:
            ttfts.append(c.t_first - c.t_send)
        else:
            errors += 1
    return Run(target.name, wall, sum(c.tokens for c in clients), ttfts, errors, cpu)


async def _stream(client: StreamClient, port: int, timeout: float, start_after: float) -> None:
    """Connects `client` after `start_after` seconds and waits for its answer to end; a
    refused connection or a timeout leaves the client as far as it got."""
    loop = asyncio.get_running_loop()
    if start_after > 0:
        await asyncio.sleep(start_after)
    try:
        await asyncio.wait_for(loop.create_connection(lambda: client, HOST, port), timeout)
        await asyncio.wait_for(client.done, timeout)
    except (OSError, asyncio.TimeoutError):
        if client.transport is not None:
            client.transport.close()
