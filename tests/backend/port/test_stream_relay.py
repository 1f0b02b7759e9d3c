"""A stream is relayed the same on both of its paths: straight to the client's connection
from the upstream's own callback (the port's server offers a body writer), and through
ASGI `send` (any other server: here httpx's ASGI transport, which offers none).  Each
path has its own per-chunk code, so each is checked: the client gets the same events,
in order, one response id on the Responses wire; the books the same figures.

Against the fake upstream (a stream of exact length; a connection cut after k chunks)."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from backend.port.gateway import create_app
from backend.port.request_log import RequestRecord
from tests.backend.gateway_harness import CHAT, RESPONSES, Gateway, events, open_gateway
from tests.fake_upstream import FakeUpstream

MESSAGES = "/v1/messages"
#: What differs between two answers of the fake upstream: its ids and clock.
_VARYING = re.compile(rb'"(id|item_id|created|created_at)":("[^"]*"|\d+)')


async def relayed_both_ways(gw: Gateway, path: str, body: dict[str, Any]
                            ) -> list[tuple[bytes, RequestRecord]]:
    """The answer's bytes and its inspector record: through the port's server, then the
    same gateway's app through ASGI send."""
    answers = []
    async with gw.client.stream("POST", path, json=body) as response:
        assert response.status_code == 200
        answers.append(b"".join([chunk async for chunk in response.aiter_raw()]))
    app = create_app(gw.ctx).app
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://127.0.0.1") as client:
        response = await client.post(path, json=body)
        assert response.status_code == 200
        answers.append(response.content)
    records = gw.ctx.requests.records()
    return list(zip(answers, records[-2:]))


@pytest.fixture
async def gw_with_timings(fake: FakeUpstream) -> AsyncIterator[Gateway]:
    fake.timings = {"cache_n": 3, "prompt_n": 5, "predicted_n": 8}
    async with open_gateway(fake.base_url, fake.slots) as gateway:
        yield gateway


@pytest.mark.parametrize("path", [CHAT, MESSAGES, RESPONSES])
async def test_a_stream_reaches_its_client_alike_through_the_body_writer_and_through_send(
        gw_with_timings: Gateway, path: str) -> None:
    body: dict[str, Any] = {"model": "fake-model", "stream": True,
                            "fake": {"n_tokens": 8, "delay": 0.01}}
    if path == RESPONSES:
        body.update(input="hi", max_output_tokens=16)
    else:
        body.update(messages=[{"role": "user", "content": "hi"}], max_tokens=16)
    if path == CHAT:
        body["stream_options"] = {"include_usage": True}

    (writer, by_writer), (send, by_send) = await relayed_both_ways(gw_with_timings, path, body)

    assert _VARYING.sub(b"", writer) == _VARYING.sub(b"", send)
    relayed = events(send)
    assert len(relayed) >= 8 and all(event["comment"] is None for event in relayed)
    if path == RESPONSES:  # one response id throughout
        assert len(set(re.findall(rb'"id":"(resp_[^"]*)"', send))) == 1
    for record in (by_writer, by_send):
        assert record.route == path and record.status == 200 and record.stream
        assert record.output_tokens == 8 and record.error is None
        assert record.time_to_first_token is not None and record.longest_gap is not None
    if path == CHAT:  # the final chunk's timings: the engine's cache figures, for the owner
        assert by_writer.cached_tokens == by_send.cached_tokens == 3
    if path == MESSAGES:  # its prompt is named in its message_start only
        assert by_writer.prompt_tokens == by_send.prompt_tokens == 3


async def test_a_stream_the_engine_drops_ends_alike_with_whole_events_then_one_error(
        gw: Gateway) -> None:
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}],
            "stream": True, "fake": {"n_tokens": 8, "delay": 0.01, "die_after": 3}}

    (writer, by_writer), (send, by_send) = await relayed_both_ways(gw, CHAT, body)

    assert _VARYING.sub(b"", writer) == _VARYING.sub(b"", send)
    relayed = events(send)
    assert [event["data"]["choices"][0]["delta"].get("content") for event in relayed[:-2]
            ] == [None, "tok0 ", "tok1 "]
    assert relayed[-2]["data"]["error"]["code"] == "upstream_failed"
    assert relayed[-1]["data"] == "[DONE]"
    assert by_writer.error == by_send.error == "upstream_failed"
