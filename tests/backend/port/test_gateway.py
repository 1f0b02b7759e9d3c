"""The OpenAI-compatible port, against a fake llama-server with exact timings and faults.

Every row of the overload contract (DESIGN.md, issue 3) has a test here.  No sleep is
used as synchronisation: tests wait for observable state (registry counts, what the fake
upstream saw) with `until`, which polls a condition under a timeout.

`open_gateway(base_url, slots)` is the harness: it takes any backend base URL, so the
same tests can be pointed at a real llama-server.
"""

from __future__ import annotations

import asyncio
import socket
from dataclasses import replace
from typing import Any

import httpx
import openai
import pytest
from openai.types.responses import ResponseOutputMessage, ResponseOutputText

from backend.llama.load import Serving, Snapshot, State
from tests.backend.gateway_harness import (
    CHAT, Gateway, KEY, RESPONSES, assert_clean_error, assert_no_internals, cancel, chat,
    events, holding, open_gateway, stream, until)
from tests.fake_upstream import MODEL_PATH
from tests.not_none import not_none


# --- N+1 streams: one waits, hears keep-alives, completes ------------------------------


async def test_n_plus_one_chat_streams_exactly_one_waits_with_keepalive_comments(gw, fake):
    body = chat(True, fake={"delay": 0.05, "n_tokens": 10})
    tasks = [asyncio.create_task(stream(gw.client, CHAT, body)) for _ in range(fake.slots + 1)]
    await until(lambda: gw.registry.current.active == fake.slots and gw.registry.current.waiting == 1)
    results = await asyncio.wait_for(asyncio.gather(*tasks), 10)

    waited = [raw for _, raw in results if b": keep-alive" in raw]
    assert len(waited) == 1
    for response, raw in results:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        parsed = events(raw)
        assert parsed[-1]["data"] == "[DONE]"
        finals = [e["data"]["choices"][0]["finish_reason"] for e in parsed
                  if isinstance(e["data"], dict) and e["data"]["choices"][0]["finish_reason"]]
        assert finals == ["stop"]
        assert sum(1 for e in parsed if isinstance(e["data"], dict)) == 1 + 10 + 1
    parsed = events(waited[0])
    first_data = next(i for i, e in enumerate(parsed) if e["data"] is not None)
    assert first_data >= 1 and all(e["comment"] == "keep-alive" for e in parsed[:first_data])
    assert not any(e["comment"] for e in parsed[first_data:])
    assert gw.registry.total_active == 0 and gw.registry.total_waiting == 0
    assert gw.metrics.value("gguf_studio_queue_wait_seconds_count") == fake.slots + 1


async def test_n_plus_one_responses_streams_keep_one_response_id_throughout(gw, fake):
    body = {"model": "fake-model", "input": "hi", "stream": True,
            "fake": {"delay": 0.05, "n_tokens": 10}}
    tasks = [asyncio.create_task(stream(gw.client, RESPONSES, body)) for _ in range(fake.slots + 1)]
    await until(lambda: gw.registry.current.active == fake.slots and gw.registry.current.waiting == 1)
    results = await asyncio.wait_for(asyncio.gather(*tasks), 10)

    # Every stream carries the port's id (the engine's `response.created` comes with its
    # prompt's progress, which the port keeps to itself: backend.port.prefill); the one
    # that waited heard `response.in_progress` events meanwhile.
    assert not any(b"resp_upstream" in raw for _, raw in results)
    waited = [raw for _, raw in results if raw.count(b"event: response.in_progress") >= 2]
    assert len(waited) == 1, "exactly one stream waited"
    parsed = events(waited[0])
    assert not any(e["comment"] for e in parsed), "Codex ignores comments: events only"
    types = [e["data"]["type"] for e in parsed]
    assert types[0] == "response.created"
    first_upstream = types.index("response.output_item.added")
    assert types[1:first_upstream].count("response.in_progress") >= 2
    assert types.count("response.created") == 1
    assert types[-2:] == ["response.output_item.done", "response.completed"]
    ours = parsed[0]["data"]["response"]["id"]
    assert ours.startswith("resp_")
    ids = {e["data"]["response"]["id"] for e in parsed if "response" in e["data"]}
    assert ids == {ours}
    assert parsed[-1]["data"]["response"]["status"] == "completed"
    assert parsed[-1]["data"]["response"]["output"][0]["content"][0]["text"].startswith("tok0 ")
    for response, raw in results:
        assert response.status_code == 200
        ids = {e["data"]["response"]["id"] for e in events(raw) if "response" in e["data"]}
        assert len(ids) == 1


async def test_a_stream_admitted_at_once_is_relayed_unchanged_but_for_its_one_id(gw, fake):
    response, raw = await stream(gw.client, RESPONSES, {"input": "hi", "stream": True})
    async with httpx.AsyncClient(base_url=fake.base_url, trust_env=False) as direct_client:
        _, direct_raw = await stream(direct_client, RESPONSES, {"input": "hi", "stream": True})
    assert response.status_code == 200
    shape = [(e["event"], e["data"]["type"]) for e in events(raw)]
    assert shape == [(e["event"], e["data"]["type"]) for e in events(direct_raw)]
    ids = {e["data"]["response"]["id"] for e in events(raw) if "response" in e["data"]}
    assert len(ids) == 1 and b"resp_upstream" not in raw


async def test_a_silent_engine_reading_a_long_prompt_gets_keepalives_too(gw, fake):
    """Admitted at once, but llama-server sends nothing until it has read the prompt."""
    body = chat(True, fake={"prompt_delay": 0.4, "n_tokens": 3})
    response, raw = await stream(gw.client, CHAT, body)
    parsed = events(raw)
    first_data = next(i for i, e in enumerate(parsed) if e["data"] is not None)
    assert first_data >= 2 and all(e["comment"] == "keep-alive" for e in parsed[:first_data])
    assert parsed[-1]["data"] == "[DONE]"


async def test_a_silent_engine_on_the_responses_wire_gets_our_created_event_and_one_id(gw, fake):
    body = {"model": "fake-model", "input": "hi", "stream": True,
            "fake": {"prompt_delay": 0.4, "n_tokens": 3}}
    response, raw = await stream(gw.client, RESPONSES, body)
    parsed = events(raw)
    assert not any(e["comment"] for e in parsed), "Codex ignores comments: events only"
    types = [e["data"]["type"] for e in parsed]
    assert types[0] == "response.created" and types.count("response.created") == 1
    assert types[1] == "response.in_progress"
    assert types[-1] == "response.completed"
    assert b"resp_upstream" not in raw
    assert len({e["data"]["response"]["id"] for e in parsed if "response" in e["data"]}) == 1


# --- refusals before any byte ------------------------------------------------------------


async def test_queue_full_gives_exact_429s_with_retry_after(gw, fake):
    gw.configure(max_queue=2)
    gw.registry.set_capacity(fake.slots)  # max_waiting is re-read from the settings
    async with holding(gw, fake.slots):
        waiters = [asyncio.create_task(stream(gw.client, CHAT, chat(True))) for _ in range(2)]
        await until(lambda: gw.registry.total_waiting == 2)
        before = gw.rejections("server_is_overloaded"), gw.requests(CHAT, 429)

        refused = await asyncio.gather(*[gw.client.post(CHAT, json=chat(stream_)) for stream_ in
                                         (False, True, False, True, False)])

        for response in refused:
            error = assert_clean_error(response, 429, "server_is_overloaded", gw)
            assert error["type"] == "server_error"
            assert int(response.headers["retry-after"]) >= 1
        assert gw.rejections("server_is_overloaded") - before[0] == 5
        assert gw.requests(CHAT, 429) - before[1] == 5
        assert gw.registry.total_waiting == 2
        await cancel(*waiters)
    await until(lambda: gw.registry.total_waiting == 0)


async def test_model_not_ready_is_503_with_retry_after(gw):
    ready = gw.ctx.snapshot()
    for snapshot in (replace(ready, state=State.STARTING, serving=None),
                     replace(ready, state=State.STARTING, serving=None, restarting=True),
                     Snapshot()):
        gw.ctx.set_snapshot(snapshot)
        for path, body in ((CHAT, chat()), (RESPONSES, {"input": "x", "stream": True}),
                           ("/v1/embeddings", {"input": "x"})):
            response = await gw.client.post(path, json=body)
            assert_clean_error(response, 503, "model_not_ready", gw)
            assert int(response.headers["retry-after"]) >= 1
    assert gw.rejections("model_not_ready") == 9

    gw.ctx.set_snapshot(ready)
    gw.registry.retire_current()  # a reload under way: no current queue
    response = await gw.client.post(CHAT, json=chat())
    assert_clean_error(response, 503, "model_not_ready", gw)
    assert "retry-after" in response.headers


async def test_queue_timeout_before_any_byte_is_503(gw, fake):
    gw.configure(queue_timeout=0.2)
    async with holding(gw, fake.slots):
        response = await gw.client.post(CHAT, json=chat())
        assert_clean_error(response, 503, "queue_timeout", gw)
        assert int(response.headers["retry-after"]) >= 1
        assert gw.registry.total_waiting == 0
    assert gw.rejections("queue_timeout") == 1


# --- refusals inside a stream ------------------------------------------------------------


@pytest.mark.parametrize("path", [CHAT, "/v1/completions", "/v1/messages"])
async def test_queue_timeout_after_keepalives_is_a_final_in_stream_error(gw, fake, path):
    gw.configure(queue_timeout=0.3)
    body = {"prompt": "x", "stream": True} if path == "/v1/completions" else chat(True)
    async with holding(gw, fake.slots):
        response, raw = await asyncio.wait_for(stream(gw.client, path, body), 5)
    assert response.status_code == 200
    parsed = events(raw)
    assert parsed[0]["comment"] == "keep-alive" and parsed[-2]["comment"] is None
    error = parsed[-2]["data"]["error"]
    assert error["code"] == "queue_timeout" and error["type"] == "server_error"
    assert error["message"] and "param" in error
    if path == "/v1/messages":
        assert parsed[-2]["event"] == "error" and parsed[-2]["data"]["type"] == "error"
    assert parsed[-1]["data"] == "[DONE]", "the client must see the stream as finished"
    assert_no_internals(raw.decode(), gw)
    assert gw.rejections("queue_timeout") == 1
    assert gw.registry.total_waiting == 0


async def test_responses_queue_timeout_after_keepalives_is_response_failed(gw, fake):
    gw.configure(queue_timeout=0.3)
    async with holding(gw, fake.slots):
        response, raw = await asyncio.wait_for(
            stream(gw.client, RESPONSES, {"input": "x", "stream": True}), 5)
    parsed = events(raw)
    assert [e["event"] for e in parsed][0] == "response.created"
    assert {e["event"] for e in parsed[1:-1]} == {"response.in_progress"}
    failed = parsed[-1]
    assert failed["event"] == "response.failed" and failed["data"]["type"] == "response.failed"
    assert failed["data"]["response"]["id"] == parsed[0]["data"]["response"]["id"]
    assert failed["data"]["response"]["status"] == "failed"
    assert failed["data"]["response"]["error"]["code"] == "queue_timeout"
    assert isinstance(failed["data"]["response"]["error"]["message"], str)
    assert gw.rejections("queue_timeout") == 1


async def test_upstream_error_after_keepalives_ends_the_stream_with_its_message(gw, fake):
    body = chat(True, fake={"status": 400, "error_type": "exceed_context_size_error",
                            "message": f"request exceeds the context; model {MODEL_PATH}"})
    async with holding(gw, fake.slots) as holders:
        async with gw.client.stream("POST", CHAT, json=body) as response:
            chunks = response.aiter_raw()
            raw = await chunks.__anext__()
            assert raw == b": keep-alive\n\n"
            await cancel(holders[0])  # a slot frees: the waiter goes upstream
            raw += b"".join([chunk async for chunk in chunks])
    parsed = events(raw)
    assert parsed[-2]["data"]["error"]["code"] == "context_length_exceeded"
    assert "exceeds the context" in parsed[-2]["data"]["error"]["message"]
    assert parsed[-1]["data"] == "[DONE]"
    assert_no_internals(raw.decode(), gw)
    assert gw.rejections("context_length_exceeded") == 0, "llama-server's answer, not ours"


# --- clients that go away ------------------------------------------------------------------


async def test_disconnect_while_queued_leaves_the_line_at_once(gw, fake):
    async with holding(gw, fake.slots):
        streamed = asyncio.create_task(stream(gw.client, CHAT, chat(True)))
        plain = asyncio.create_task(gw.client.post(CHAT, json=chat()))
        responses = asyncio.create_task(stream(gw.client, RESPONSES, {"input": "x", "stream": True}))
        await until(lambda: gw.registry.total_waiting == 3)
        await cancel(streamed, plain, responses)
        await until(lambda: gw.registry.total_waiting == 0, timeout=1.0)
        await until(lambda: gw.cancellations("queued") == 3, timeout=1.0)
        assert gw.registry.total_active == fake.slots
        assert len(fake.requests) == fake.slots, "nothing that left the line reached the engine"


@pytest.mark.parametrize("streamed", [True, False])
async def test_disconnect_while_running_closes_upstream_and_frees_the_slot(gw, fake, streamed):
    body = chat(streamed, fake={"delay": 0.05, "n_tokens": 1000} if streamed else {"hang": True})

    async def read_some() -> None:
        async with gw.client.stream("POST", CHAT, json=body) as response:
            # Held, not left by a `break`: a dropped iterator is closed when collected,
            # which hangs up at a random moment (the request then ended before the test
            # saw it run, 1 run in 25).
            chunks = response.aiter_raw()
            await anext(chunks)
            await asyncio.Event().wait()

    task = asyncio.create_task(read_some() if streamed else gw.client.post(CHAT, json=body))
    await until(lambda: task.done() or (fake.active == 1 and gw.registry.total_active == 1),
                timeout=30)
    assert not task.done(), f"the request ended before it was cut: {task!r}"
    await cancel(task)
    # A longer deadline than the harness's 5 s: on 2 loaded cores the fake has taken
    # longer than that to notice its closed socket (the CI run beside a bench).
    await until(lambda: fake.disconnects == 1, timeout=30)
    await until(lambda: gw.registry.total_active == 0, timeout=30)
    assert gw.cancellations("running") == 1 and gw.cancellations("queued") == 0
    assert fake.completed == 0


# --- the engine fails ---------------------------------------------------------------------


async def test_upstream_dying_mid_stream_gives_a_final_error_event(gw, fake):
    response, raw = await asyncio.wait_for(
        stream(gw.client, CHAT, chat(True, fake={"die_after": 3})), 5)
    assert response.status_code == 200
    parsed = events(raw)
    assert [e["data"]["choices"][0]["delta"] for e in parsed[:3]] == [
        {"role": "assistant", "content": None}, {"content": "tok0 "}, {"content": "tok1 "}]
    assert parsed[3]["data"]["error"]["code"] == "upstream_failed"
    assert parsed[4:] == [{"event": None, "data": "[DONE]", "comment": None}]
    assert_no_internals(raw.decode(), gw)
    assert gw.registry.total_active == 0
    assert gw.rejections("upstream_failed") == 1


async def test_upstream_dying_mid_responses_stream_fails_the_response_it_started(gw, fake):
    _, raw = await asyncio.wait_for(
        stream(gw.client, RESPONSES, {"input": "x", "stream": True, "fake": {"die_after": 2}}), 5)
    parsed = events(raw)
    started = parsed[0]["data"]["response"]["id"]
    assert parsed[-1]["event"] == "response.failed"
    assert parsed[-1]["data"]["response"]["id"] == started
    assert parsed[-1]["data"]["response"]["error"]["code"] == "upstream_failed"


async def test_upstream_dying_after_a_reload_says_the_model_was_reloaded(gw, fake):
    body = chat(True, fake={"delay": 0.05, "n_tokens": 20, "die_after": 5})
    async with gw.client.stream("POST", CHAT, json=body) as response:
        chunks = response.aiter_raw()
        first = await chunks.__anext__()
        gw.registry.activate(Serving("http://127.0.0.1:9", 1))  # a new load took over meanwhile
        raw = first + b"".join([chunk async for chunk in chunks])
    parsed = events(raw)
    assert parsed[-2]["data"]["error"]["code"] == "model_reloaded"
    assert parsed[-1]["data"] == "[DONE]"
    await until(lambda: gw.registry.queue_for(fake.base_url) is None)  # drained, pruned


async def test_upstream_dying_before_a_non_streamed_answer_is_502(gw, fake):
    response = await gw.client.post(CHAT, json=chat(fake={"die_after": 1}))
    assert_clean_error(response, 502, "upstream_failed", gw)


async def test_unreachable_upstream_is_a_clean_502():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{probe.getsockname()[1]}"
    async with open_gateway(dead, 1) as gw:
        for body in (chat(), chat(True)):
            response = await gw.client.post(CHAT, json=body)
            assert_clean_error(response, 502, "upstream_unavailable", gw)
        assert gw.registry.total_active == 0
        assert gw.rejections("upstream_unavailable") == 2


async def test_upstream_error_answers_pass_through_without_internals(gw, fake):
    leaky = f"failed to open {MODEL_PATH} (listening on 127.0.0.1:{fake.port}, http://127.0.0.1:{fake.port}/slots)"
    response = await gw.client.post(CHAT, json=chat(fake={"status": 500, "message": leaky}))
    error = assert_clean_error(response, 500, "server_error", gw)
    assert error["message"].startswith("failed to open")

    context = chat(True, fake={"status": 400, "error_type": "exceed_context_size_error",
                               "message": "request (9000 tokens) exceeds the available context size (4096 tokens)"})
    response = await gw.client.post(CHAT, json=context)
    error = assert_clean_error(response, 400, "context_length_exceeded", gw)
    assert error["type"] == "exceed_context_size_error"
    assert "exceeds the available context size" in error["message"]
    assert sum(gw.metrics.totals()["rejections"].values()) == 0



# --- the OpenAI Python SDK -----------------------------------------------------------------------


def sdk(gw: Gateway, **kwargs: Any) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=KEY, **kwargs)


async def test_openai_sdk_chat_streamed_chat_responses_streamed_responses(gw, fake):
    gw.configure(api_key=KEY)
    gw.client.headers["authorization"] = f"Bearer {KEY}"  # for the slot holders
    async with sdk(gw, max_retries=0) as client:
        reply = await client.chat.completions.create(
            model="fake-model", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert reply.choices[0].message.content == "tok0 tok1 tok2 tok3 "
        assert reply.choices[0].finish_reason == "length"

        text, finish = "", None
        async for chunk in await client.chat.completions.create(
                model="fake-model", messages=[{"role": "user", "content": "hi"}], stream=True):
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
        assert text.startswith("tok0 ") and finish == "stop"

        response = await client.responses.create(model="fake-model", input="hi")
        message = response.output[0]
        assert isinstance(message, ResponseOutputMessage) and isinstance(message.content[0], ResponseOutputText)
        assert message.content[0].text.startswith("tok0 ")

        # Streamed, and made to wait first: the SDK sees the gateway's events, one id.
        async with holding(gw, fake.slots):
            task = asyncio.create_task(_collect_responses(client))
            await until(lambda: gw.registry.total_waiting == 1)
        kinds, ids, final = await asyncio.wait_for(task, 5)
        assert kinds[0] == "response.created" and "response.in_progress" in kinds
        assert kinds[-2:] == ["response.output_item.done", "response.completed"]
        assert len(ids) == 1 and final.output[0].content[0].text.startswith("tok0 ")

        models = await client.models.list()
        assert [m.id for m in models.data] == ["fake-model", "default"]


async def _collect_responses(client: openai.AsyncOpenAI) -> tuple[list[str], set[str], Any]:
    kinds: list[str] = []
    ids: set[str] = set()
    final = None
    async for event in await client.responses.create(model="fake-model", input="hi", stream=True):
        kinds.append(event.type)
        response = getattr(event, "response", None)
        if response is not None:
            ids.add(response.id)
            final = response
    return kinds, ids, final


async def test_openai_sdk_sees_an_in_stream_error_as_an_error(gw):
    async with sdk(gw, max_retries=0) as client:
        with pytest.raises(openai.APIError, match="stopped while answering"):
            async for _ in await client.chat.completions.create(
                    model="fake-model", messages=[{"role": "user", "content": "hi"}], stream=True,
                    extra_body={"fake": {"die_after": 2}}):
                pass


async def test_openai_sdk_retries_a_429_after_retry_after_and_succeeds(gw, fake):
    gw.configure(max_queue=1)
    gw.registry.set_capacity(1)  # one slot, one place in line
    assert (await gw.client.post(CHAT, json=chat())).status_code == 200  # learn a short service time
    busy = chat(True, fake={"delay": 0.05, "n_tokens": 6})
    holder = asyncio.create_task(stream(gw.client, CHAT, busy))
    await until(lambda: gw.registry.total_active == 1)
    waiter = asyncio.create_task(stream(gw.client, CHAT, busy))
    await until(lambda: gw.registry.total_waiting == 1)

    first = await gw.client.post(CHAT, json=chat())
    assert first.status_code == 429 and first.headers["retry-after"] == "1"
    async with sdk(gw, max_retries=2) as client:
        reply = await asyncio.wait_for(client.chat.completions.create(
            model="fake-model", messages=[{"role": "user", "content": "hi"}]), 10)
    assert not_none(reply.choices[0].message.content).startswith("tok0 ")
    assert gw.rejections("server_is_overloaded") == 2, "our probe and the SDK's first try"
    await asyncio.gather(holder, waiter)
