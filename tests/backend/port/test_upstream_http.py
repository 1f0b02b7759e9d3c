"""The gateway's own upstream HTTP/1.1 client: its connections, its pool.

The tests use `tests/fake_upstream.py` and `tests/malformed_upstream.py`, a raw asyncio
socket, because a real llama-server cannot produce malformed answers, cut streams on cue or
close a kept-alive connection as a request arrives; `bench/strictness.py` runs the same
malformed answers against aiohttp's client.  The parser those connections feed is tested
alone in `test_http1_response.py`.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from backend.port.upstream_errors import (ConnectFailed, ConnectionLost, MalformedAnswer,
                                          UnsupportedURL)
from backend.port.upstream_http import HIGH_WATER, UpstreamClient
from tests.fake_upstream import FakeUpstream
from tests.malformed_upstream import (CLOSE, DATA16, GOOD_STREAM, INTERIM, MALFORMED, WELL_FORMED,
                                      MalformedUpstream, chunked)


# --- the client: connections and the pool --------------------------------------------


async def until(predicate, timeout: float = 5.0) -> None:
    async def poll():
        while not predicate():
            await asyncio.sleep(0.01)  # polling a real condition, with a deadline
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


async def test_connections_are_reused_and_failures_raise_upstream_errors(client):
    async with FakeUpstream(slots=4) as fake:
        status, body = await stream(client, fake.base_url, 5)
        assert status == 200 and body.count(b"tok") == 5 and body.endswith(b"data: [DONE]\n\n")
        key = ("http", "127.0.0.1", fake.port)
        reused = client._idle[key][0]
        await stream(client, fake.base_url, 3)
        assert client._idle[key][0] is reused and reused.requests == 2

        status, body = await stream(client, fake.base_url, 3, status=500)
        assert status == 500 and b"injected" in body
        with pytest.raises(ConnectionLost):
            await stream(client, fake.base_url, 10, die_after=2)
        results = await asyncio.gather(*(stream(client, fake.base_url, 20) for _ in range(30)))
        assert all(s == 200 and b.count(b"tok") == 20 for s, b in results)
    with pytest.raises(ConnectFailed):  # nothing was sent: the relay may requeue
        await stream(UpstreamClient(), fake.base_url, 1)


async def test_closing_a_response_early_closes_the_upstream_request(client):
    async with FakeUpstream(slots=2) as fake:
        body = json.dumps({"stream": True, "messages": [],
                           "fake": {"n_tokens": 100, "delay": 0.01}}).encode()
        response = await client.send(client.build_request(
            "POST", fake.base_url + "/v1/chat/completions", content=body))
        async for _chunk in response.aiter_raw():
            break
        await response.aclose()
        await until(lambda: fake.disconnects >= 1)
        assert client.pooled() == 0


async def test_an_idle_connection_the_server_closed_leaves_the_pool(client):
    async with FakeUpstream(slots=2) as fake:
        await stream(client, fake.base_url, 2)
        assert client.pooled() == 1
    await until(lambda: client.pooled() == 0)


async def test_targets_are_parsed_and_unsupported_schemes_refused(client):
    key, path, host = client._target("https://example.invalid/v1/chat/completions")
    assert key == ("https", "example.invalid", 443) and host == b"example.invalid"
    key, path, host = client._target("http://[::1]:8080/v1/x?a=1")
    assert key == ("http", "::1", 8080) and host == b"[::1]:8080" and path == b"/v1/x?a=1"
    with pytest.raises(UnsupportedURL):
        await client.send(client.build_request("POST", "ftp://x/"))


# --- strictness: malformed answers from a raw socket ----------------------------------


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


async def test_a_kept_alive_connection_closed_as_it_is_reused_is_retried_on_a_new_one(client):
    async with MalformedUpstream([GOOD_STREAM, CLOSE]) as upstream:
        await exchange(client, upstream.base_url)
        status, body = await exchange(client, upstream.base_url)
        assert status == 200 and body.endswith(b"data: [DONE]\n\n")
        assert upstream.requests == [1, 1, 2]  # sent on the kept connection, then again


async def test_the_retry_after_a_closed_kept_alive_connection_takes_a_new_one_not_another_kept_one(
        client):
    # llama-server closes its connection after every streamed answer, without saying so:
    # all the kept connections may be closed at once, and a second one taken from the
    # pool would fail too (the port answered 502 under load).
    async with MalformedUpstream(answers_per_connection=1) as upstream:
        await asyncio.gather(exchange(client, upstream.base_url),
                             exchange(client, upstream.base_url))
        assert client.pooled() == 2
        status, body = await exchange(client, upstream.base_url)
        assert status == 200 and body.endswith(b"data: [DONE]\n\n")
        first_two, reused, retried = upstream.requests[:2], upstream.requests[2], upstream.requests[3:]
        assert sorted(first_two) == [1, 2] and reused in (1, 2) and retried == [3]


async def test_a_connection_closed_before_any_answer_on_a_new_connection_is_lost(client):
    async with MalformedUpstream([CLOSE]) as upstream:
        with pytest.raises(ConnectionLost):  # something may have been processed: no retry
            await exchange(client, upstream.base_url)
        assert upstream.requests == [1]


async def test_an_answer_cut_mid_body_is_lost_after_what_came(client):
    upstream = await MalformedUpstream([chunked(b"10\r\n", DATA16, b"\r\n8\r\nabc")]).__aenter__()
    response = await client.send(client.build_request(
        "POST", upstream.base_url + "/v1/chat/completions", content=b"{}"))
    received = b""
    with pytest.raises(ConnectionLost):
        async for chunk in response.aiter_raw():
            received += chunk
            if received == DATA16 + b"abc":
                await upstream.__aexit__(None, None, None)  # the upstream goes away
    await response.aclose()
    assert received == DATA16 + b"abc" and client.pooled() == 0


# --- flow control -------------------------------------------------------------------


class _Transport(asyncio.Transport):
    """Stands in for a socket: which bytes a read carries is up to the kernel, and this
    test needs a whole answer larger than HIGH_WATER to arrive in one read."""

    def __init__(self) -> None:
        super().__init__()
        self.paused = False
        self.closed = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        pass

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False

    def close(self) -> None:
        self.closed = True


async def test_a_paused_connection_whose_unread_answer_ended_reads_again_in_the_pool():
    from backend.port.upstream_http import UpstreamResponse, _Connection

    client = UpstreamClient()
    connection = _Connection(client, ("http", "h", 1))
    transport = _Transport()
    connection.connection_made(transport)
    connection.start(b"POST / HTTP/1.1\r\n\r\n")
    big = b"x" * (HIGH_WATER + 1)
    connection.data_received(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(big), big))
    assert transport.paused  # the reader is slow: the upstream waits
    response = UpstreamResponse(connection, await connection.answer_head())
    await response.aclose()  # ended but unread: the connection goes back to the pool
    assert client.pooled() == 1 and not transport.paused and not transport.closed


async def test_arrived_says_whether_the_body_came_within_the_time_given(client):
    """What the relay's keep-alives before an engine's first bytes rest on: False while a
    silent engine reads its prompt, True once the first event came (at once after)."""
    async with FakeUpstream(slots=2) as fake:
        body = json.dumps({"stream": True, "messages": [],
                           "fake": {"n_tokens": 2, "prompt_delay": 0.5}}).encode()
        response = await client.send(client.build_request(
            "POST", fake.base_url + "/v1/chat/completions", content=body))
        try:
            assert not await response.arrived(0.01)
            while not await response.arrived(0.05):
                pass
            assert await response.arrived(0)
            assert (await response.aread()).count(b"tok") == 2
        finally:
            await response.aclose()
