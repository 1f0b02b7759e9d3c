"""Malformed upstream answers: each is an error, and its connection is never reused.

The upstream is `tests/malformed_upstream.py`, a raw asyncio socket, because a real
llama-server cannot produce these answers.  Every case runs against the hand-written
client (`backend.upstream_http`) and aiohttp's (`backend.upstream_aiohttp`), which were
measured against each other on strictness here and on speed in `bench/relay.py`.
"""

from __future__ import annotations

import httpx
import pytest

from backend.upstream_aiohttp import AiohttpUpstreamClient
from backend.upstream_http import UpstreamClient
from tests.malformed_upstream import GOOD_STREAM, MalformedUpstream

CLIENTS = {"ours": UpstreamClient, "aiohttp": AiohttpUpstreamClient}


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


@pytest.fixture(params=list(CLIENTS))
async def client(request):
    client = CLIENTS[request.param]()
    yield client
    await client.aclose()


async def exchange(client, base_url: str) -> tuple[int, bytes]:
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
        with pytest.raises(httpx.HTTPError):
            await exchange(client, upstream.base_url)
        assert client.pooled() == 0
        status, body = await exchange(client, upstream.base_url)
        assert status == 200 and body.endswith(b"data: [DONE]\n\n")
        assert upstream.requests == [1, 2]  # the second request came on a new connection


@pytest.mark.parametrize("answer", [chunked(b"10;x=1\r\n", DATA16, b"\r\n0\r\nX-T: 1\r\n\r\n"),
                                    sized(b"5"), sized(b" 5 ")],
                         ids=["chunked", "sized", "sized with spaces around the length"])
async def test_the_well_formed_twins_of_the_malformed_answers_are_read(client, answer):
    async with MalformedUpstream([answer]) as upstream:
        status, body = await exchange(client, upstream.base_url)
        assert status == 200 and body in (DATA16, b"hello")
        assert client.pooled() == 1


@pytest.mark.parametrize("interim", [
    b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>; rel=preload\r\n\r\n",
    b"HTTP/1.1 100 Continue\r\n\r\n" * 3000,
], ids=["100 then 103", "3000 interim heads"])
async def test_interim_1xx_heads_are_skipped_and_the_connection_kept(client, interim):
    async with MalformedUpstream([interim + GOOD_STREAM]) as upstream:
        status, body = await exchange(client, upstream.base_url)
        assert status == 200 and body.endswith(b"data: [DONE]\n\n")
        assert client.pooled() == 1
        await exchange(client, upstream.base_url)
        assert upstream.requests == [1, 1]
