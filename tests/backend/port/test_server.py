"""Serving the port: its connections under slow and idle clients, a port already taken,
and a stop that ends running streams cleanly.  Real sockets against a real port (the
fake upstream answers the gated requests, as the engine is not the point)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import socket
from typing import AsyncIterator

import h11
import httpx
import pytest
from starlette.types import Receive, Scope, Send

from backend.errors import SettingsError
from backend.port.gateway import Gateway as Port, create_app
from backend.port.audience import Audience, Listener
from backend.port.client_watch import DisconnectWatch, StallGuard
from backend.port.relay import Exchange
from backend.port.server import KEYLESS_EXTENSION, BodyWriter, GatewayServer, PlainApp
from tests.backend.gateway_harness import CHAT, Gateway, chat, events, open_gateway, stream, until

#: What a slowloris client dribbles, one byte at a time: a head that never ends.
HEAD = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n" + b"X-Padding: " + b"a" * 10_000


@contextlib.asynccontextmanager
async def slowloris(port: int, sockets: int) -> AsyncIterator[list[socket.socket]]:
    """`sockets` connections, each sending its head byte by byte every 50 ms."""
    loop = asyncio.get_running_loop()
    opened: list[socket.socket] = []

    async def dribble(sock: socket.socket) -> None:
        with contextlib.suppress(OSError):
            for byte in HEAD:
                await loop.sock_sendall(sock, bytes([byte]))
                await asyncio.sleep(0.05)  # the attacker's pace, not a synchronisation

    for _ in range(sockets):
        sock = socket.socket()
        sock.setblocking(False)
        await loop.sock_connect(sock, ("127.0.0.1", port))
        opened.append(sock)
    tasks = [asyncio.create_task(dribble(sock)) for sock in opened]
    try:
        yield opened
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for sock in opened:
            sock.close()


async def closed_by_server(sock: socket.socket) -> None:
    """Returns once the server closed `sock` (end of stream or reset)."""
    loop = asyncio.get_running_loop()
    while True:
        try:
            if not await loop.sock_recv(sock, 65536):
                return
        except (ConnectionResetError, BrokenPipeError):
            return


def server_connections(gw: Gateway) -> int:
    return len(gw.server._server.server_state.connections)


async def test_a_slowloris_flood_neither_holds_more_connections_than_allowed_nor_blocks_a_client(gw):
    gw.configure(max_connections=40, header_timeout=30.0)
    async with slowloris(gw.server.port, 60):
        await until(lambda: server_connections(gw) >= 30)
        # The oldest connections that never sent a whole head make room for newer ones.
        assert server_connections(gw) <= 40
        health = await asyncio.wait_for(gw.client.get("/health"), 5)
        assert health.status_code == 200
        answer = await asyncio.wait_for(gw.client.post(CHAT, json=chat()), 5)
        assert answer.status_code == 200
        assert server_connections(gw) <= 40


async def test_a_head_that_takes_longer_than_the_header_timeout_is_dropped(gw):
    gw.configure(header_timeout=0.5)
    async with slowloris(gw.server.port, 3) as sockets:
        # Still sending, a byte every 50 ms: only the timeout can end it.
        await asyncio.wait_for(asyncio.gather(*(closed_by_server(s) for s in sockets)), 10)
    health = await gw.client.get("/health")
    assert health.status_code == 200


async def test_a_body_that_stops_arriving_is_a_408(gw, fake):
    gw.configure(header_timeout=0.5)
    loop = asyncio.get_running_loop()
    with socket.socket() as sock:
        sock.setblocking(False)
        await loop.sock_connect(sock, ("127.0.0.1", gw.server.port))
        await loop.sock_sendall(sock, b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                                      b"Content-Type: application/json\r\n"
                                      b"Content-Length: 100\r\n\r\n{\"model\":")
        answer = await asyncio.wait_for(loop.sock_recv(sock, 65536), 10)
    assert answer.startswith(b"HTTP/1.1 408")
    assert b'"code": "request_timeout"' in answer
    assert fake.requests == []
    await until(lambda: gw.registry.total_waiting == 0 and gw.registry.total_active == 0)


async def test_a_body_that_trickles_in_is_a_408_at_its_deadline(gw, fake):
    """A byte just before each part's timeout keeps a connection busy for ever unless the
    body as a whole has a deadline: the head timeout, plus a second per KiB received."""
    gw.configure(header_timeout=0.5)
    loop = asyncio.get_running_loop()
    with socket.socket() as sock:
        sock.setblocking(False)
        await loop.sock_connect(sock, ("127.0.0.1", gw.server.port))
        await loop.sock_sendall(sock, b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                                      b"Content-Type: application/json\r\n"
                                      b"Content-Length: 1000\r\n\r\n")

        async def trickle() -> None:
            with contextlib.suppress(OSError):
                for _ in range(1000):  # 1,000 bytes at this pace take 300 s
                    await loop.sock_sendall(sock, b" ")
                    await asyncio.sleep(0.3)  # the client's pace: under the part timeout

        started = loop.time()
        sending = asyncio.create_task(trickle())
        try:
            answer = await asyncio.wait_for(loop.sock_recv(sock, 65536), 10)
        finally:
            sending.cancel()
            await asyncio.gather(sending, return_exceptions=True)
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert b'"code": "request_timeout"' in answer
    assert loop.time() - started < 3
    assert fake.requests == []


async def test_a_keyless_get_whose_body_never_ends_is_answered_and_closed_by_the_deadline(gw):
    """/health reads no body: it answers at once, and a client that keeps sending one
    (a byte under every part timeout) holds the connection no longer than a head may take."""
    gw.configure(header_timeout=0.5)
    loop = asyncio.get_running_loop()
    with socket.socket() as sock:
        sock.setblocking(False)
        await loop.sock_connect(sock, ("127.0.0.1", gw.server.port))
        await loop.sock_sendall(sock, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                                      b"Content-Length: 100000\r\n\r\n")

        async def trickle() -> None:
            with contextlib.suppress(OSError):
                while True:
                    await loop.sock_sendall(sock, b" ")
                    await asyncio.sleep(0.1)  # the client's pace: under the part timeout

        sending = asyncio.create_task(trickle())
        started = loop.time()
        try:
            answer = await asyncio.wait_for(loop.sock_recv(sock, 65536), 10)
            await asyncio.wait_for(closed_by_server(sock), 10)
        finally:
            sending.cancel()
            await asyncio.gather(sending, return_exceptions=True)
    assert answer.startswith(b"HTTP/1.1 ")
    assert loop.time() - started < 3


class Doors:
    """An app whose requests hold their connection until the client leaves: `/keyless`
    marks it held without a key (as the enrolment routes do), `/keyed` does not; `/quick`
    answers at once."""

    def __init__(self) -> None:
        self.holding: list[str] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"]
        if path == "/quick":
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-length", b"2")]})
            await send({"type": "http.response.body", "body": b"ok"})
            return
        if path == "/keyless":
            extensions = scope["extensions"]
            assert isinstance(extensions, dict)
            extensions[KEYLESS_EXTENSION]()
        self.holding.append(str(path))
        while (await receive())["type"] != "http.disconnect":
            pass


async def connected(port: int, request: bytes = b"") -> socket.socket:
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setblocking(False)
    await loop.sock_connect(sock, ("127.0.0.1", port))
    if request:
        await loop.sock_sendall(sock, request)
    return sock


def get(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode()


async def test_a_full_port_closes_idle_then_keyless_connections_before_it_refuses_a_newcomer():
    """Anyone on the network can open a request without a key (enrolment): when the port
    is full, those go right after the idle connections, and a client with a key is
    never closed for a newcomer."""
    app = Doors()
    served = PlainApp(app)
    served.settings = served.settings.replace(max_connections=3, header_timeout=30.0)
    server = await GatewayServer.start(served, "127.0.0.1", 0)
    opened: list[socket.socket] = []
    try:
        keyed = await connected(server.port, get("/keyed"))
        keyless = await connected(server.port, get("/keyless"))
        idle = await connected(server.port)
        opened += [keyed, keyless, idle]
        await until(lambda: len(app.holding) == 2)

        first = await connected(server.port, get("/quick"))
        opened.append(first)
        assert (await asyncio.wait_for(closed_or_answer(first), 10)).startswith(b"HTTP/1.1 200")
        await asyncio.wait_for(closed_by_server(idle), 10)  # the idle one made room
        first.close()
        opened.append(await connected(server.port, get("/keyed")))
        await until(lambda: app.holding.count("/keyed") == 2 and server_state_connections(server) == 3)

        second = await connected(server.port, get("/quick"))
        opened.append(second)
        assert (await asyncio.wait_for(closed_or_answer(second), 10)).startswith(b"HTTP/1.1 200")
        await asyncio.wait_for(closed_by_server(keyless), 10)  # then the one without a key
        second.close()
        opened.append(await connected(server.port, get("/keyed")))
        await until(lambda: app.holding.count("/keyed") == 3 and server_state_connections(server) == 3)

        newcomer = await connected(server.port, get("/quick"))
        opened.append(newcomer)
        assert await asyncio.wait_for(closed_or_answer(newcomer), 10) == b""  # turned away
        assert server_state_connections(server) == 3  # the keyed ones all still held
    finally:
        for sock in opened:
            sock.close()
        await server.stop(grace=0.1)


async def closed_or_answer(sock: socket.socket) -> bytes:
    """The first bytes the server sends, or b"" when it closes the connection first."""
    try:
        return await asyncio.get_running_loop().sock_recv(sock, 65536)
    except (ConnectionResetError, BrokenPipeError):
        return b""


def server_state_connections(server: GatewayServer) -> int:
    return len(server._server.server_state.connections)


async def test_a_taken_port_is_a_clear_settings_error(gw):
    with pytest.raises(SettingsError, match="already in use"):
        await GatewayServer.start(create_app(gw.ctx), "127.0.0.1", gw.server.port)


async def test_stop_ends_running_streams_cleanly(fake):
    async with open_gateway(fake.base_url, fake.slots) as gw:
        task = asyncio.create_task(stream(gw.client, CHAT, chat(True, fake={"hang": True})))
        await until(lambda: gw.registry.total_active == 1)
        await asyncio.wait_for(gw.server.stop(grace=0.1), 5)
        response, raw = await asyncio.wait_for(task, 5)
    assert response.status_code == 200
    parsed = events(raw)
    assert parsed[-2]["data"]["error"]["code"] == "model_not_ready"
    assert parsed[-1]["data"] == "[DONE]"
    assert gw.registry.total_active == 0


async def test_both_legs_of_an_answer_go_out_at_once_without_nagles_algorithm(fake, monkeypatch):
    """TCP_NODELAY on the client's connection and on the one to the engine.  Without it a
    small write (the first event after the head) waits for the ACK of the one before,
    which a peer in a request/response pattern delays by up to 40 ms: every answer on a
    kept-alive connection comes about 20 ms late (`bench/pool.py`'s closed loop measured
    it on a relay without it).  asyncio's loop sets it only on sockets made with
    IPPROTO_TCP, uvloop on all; here the loop sets it on none, so the port must itself."""
    monkeypatch.setattr(asyncio.base_events, "_set_nodelay", lambda sock: None)
    async with open_gateway(fake.base_url, fake.slots) as gw:
        port = gw.server.served
        assert isinstance(port, Port)
        task = asyncio.create_task(stream(gw.client, CHAT, chat(True, fake={"hang": True})))
        await until(lambda: gw.registry.total_active == 1 and bool(port.client._all))
        client_side = [c.transport.get_extra_info("socket")
                       for c in gw.server._server.server_state.connections]
        engine_side = [c._transport.get_extra_info("socket") for c in port.client._all
                       if c._transport is not None]
        nodelay = [s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
                   for s in [*client_side, *engine_side]]
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert len(client_side) == 1 and len(engine_side) == 1
    assert all(nodelay), nodelay


def _request(body: dict[str, object], version: bytes = b"1.1") -> bytes:
    data = json.dumps(body).encode()
    return (b"POST /v1/chat/completions HTTP/%s\r\nHost: 127.0.0.1\r\n" % version
            + b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(data) + data)


def _content_events(body: bytes) -> int:
    return sum(1 for e in events(body) if isinstance(e["data"], dict)
               and e["data"]["choices"][0]["delta"].get("content"))


async def _answers(sock: socket.socket, count: int) -> list[bytes]:
    """`count` answers read off `sock` by h11's strict client (chunk framing checked)."""
    loop = asyncio.get_running_loop()
    conn = h11.Connection(h11.CLIENT)
    bodies: list[bytes] = []
    for _ in range(count):
        conn.send(h11.Request(method="POST", target=CHAT, headers=[("host", "x"),
                                                                   ("content-length", "0")]))
        conn.send(h11.EndOfMessage())
        body = b""
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await loop.sock_recv(sock, 65536))
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                break
        bodies.append(body)
        conn.start_next_cycle()
    return bodies


async def test_streamed_answers_one_after_another_on_a_kept_alive_connection_arrive_whole(gw):
    """A stream's body goes straight to the connection (`BodyWriter`): each answer is
    framed so that a strict HTTP/1.1 client reads it whole and the next request on the
    same connection is answered too."""
    sock = socket.socket()
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(sock, ("127.0.0.1", gw.server.port))
    try:
        for tokens in (40, 7):
            await loop.sock_sendall(sock, _request(chat(True, fake={"n_tokens": tokens,
                                                                        "delay": 0.002})))
            [body] = await asyncio.wait_for(_answers(sock, 1), 10)
            assert _content_events(body) == tokens
            assert events(body)[-1]["data"] == "[DONE]"
    finally:
        sock.close()


async def test_a_stream_to_an_http_1_0_client_is_whole_events_until_the_connection_closes(gw):
    """HTTP/1.0 knows no chunks: the body is the events themselves, ended by the close."""
    sock = socket.socket()
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(sock, ("127.0.0.1", gw.server.port))
    try:
        request = chat(True, fake={"n_tokens": 30, "delay": 0.002})
        await loop.sock_sendall(sock, _request(request, b"1.0"))
        raw = b""
        while chunk := await asyncio.wait_for(loop.sock_recv(sock, 65536), 10):
            raw += chunk
    finally:
        sock.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding" not in head.lower()
    assert b"\r" not in body  # no chunk framing inside
    assert _content_events(body) == 30
    assert events(body)[-1]["data"] == "[DONE]"


async def test_a_client_that_reads_late_gets_the_whole_stream_in_order(gw, fake):
    """The client reads nothing until the port's buffer for it is full (its stream waits,
    the engine's connection stops being read), then reads on: every event arrives, in
    order, none twice."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(sock, ("127.0.0.1", gw.server.port))
    try:
        body = chat(True, fake={"n_tokens": 20_000, "delay": 0})
        await loop.sock_sendall(sock, _request(body))
        connections = gw.server._server.server_state.connections
        await until(lambda: any(c.flow.write_paused for c in connections), timeout=20)
        [answer] = await asyncio.wait_for(_answers(sock, 1), 60)
    finally:
        sock.close()
    numbers = [int(e["data"]["choices"][0]["delta"]["content"].removeprefix("tok").strip())
               for e in events(answer) if isinstance(e["data"], dict)
               and e["data"]["choices"][0]["delta"].get("content")]
    assert numbers == list(range(len(numbers))) and len(numbers) == 20_000


async def test_an_ended_request_is_freed_at_once_not_left_to_the_garbage_collector(gw):
    """A request's objects (its exchange, its audience and listener, stall guard,
    disconnect watch, body writer, and with them its parsed body) go as soon as it ends,
    by their reference counts: none sits in a reference cycle until the collector, which
    a busy port runs often and which walks every object still waiting for it.  Streamed
    and whole answers, kept-alive connections and not, with the collector off meanwhile."""
    kinds = (Exchange, StallGuard, DisconnectWatch, BodyWriter, Audience, Listener)

    def alive() -> list[str]:
        return [type(o).__name__ for o in gc.get_objects() if isinstance(o, kinds)]

    gc.collect()
    assert not alive()
    gc.disable()
    try:
        for _ in range(2):  # the second on the kept-alive connection
            response, raw = await stream(gw.client, CHAT, chat(True, fake={"n_tokens": 3}))
            assert response.status_code == 200 and events(raw)[-1]["data"] == "[DONE]"
            answer = await gw.client.post(CHAT, json=chat(False))
            assert answer.status_code == 200
        async with httpx.AsyncClient(base_url=gw.url, trust_env=False) as other:
            assert (await other.post(CHAT, json=chat(False))).status_code == 200
        await until(lambda: not alive(), timeout=5)
    finally:
        gc.enable()
