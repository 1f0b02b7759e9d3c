"""The OpenAI Python SDK against the port: chat, streamed chat, responses, streamed
responses, and its automatic retry of a 429 honouring Retry-After."""

from __future__ import annotations

import asyncio
import time

import openai
import pytest
from openai.types.responses import ResponseCompletedEvent

from tests.clients.conftest import (API_KEY, MODEL_ID, OUTPUT_CAP, base_url, occupied,
                                    occupied_place, rejections, responses_count, until)
from tests.not_none import not_none

PROMPT = "Say hello."


@pytest.fixture
async def sdk_service(start_studio):
    return await start_studio(parallel=2)


def sdk(service, **options) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url(service), api_key=API_KEY, timeout=60, **options)


async def test_chat(sdk_service):
    async with sdk(sdk_service) as client:
        completion = await client.chat.completions.create(
            model=MODEL_ID, messages=[{"role": "user", "content": PROMPT}])
    choice = completion.choices[0]
    assert choice.message.content
    assert choice.finish_reason == "length"  # the output cap, 16 tokens
    assert not_none(completion.usage).completion_tokens == OUTPUT_CAP


async def test_streamed_chat(sdk_service):
    async with sdk(sdk_service) as client:
        stream = await client.chat.completions.create(
            model=MODEL_ID, messages=[{"role": "user", "content": PROMPT}], stream=True)
        chunks = [chunk async for chunk in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert len({c.id for c in chunks}) == 1


async def test_responses(sdk_service):
    async with sdk(sdk_service) as client:
        response = await client.responses.create(model=MODEL_ID, input=PROMPT)
    assert response.output_text
    assert not_none(response.usage).output_tokens == OUTPUT_CAP


async def test_streamed_responses_one_id_from_the_queue_to_the_end(sdk_service):
    """Both slots busy: the SDK's stream starts with the port's response.created while
    queued, is kept alive with response.in_progress, and keeps that response id after
    admission, through to response.completed."""
    held, release = asyncio.Event(), asyncio.Event()

    async def hold_both_slots() -> None:
        async with occupied(sdk_service), occupied(sdk_service):
            held.set()
            await release.wait()

    holder = asyncio.create_task(hold_both_slots())
    await held.wait()
    events = []
    async with sdk(sdk_service) as client:
        stream = await client.responses.create(model=MODEL_ID, input=PROMPT, stream=True)
        async for event in stream:
            events.append(event)
            if (event.type == "response.in_progress" and not release.is_set()
                    and sdk_service.registry.total_waiting == 1):
                release.set()  # seen kept alive while queued: let it in
    await holder

    types = [e.type for e in events]
    assert release.is_set(), types
    assert types[0] == "response.created"
    assert types[-1] == "response.completed"
    assert "response.output_text.delta" in types and "response.output_item.done" in types
    ids = {e.response.id for e in events if hasattr(e, "response")}
    assert len(ids) == 1, ids
    last = events[-1]
    assert isinstance(last, ResponseCompletedEvent) and last.response.output_text


async def test_429_is_retried_after_retry_after_and_succeeds(start_studio):
    """max_queue 1: the slot busy and the waiting place taken, the SDK's request gets 429
    with Retry-After; the SDK waits that long, retries, and succeeds once a place frees."""
    service = await start_studio(parallel=1, max_queue=1)
    async with sdk(service, max_retries=3) as client:
        async with occupied(service):
            async with occupied_place(service) as waiting:
                started = time.monotonic()
                request = asyncio.ensure_future(client.chat.completions.with_raw_response.create(
                    model=MODEL_ID, messages=[{"role": "user", "content": PROMPT}]))
                await until(lambda: rejections(service, "server_is_overloaded") == 1, 30,
                            "the SDK's request to be refused")
                refused_after = time.monotonic() - started
        await waiting
        raw = await request
        elapsed = time.monotonic() - started

    completion = raw.parse()
    assert completion.choices[0].message.content
    assert responses_count(service, "/v1/chat/completions", 429) == 1
    # The SDK slept for the Retry-After (whole seconds, at least 1) before retrying.
    assert elapsed - refused_after >= 0.9, (refused_after, elapsed)
    assert raw.retries_taken == 1
