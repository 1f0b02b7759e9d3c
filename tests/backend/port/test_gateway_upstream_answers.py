"""What the port makes of a malformed or unexpected upstream answer: a clean 502 (or an
in-stream error once the stream has started), and a fresh upstream connection next time;
a stream cut in the middle of an event reaches the client as whole events, then the error.

The upstream is `tests/malformed_upstream.py`, a raw asyncio socket, because a real
llama-server cannot produce these answers.
"""

from __future__ import annotations

from tests.backend.gateway_harness import (CHAT, assert_clean_error, assert_no_internals,
                                           chat, events, open_gateway, stream)
import pytest

from tests.malformed_upstream import GOOD_EVENTS, Cut, MalformedUpstream, good_json

SSE_HEAD = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def test_a_malformed_answer_head_is_a_clean_502_and_its_connection_is_dropped():
    malformed = good_json().replace(b"Content-Length: ", b"Content-Length: +")
    async with MalformedUpstream([malformed], fallback=good_json()) as upstream:
        async with open_gateway(upstream.base_url, 1) as gw:
            response = await gw.client.post(CHAT, json=chat())
            assert_clean_error(response, 502, "upstream_failed", gw)
            again = await gw.client.post(CHAT, json=chat())
            assert again.status_code == 200 and again.json()["object"] == "chat.completion"
            assert upstream.requests == [1, 2]  # not sent on the broken connection
            assert gw.registry.total_active == 0


async def test_a_chunk_without_its_crlf_ends_the_stream_with_an_error_event():
    broken = SSE_HEAD + chunk(GOOD_EVENTS[0]) + b"5\r\ndata:XX0\r\n\r\n"
    async with MalformedUpstream([broken]) as upstream:
        async with open_gateway(upstream.base_url, 1) as gw:
            response, raw = await stream(gw.client, CHAT, chat(True))
            assert response.status_code == 200
            parsed = events(raw)
            assert parsed[0]["data"]["choices"][0]["delta"] == {"content": "ok"}
            assert parsed[-2]["data"]["error"]["code"] == "upstream_failed"
            assert parsed[-1]["data"] == "[DONE]"
            assert_no_internals(raw.decode(), gw)
            response, raw = await stream(gw.client, CHAT, chat(True))
            assert events(raw)[-1]["data"] == "[DONE]" and b"error" not in raw
            assert upstream.requests == [1, 2]


async def test_a_redirect_or_an_odd_content_type_is_not_relayed():
    redirect = (b"HTTP/1.1 302 Found\r\nLocation: http://10.1.2.3/secret\r\n"
                b"Content-Type: application/json\r\nContent-Length: 2\r\n\r\n{}")
    html = good_json(b"<html>hi</html>").replace(b"application/json", b"text/html")
    untyped = good_json().replace(b"Content-Type: application/json\r\n", b"")
    created = good_json().replace(b"200 OK", b"201 Created")
    json_for_a_stream = good_json()
    answers = [redirect, html, untyped, created, json_for_a_stream]
    async with MalformedUpstream(answers, fallback=good_json()) as upstream:
        async with open_gateway(upstream.base_url, 1) as gw:
            for _ in range(4):
                response = await gw.client.post(CHAT, json=chat())
                assert_clean_error(response, 502, "upstream_failed", gw)
                assert "10.1.2.3" not in response.text
            response = await gw.client.post(CHAT, json=chat(True))
            assert_clean_error(response, 502, "upstream_failed", gw)
            assert gw.rejections("upstream_failed") == 5


async def test_interim_1xx_heads_before_the_answer_are_skipped():
    interim = b"HTTP/1.1 100 Continue\r\n\r\n" * 2000 + b"HTTP/1.1 103 Early Hints\r\n\r\n"
    async with MalformedUpstream([interim + good_json()], fallback=good_json()) as upstream:
        async with open_gateway(upstream.base_url, 1) as gw:
            response = await gw.client.post(CHAT, json=chat())
            assert response.status_code == 200 and response.json()["object"] == "chat.completion"
            await gw.client.post(CHAT, json=chat())
            assert upstream.requests == [1, 1]  # a good answer keeps its connection


# --- a stream cut in the middle of an event ------------------------------------------------

#: The first bytes of an event, as a killed engine may leave them.
PARTIAL = b'data: {"choices":[{"delta":{"content":"cut h'
CLOSE_DELIMITED = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n"
CUTS = {
    # The connection ends (the engine was killed) inside a chunk, or between chunks.
    "killed inside a chunk": Cut(SSE_HEAD + chunk(GOOD_EVENTS[0]) + b"40\r\n" + PARTIAL),
    "killed between chunks": Cut(SSE_HEAD + chunk(GOOD_EVENTS[0] + PARTIAL)),
    # The HTTP answer itself ends cleanly, but its last event is not whole.
    "chunked answer ends mid-event": SSE_HEAD + chunk(GOOD_EVENTS[0] + PARTIAL) + b"0\r\n\r\n",
    "close-delimited answer ends mid-event": Cut(CLOSE_DELIMITED + GOOD_EVENTS[0] + PARTIAL),
}


@pytest.mark.parametrize("answer", list(CUTS.values()), ids=list(CUTS))
async def test_a_stream_cut_mid_event_delivers_whole_events_then_the_clean_error(answer):
    """(Injected by a raw-socket upstream: a real engine is cut mid-event only by chance,
    about once in ten kills.)"""
    async with MalformedUpstream([answer]) as upstream:
        async with open_gateway(upstream.base_url, 1) as gw:
            response, raw = await stream(gw.client, CHAT, chat(True))
            assert response.status_code == 200
            assert b"cut h" not in raw
            parsed = events(raw)  # every event parses: none is cut
            assert parsed[0]["data"]["choices"][0]["delta"] == {"content": "ok"}
            assert parsed[1]["data"]["error"]["code"] == "upstream_failed"
            assert parsed[2:] == [{"event": None, "data": "[DONE]", "comment": None}]
            assert_no_internals(raw.decode(), gw)
            assert gw.registry.total_active == 0


async def test_an_engine_error_after_text_that_looks_like_an_event_keeps_that_event_whole():
    """The engine's error event is found at an event's start, not inside a text."""
    tricky = b'data: {"choices":[{"delta":{"content":"see event: error below"}}]}\n\n'
    failure = b'data: {"error":{"code":500,"message":"boom","type":"server_error"}}\n\n'
    answer = SSE_HEAD + chunk(tricky + failure) + b"0\r\n\r\n"
    async with MalformedUpstream([answer]) as upstream:
        async with open_gateway(upstream.base_url, 1) as gw:
            _, raw = await stream(gw.client, CHAT, chat(True))
            parsed = events(raw)
            assert parsed[0]["data"]["choices"][0]["delta"] == {"content": "see event: error below"}
            assert parsed[1]["data"]["error"]["message"] == "boom"
            assert parsed[2]["data"] == "[DONE]" and len(parsed) == 3
