"""The OpenAI Python SDK against the port: chat, streamed chat, responses, streamed
responses, and its automatic retry of a 429 honouring Retry-After."""

from __future__ import annotations

import asyncio
import time

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam
from openai.types.responses import ResponseCompletedEvent

from tests.clients.conftest import (API_KEY, MODEL_ID, OUTPUT_CAP, add_key, base_url,
                                    key_sample, occupied, occupied_place, rejections,
                                    responses_count, revoke_key, scraped_metrics, until)
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


# --- named keys ------------------------------------------------------------------------------

CHAT = "/v1/chat/completions"


async def test_a_named_key_is_served_with_its_rate_headers_and_usage_by_name(sdk_service):
    secret = await add_key("notebook", "--tokens-per-minute", "100000")
    async with openai.AsyncOpenAI(base_url=base_url(sdk_service), api_key=secret,
                                  timeout=60) as client:
        raw = await client.chat.completions.with_raw_response.create(
            model=MODEL_ID, messages=[{"role": "user", "content": PROMPT}])

    completion = raw.parse()
    assert completion.choices[0].message.content
    assert raw.headers["x-ratelimit-limit-tokens"] == "100000"
    assert int(raw.headers["x-ratelimit-remaining-tokens"]) < 100000  # this request's reservation
    used = sdk_service.usage.usage("notebook")
    assert used.requests == 1 and used.completion_tokens == OUTPUT_CAP
    assert used.prompt_tokens == not_none(completion.usage).prompt_tokens
    metrics = await scraped_metrics(sdk_service)
    assert key_sample(metrics, "gguf_studio_key_requests_total", "notebook") == 1


async def test_a_model_the_key_may_not_use_is_a_403_and_an_unserved_one_a_404(sdk_service):
    """Both refused before any compute, neither retried by the SDK; the port's unknown
    model answer comes first (it lists what is served), the key's list second."""
    secret = await add_key("narrow", "--models", "other-*")
    async with openai.AsyncOpenAI(base_url=base_url(sdk_service), api_key=secret, timeout=60,
                                  max_retries=2) as client:
        with pytest.raises(openai.PermissionDeniedError) as forbidden:
            await client.chat.completions.create(
                model=MODEL_ID, messages=[{"role": "user", "content": PROMPT}])
        with pytest.raises(openai.NotFoundError) as unknown:
            await client.chat.completions.create(
                model="other-model", messages=[{"role": "user", "content": PROMPT}])

    assert forbidden.value.status_code == 403 and forbidden.value.code == "model_not_allowed"
    assert "may not use the model 'tiny'; it may use: other-*" in forbidden.value.message
    assert unknown.value.status_code == 404 and unknown.value.code == "model_not_found"
    assert responses_count(sdk_service, CHAT, 403) == 1  # not retried
    assert responses_count(sdk_service, CHAT, 404) == 1
    assert sdk_service.usage.usage("narrow").refusals == {"model_not_allowed": 1,
                                                          "model_not_found": 1}


async def test_a_revoked_key_is_a_401_the_sdk_does_not_retry_and_other_keys_go_on(sdk_service):
    leaver = await add_key("leaver")
    stayer = await add_key("stayer")
    await revoke_key(sdk_service, "leaver")
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": PROMPT}]
    async with openai.AsyncOpenAI(base_url=base_url(sdk_service), api_key=leaver, timeout=60,
                                  max_retries=2) as client:
        with pytest.raises(openai.AuthenticationError) as refused:
            await client.chat.completions.create(model=MODEL_ID, messages=messages)
    async with openai.AsyncOpenAI(base_url=base_url(sdk_service), api_key=stayer,
                                  timeout=60) as client:
        served = await client.chat.completions.create(model=MODEL_ID, messages=messages)

    assert refused.value.status_code == 401 and refused.value.code == "invalid_api_key"
    assert "The API key 'leaver' was revoked on" in refused.value.message
    assert responses_count(sdk_service, CHAT, 401) == 1  # not retried
    assert served.choices[0].message.content
    assert sdk_service.usage.usage("stayer").requests == 1
