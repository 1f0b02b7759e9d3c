"""Request bodies through a real port: parsed off the event loop when large, bounded while
they wait, and never unlimited.  The upstream is the fake one: what is measured here is
the port itself (a real engine would add its own parsing of the same bytes)."""

from __future__ import annotations

import asyncio
import json
import socket
import time

from backend.port.request_body import PARSE_OFF_LOOP_BYTES, name_model, parse_body
from backend.settings import Settings
from tests.backend.gateway_harness import CHAT, assert_clean_error, chat, open_gateway, until


def many_small_objects(size: int) -> bytes:
    """A body of `size` bytes or more made of tiny messages (the slowest JSON to parse),
    with a `stream` of the wrong type at the end: parsed in full, then refused (400),
    so nothing is forwarded."""
    message = {"role": "user", "content": "hi"}
    count = size // len(json.dumps(message)) + 1
    body = {"model": "fake-model", "messages": [message] * count, "stream": "yes"}
    return json.dumps(body).encode()


class LoopGaps:
    """The longest time the event loop went without running a 1 ms ticker."""

    def __init__(self) -> None:
        self.longest = 0.0
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> "LoopGaps":
        self._task = asyncio.create_task(self._tick())
        await asyncio.sleep(0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()

    async def _tick(self) -> None:
        last = time.perf_counter()
        while True:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            self.longest = max(self.longest, now - last)
            last = now


def post_raw(port: int, body: bytes) -> bytes:
    """POST `body` from a plain blocking socket (run in a thread: the loop stays free)."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\nContent-Length: %d\r\n"
                     b"Connection: close\r\n\r\n" % len(body) + body)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
        return answer


async def test_a_large_body_is_parsed_without_stalling_the_event_loop(fake):
    body = many_small_objects(24 * 1024 * 1024)
    async with LoopGaps() as on_loop:
        json.loads(body)  # what the port did on its loop before
        await asyncio.sleep(0.01)
    async with open_gateway(fake.base_url, fake.slots) as gw:
        async with LoopGaps() as port:
            answer = await asyncio.to_thread(post_raw, gw.server.port, body)
    print(f"\nlongest loop stall: {on_loop.longest:.3f} s parsing on the loop, "
          f"{port.longest:.3f} s while the port parsed {len(body) >> 20} MiB")
    assert answer.startswith(b"HTTP/1.1 400")
    assert b"'stream' must be true or false" in answer
    # Measured on the test machine: 0.57-0.71 s on the loop, 0.05-0.07 s through the port.
    assert port.longest < on_loop.longest / 2, (port.longest, on_loop.longest)
    assert PARSE_OFF_LOOP_BYTES <= 1024 * 1024


async def test_bodies_held_by_waiting_requests_are_bounded(gw, fake):
    gw.configure(max_waiting_body_bytes=100_000)
    async with gw.client.stream("POST", CHAT, json=chat(True, fake={"hang": True})) as one, \
            gw.client.stream("POST", CHAT, json=chat(True, fake={"hang": True})) as two:
        assert one.status_code == two.status_code == 200  # both slots are held
        waiter = asyncio.create_task(gw.client.post(CHAT, json=chat(padding="x" * 60_000)))
        await until(lambda: gw.registry.total_waiting == 1)
        refused = await gw.client.post(CHAT, json=chat(padding="x" * 60_000))
        assert_clean_error(refused, 429, "server_is_overloaded", gw)
        assert "request bodies" in refused.json()["error"]["message"]
        small = asyncio.create_task(gw.client.post(CHAT, json=chat()))  # still fits
        await until(lambda: gw.registry.total_waiting == 2)
    assert (await waiter).status_code == 200
    assert (await small).status_code == 200


async def test_a_body_limit_of_zero_means_the_default_not_unlimited(gw, fake):
    gw.configure(max_body_bytes=0)
    declared = Settings().max_body_bytes + 1

    def send_head() -> bytes:
        with socket.create_connection(("127.0.0.1", gw.server.port), timeout=10) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                         b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n{"
                         % declared)
            return sock.recv(65536)  # refused by its header, before the body

    answer = await asyncio.to_thread(send_head)
    assert answer.startswith(b"HTTP/1.1 413")


def test_a_body_naming_no_model_is_sent_naming_the_one_it_was_routed_to():
    """For an engine that is another port with several models (it would take a request
    naming none for its own default): the body names the model, the output cap kept."""
    parsed = parse_body("/v1/chat/completions",
                        json.dumps({"messages": [{"role": "user", "content": "héllo"}]}).encode(), 64)
    name_model(parsed, "smol")
    assert parsed.model == "smol"
    assert json.loads(parsed.body) == {"messages": [{"role": "user", "content": "héllo"}],
                                       "max_tokens": 64, "model": "smol"}
