"""The gateway's own upstream HTTP/1.1 client: parsing, connection reuse, failures.

The strictness tests use `tests/malformed_upstream.py`, a raw asyncio socket, because a
real llama-server cannot produce malformed answers; `bench/strictness.py` runs the same
cases against aiohttp's client for comparison.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from backend.port.upstream_http import MalformedAnswer, UpstreamClient, _Connection
from tests.fake_upstream import FakeUpstream
from tests.malformed_upstream import (CLOSE, DATA16, GOOD_STREAM, INTERIM, MALFORMED, WELL_FORMED,
                                      MalformedUpstream)


class _Transport:
    """Stands in for a socket: the parser tests feed bytes by hand."""

    def __init__(self) -> None:
        self.closed = False
        self.paused = False

    def close(self) -> None:
        self.closed = True

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False

    def write(self, data: bytes) -> None:
        pass


def feed(raw: bytes, step: int) -> _Connection:
    connection = _Connection(UpstreamClient(), ("http", "h", 1))
    connection.connection_made(_Transport())
    for i in range(0, len(raw), step):
        connection.data_received(raw[i:i + step])
    return connection


async def until(predicate, timeout: float = 5.0) -> None:
    async def poll():
        while not predicate():
            await asyncio.sleep(0.01)
    await asyncio.wait_for(poll(), timeout)


async def stream(client: UpstreamClient, base_url: str, n: int, **fake) -> tuple[int, bytes]:
    body = json.dumps({"stream": True, "messages": [], "fake": dict(n_tokens=n, **fake)}).encode()
    response = await client.send(client.build_request(
        "POST", base_url + "/v1/chat/completions", content=body,
        headers={"content-type": "application/json"}))
    try:
        return response.status_code, await response.aread()
    finally:
        await response.aclose()


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_chunked_bodies_are_decoded_however_the_bytes_are_split(step):
    body = [b"data: a\n\n", b"data: bb\n\n", b"x" * 300]
    raw = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Type: text/event-stream\r\n\r\n"
    raw += b"".join(b"%x;ext=1\r\n%s\r\n" % (len(p), p) for p in body) + b"0\r\nX-T: 1\r\n\r\n"
    connection = feed(raw, step)
    assert connection.status == 200 and connection.complete and connection.keep_alive
    assert connection.error is None
    assert b"".join(connection.body) == b"".join(body)


@pytest.mark.parametrize("step", [1, 5, 1000])
def test_content_length_bodies_after_an_interim_100_continue(step):
    raw = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 404 Not Found\r\nContent-Length: 5\r\n\r\nhello"
    connection = feed(raw, step)
    assert connection.status == 404 and connection.complete and connection.keep_alive
    assert b"".join(connection.body) == b"hello"


def test_a_body_delimited_by_close_ends_when_the_connection_does():
    connection = feed(b"HTTP/1.0 200 OK\r\n\r\nabc", 2)
    assert not connection.complete and not connection.keep_alive
    connection.connection_lost(None)
    assert connection.complete and b"".join(connection.body) == b"abc"


def test_a_connection_cut_mid_chunk_is_an_error():
    connection = feed(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n10\r\nabc", 3)
    connection.connection_lost(None)
    assert connection.error and not connection.complete


def test_a_malformed_chunk_size_is_an_error():
    assert feed(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", 100).error


async def test_connections_are_reused_and_failures_raise_httpx_errors():
    async with FakeUpstream(slots=4) as fake:
        client = UpstreamClient()
        status, body = await stream(client, fake.base_url, 5)
        assert status == 200 and body.count(b"tok") == 5 and body.endswith(b"data: [DONE]\n\n")
        key = ("http", "127.0.0.1", fake.port)
        reused = client._idle[key][0]
        await stream(client, fake.base_url, 3)
        assert client._idle[key][0] is reused and reused.requests == 2

        status, body = await stream(client, fake.base_url, 3, status=500)
        assert status == 500 and b"injected" in body
        with pytest.raises(httpx.RemoteProtocolError):
            await stream(client, fake.base_url, 10, die_after=2)
        results = await asyncio.gather(*(stream(client, fake.base_url, 20) for _ in range(30)))
        assert all(s == 200 and b.count(b"tok") == 20 for s, b in results)
        await client.aclose()
    with pytest.raises(httpx.ConnectError):
        await stream(UpstreamClient(), fake.base_url, 1)


async def test_closing_a_response_early_closes_the_upstream_request():
    async with FakeUpstream(slots=2) as fake:
        client = UpstreamClient()
        body = json.dumps({"stream": True, "messages": [],
                           "fake": {"n_tokens": 100, "delay": 0.01}}).encode()
        response = await client.send(client.build_request(
            "POST", fake.base_url + "/v1/chat/completions", content=body))
        async for _chunk in response.aiter_raw():
            break
        await response.aclose()
        await until(lambda: fake.disconnects >= 1)
        await client.aclose()


async def test_an_idle_connection_the_server_closed_leaves_the_pool():
    async with FakeUpstream(slots=2) as fake:
        client = UpstreamClient()
        await stream(client, fake.base_url, 2)
        assert client._n_idle == 1
    await until(lambda: client._n_idle == 0)


def test_targets_are_parsed_and_unsupported_schemes_refused():
    client = UpstreamClient()
    key, path, host = client._target("https://example.invalid/v1/chat/completions")
    assert key == ("https", "example.invalid", 443) and host == b"example.invalid"
    key, path, host = client._target("http://[::1]:8080/v1/x?a=1")
    assert key == ("http", "::1", 8080) and host == b"[::1]:8080" and path == b"/v1/x?a=1"
    with pytest.raises(httpx.UnsupportedProtocol):
        client._target("ftp://x/")


# --- strictness: malformed answers from a raw socket ----------------------------------


@pytest.fixture
async def client():
    client = UpstreamClient()
    yield client
    await client.aclose()


async def exchange(client: UpstreamClient, base_url: str) -> tuple[int, bytes]:
    response = await client.send(client.build_request(
        "POST", base_url + "/v1/chat/completions", content=b"{}",
        headers={"content-type": "application/json"}))
    try:
        return response.status_code, await response.aread()
    finally:
        await response.aclose()


@pytest.mark.parametrize("answer", list(MALFORMED.values()), ids=list(MALFORMED))
async def test_a_malformed_answer_is_an_error_and_its_connection_is_not_reused(client, answer):
    async with MalformedUpstream([answer]) as upstream:
        with pytest.raises(MalformedAnswer):
            await exchange(client, upstream.base_url)
        assert client.pooled() == 0
        status, body = await exchange(client, upstream.base_url)
        assert status == 200 and body.endswith(b"data: [DONE]\n\n")
        assert upstream.requests == [1, 2]  # the second request came on a new connection


@pytest.mark.parametrize("answer", list(WELL_FORMED.values()), ids=list(WELL_FORMED))
async def test_the_well_formed_twins_of_the_malformed_answers_are_read(client, answer):
    async with MalformedUpstream([answer]) as upstream:
        status, body = await exchange(client, upstream.base_url)
        assert status == 200 and body in (DATA16, b"hello")
        assert client.pooled() == 1


@pytest.mark.parametrize("interim", list(INTERIM.values()), ids=list(INTERIM))
async def test_interim_1xx_heads_are_skipped_and_the_connection_kept(client, interim):
    async with MalformedUpstream([interim + GOOD_STREAM]) as upstream:
        status, body = await exchange(client, upstream.base_url)
        assert status == 200 and body.endswith(b"data: [DONE]\n\n")
        assert client.pooled() == 1
        await exchange(client, upstream.base_url)
        assert upstream.requests == [1, 1]


@pytest.mark.parametrize("step", [1, 7])
def test_a_chunk_without_its_crlf_is_caught_however_the_bytes_are_split(step):
    raw = (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
           b"3\r\nabc\r\n3\r\ndefX\n0\r\n\r\n")
    connection = feed(raw, step)
    assert connection.error and connection.malformed and not connection.keep_alive
    assert b"".join(connection.body) == b"abcdef"  # what came before the fault is kept


async def test_a_kept_alive_connection_closed_as_it_is_reused_is_retried_on_a_new_one(client):
    async with MalformedUpstream([GOOD_STREAM, CLOSE]) as upstream:
        await exchange(client, upstream.base_url)
        status, body = await exchange(client, upstream.base_url)
        assert status == 200 and body.endswith(b"data: [DONE]\n\n")
        assert upstream.requests == [1, 1, 2]  # sent on the kept connection, then again


def test_a_hostile_header_line_is_refused_without_backtracking():
    # 60 KB of blanks before a control byte: a backtracking regex took 64 s on this
    # machine (the event loop stalled for every stream); the check is linear.
    raw = b"HTTP/1.1 200 OK\r\nX-Pad:" + b" \t" * 30000 + b"\x01\r\n\r\n"
    started = time.perf_counter()
    connection = feed(raw, len(raw))
    assert connection.malformed and not connection.keep_alive
    assert time.perf_counter() - started < 1.0
