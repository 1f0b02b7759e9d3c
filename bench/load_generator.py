"""The benchmarks' load generator: a lean asyncio HTTP/1.1 client, the same code for
every target.  One `asyncio.Protocol` per stream over its own connection (`StreamClient`),
an agent sending request after request on its kept-alive connection (`Agent`), or agents
in lockstep, every one's request written in the same loop turn (`run_burst`); it counts
content chunks and notes the time to the first one.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from bench.processes import HOST, CpuMeter, Target, cpu_ns

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
        self._new_answer()

    def _new_answer(self) -> None:
        self.head = b""
        self.in_head = True
        self.status = 0
        self.chunked = False
        self.remaining: int | None = None  # Content-Length left, when not chunked
        self.raw = b""      # undecoded chunked bytes
        self.need = 0       # chunk data bytes still to come
        self.skip = 0       # CRLF bytes after a chunk still to skip
        self.trailer = False  # past the last chunk, reading the (empty) trailer section
        self.tail = b""     # a partial event
        self.tokens = 0
        self.saw_done = False
        self.keep_alive = True  # the server did not say `Connection: close`
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
                elif name == b"connection" and b"close" in value.lower():
                    self.keep_alive = False
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
                line, pos = buf[pos:eol], eol + 2
                if self.trailer:  # the answer ends with the trailer section's blank line
                    if not line:
                        last = True
                        break
                    continue
                size = int(line.split(b";", 1)[0], 16)
                if size == 0:
                    self.trailer = True
                    continue
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


class KeptAliveClient(StreamClient):
    """One connection of an agent (`Agent`): its requests one after the other, each
    written the moment the answer before it ended, for as long as the server keeps the
    connection.  `done` is set when the connection ends or has carried `left` requests;
    a request the server closed the connection on before any byte of its answer came
    (a kept-alive connection it closed as it was reused) is left for a new connection,
    as HTTP clients do."""

    def __init__(self, agent: Agent, done: asyncio.Future) -> None:
        super().__init__(agent.request, done)
        self.agent = agent
        self.answering = False
        self.used = 0  # requests sent on this connection

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self._send()

    def _send(self) -> None:
        self._new_answer()
        self.answering = True
        self.used += 1
        self.t_send = time.perf_counter()
        if self.agent.t_asked is None:  # a resent request keeps its first time
            self.agent.t_asked = self.t_send
            self.agent.sent_at.append(self.t_send)
        assert self.transport is not None
        self.transport.write(self.request)

    def _finish(self) -> None:
        self.answering = False
        agent = self.agent
        ok = self.status == 200 and self.saw_done and self.tokens > 0
        if agent.expect_tokens is not None and self.tokens != agent.expect_tokens:
            ok = False
        if not ok:
            agent.errors += 1
        elif agent.answered:  # every request but the agent's first
            assert agent.t_asked is not None
            agent.ttfts.append(self.t_first - agent.t_asked)
            if self.used == 1:
                agent.reconnected += 1
        agent.answered += 1
        agent.t_asked = None
        agent.chunks += self.tokens
        agent.left -= 1
        if agent.left > 0 and self.keep_alive:
            self._send()
            return
        super()._finish()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.answering:
            self.answering = False
            if self.in_head and not self.head and self.used > 1:
                pass  # closed as it was reused: the agent sends it again on a new one
            else:
                self.agent.errors += 1
                self.agent.left -= 1
                self.agent.t_asked = None
        super().connection_lost(exc)


class Agent:
    """A client that sends `requests` streamed requests one after the other, each the
    moment the answer before it ended, on a kept-alive connection (a new one only when
    the server closes it).  `ttfts`: from a request's first write to its first content
    chunk, for every request but the first (which also opened the connection);
    `reconnected` counts those that went out on a new connection all the same."""

    def __init__(self, request: bytes, requests: int, expect_tokens: int | None) -> None:
        self.request = request
        self.left = requests
        self.expect_tokens = expect_tokens
        self.ttfts: list[float] = []
        self.answered = 0
        self.t_asked: float | None = None
        self.reconnected = 0
        self.chunks = 0
        self.errors = 0
        self.sent_at: list[float] = []  # when each request was first written

    async def run(self, port: int, timeout: float, start_after: float = 0.0) -> None:
        loop = asyncio.get_running_loop()
        if start_after > 0:
            await asyncio.sleep(start_after)
        while self.left > 0:
            before = (self.left, self.errors)
            client = KeptAliveClient(self, loop.create_future())
            await _stream(client, port, timeout, 0.0)
            if (self.left, self.errors) == before and not client.used:
                self.errors += self.left  # could not even connect
                return


@dataclass
class Run:
    target: str
    wall: float
    chunks: int
    ttfts: list[float]
    errors: int
    cpu: dict[str, float]  # seconds: relay, upstream, client
    #: Closed loop: measured requests that went out on a new connection all the same
    #: (the server had closed the kept-alive one).
    reconnected: int = 0
    #: Closed loop and burst: for the agents' k-th request (k >= 2, the measured ones),
    #: how far apart they were written: the last agent's write − the first's, seconds.
    arrival_spread: list[float] = field(default_factory=list)
    #: Burst: per measured burst, the relay's CPU (every thread, ns clock) from the first
    #: write to the last first token, seconds: its serial work on the burst's way in.
    first_token_cpu: list[float] = field(default_factory=list)

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
    meter = CpuMeter(pids, client=True)
    started = time.perf_counter()
    clients = await asyncio.gather(*(one_stream(target.port, request, timeout, i * spread / streams)
                                     for i in range(streams)))
    wall = time.perf_counter() - started
    cpu = meter.spent()
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


async def run_closed_loop(target: Target, upstream_pids: list[int], clients: int, requests: int,
                          body: bytes | list[bytes], expect_tokens: int | None, timeout: float,
                          spread: float = 0.0) -> Run:
    """`clients` agents (`Agent`), agent i starting i*spread/clients seconds in, each
    sending `requests` requests one after the other on its kept-alive connection.  The
    run's TTFTs are those of every agent's second request on, which is what this
    measures; throughput counts every chunk.  `body`: every agent's, or agent i's the
    i-th of a list."""
    bodies = body if isinstance(body, list) else [body] * clients
    pids = {f"upstream{i}" if i else "upstream": pid for i, pid in enumerate(upstream_pids)}
    if target.pid is not None:
        pids["relay"] = target.pid
    meter = CpuMeter(pids, client=True)
    agents = [Agent(chat_request(target.port, bodies[i]), requests, expect_tokens)
              for i in range(clients)]
    started = time.perf_counter()
    await asyncio.gather(*(agent.run(target.port, timeout * requests, i * spread / clients)
                           for i, agent in enumerate(agents)))
    wall = time.perf_counter() - started
    cpu = meter.spent()
    spreads = [max(times) - min(times) for times in zip(*(a.sent_at for a in agents))][1:]
    return Run(target.name, wall, sum(a.chunks for a in agents),
               [t for a in agents for t in a.ttfts], sum(a.errors for a in agents), cpu,
               reconnected=sum(a.reconnected for a in agents), arrival_spread=spreads)


class BurstConnection(StreamClient):
    """One agent of a burst (`run_burst`): a kept-alive connection on which `send` writes
    the agent's request; the answer is read as any stream's, and the connection stays open
    for the next burst.  `on_first` is called once the answer's first content came."""

    def __init__(self, request: bytes, on_first: Callable[[], None]) -> None:
        super().__init__(request, asyncio.get_running_loop().create_future())
        self.on_first = on_first
        self.lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def send(self) -> None:
        self._new_answer()
        self.done = asyncio.get_running_loop().create_future()
        self.t_send = time.perf_counter()
        assert self.transport is not None
        self.transport.write(self.request)

    def _body(self, data: bytes) -> None:
        first = not self.tokens
        super()._body(data)
        if first and self.tokens:
            self.on_first()

    def _finish(self) -> None:
        if not self.done.done():
            self.t_end = time.perf_counter()
            self.done.set_result(None)
        if not self.keep_alive and self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        super().connection_lost(exc)

    def ok(self, expect_tokens: int | None) -> bool:
        return (self.status == 200 and self.saw_done and self.tokens > 0
                and (expect_tokens is None or self.tokens == expect_tokens))


async def run_burst(target: Target, upstream_pids: list[int], agents: int, bursts: int,
                    body: bytes | list[bytes], expect_tokens: int | None,
                    timeout: float) -> Run:
    """`agents` agents in lockstep, each on its own kept-alive connection: `bursts` + 1
    bursts, in each every agent's request written in the same loop turn, the next burst
    the moment the last answer of this one ended.  The first burst (the port's first
    request on each connection) is not measured.  TTFT: from a request's write to its
    first content chunk; `first_token_cpu`: the relay's CPU over each measured burst's
    way in (first write to last first token).  `body`: every agent's, or agent i's the
    i-th of a list (their own conversations)."""
    requests = [chat_request(target.port, b) for b in
                (body if isinstance(body, list) else [body] * agents)]
    loop = asyncio.get_running_loop()
    pids = {f"upstream{i}" if i else "upstream": pid for i, pid in enumerate(upstream_pids)}
    if target.pid is not None:
        pids["relay"] = target.pid
    waiting = [0]
    cpu_at_last_first = [0]

    def on_first() -> None:
        waiting[0] -= 1
        if not waiting[0] and target.pid is not None:
            cpu_at_last_first[0] = cpu_ns(target.pid)

    async def connect(agent: int) -> BurstConnection:
        conn = BurstConnection(requests[agent], on_first)
        await asyncio.wait_for(loop.create_connection(lambda: conn, HOST, target.port), timeout)
        return conn

    conns = list(await asyncio.gather(*(connect(i) for i in range(agents))))
    meter = CpuMeter(pids, client=True)
    run = Run(target.name, 0.0, 0, [], 0, {})
    started = time.perf_counter()
    for burst in range(bursts + 1):
        for i, conn in enumerate(conns):
            if conn.lost:  # the server closed it: a new one, as HTTP clients do
                conns[i] = await connect(i)
                run.reconnected += 1 if burst else 0
        waiting[0] = agents
        cpu_before = cpu_ns(target.pid) if target.pid is not None else 0
        for conn in conns:  # every request of the burst in this loop turn
            conn.send()
        try:
            await asyncio.wait_for(asyncio.gather(*(c.done for c in conns)), timeout)
        except asyncio.TimeoutError:
            for conn in conns:
                if not conn.done.done() and conn.transport is not None:
                    conn.transport.close()
        for conn in conns:
            run.chunks += conn.tokens
            if not conn.ok(expect_tokens):
                run.errors += 1
            elif burst:
                run.ttfts.append(conn.t_first - conn.t_send)
        if burst:
            sent = [c.t_send for c in conns]
            run.arrival_spread.append(max(sent) - min(sent))
            if target.pid is not None and not waiting[0]:
                run.first_token_cpu.append((cpu_at_last_first[0] - cpu_before) / 1e9)
    run.wall = time.perf_counter() - started
    run.cpu = meter.spent()
    for conn in conns:
        if conn.transport is not None:
            conn.transport.close()
    return run


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
