"""A client that hangs up while the engine reads its prompt, and sends the same request
again, gets the answer of the work already under way: the real llama-server with SmolLM2,
one thread and small batches, so that a prompt of 1,000 tokens takes seconds to read.
The engine's own counters (its /metrics) say how many prompts it read; the inspector
how many requests were booked."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, cast

import httpx
from starlette.types import Message

from backend.app.service import StudioService
from backend.llama.api import engine_headers
from backend.llama.load import LoadSettings, Snapshot
from backend.keys.key_store import CHAT_NAME
from backend.port.resends import (FINISHED_ANSWERS, FINISHED_BYTES, JOINED_FINISHED,
                                  JOINED_RUNNING, Resends)
from tests.backend.port.test_prefill import CONTEXT, PROMPT_TOKENS
from tests.backend.service_harness import ServiceFactory, long_text

KEEPALIVE = 0.2
GRACE = 20.0
CHAT = "/v1/chat/completions"


async def started(running_service: ServiceFactory, smollm2_model: Any,
                  grace: float) -> StudioService:
    service = await running_service(keepalive_interval=KEEPALIVE, stall_budget_ms=0,
                                    resend_grace=grace)
    await service.load(LoadSettings(parallel="1", ctx_size=CONTEXT, threads=1,
                                    extra_args=("-b", "256", "-ub", "64"))
                       .to_spec(str(smollm2_model), model_id="tiny"))
    return service


async def engine_counts(snapshot: Snapshot) -> dict[str, float]:
    """llama-server's own counters (its /metrics, `llamacpp:NAME value`)."""
    assert snapshot.serving is not None
    async with httpx.AsyncClient(base_url=snapshot.serving.base_url,
                                 headers=engine_headers(snapshot.serving.api_key)) as engine:
        text = (await engine.get("/metrics")).text
    counts = {}
    for line in text.splitlines():
        if line.startswith("llamacpp:"):
            name, value = line[len("llamacpp:"):].split()
            counts[name] = float(value)
    return counts


def chat_body(text: str) -> dict[str, Any]:
    return {"model": "tiny", "stream": True, "max_tokens": 8, "temperature": 0,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": text}]}


def port(service: StudioService) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=f"http://127.0.0.1:{service.gateway_port}", timeout=300)


async def hang_up_while_read(service: StudioService, body: dict[str, Any]) -> None:
    """Send `body` and hang up once the keep-alives say the engine is reading its prompt."""
    async with port(service) as client:
        async with client.stream("POST", CHAT, json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith(": keep-alive; prefill ") and ", ETA " in line:
                    return  # leaving the block closes the connection


async def answer_of(service: StudioService, body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The streamed answer's text and usage."""
    text, usage = "", cast(dict[str, Any], {})
    async with port(service) as client:
        async with client.stream("POST", CHAT, json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                for choice in event.get("choices", []):
                    text += choice["delta"].get("content") or ""
                usage = event.get("usage") or usage
    return text, usage


async def records(service: StudioService) -> list[dict[str, Any]]:
    async with port(service) as client:
        return list((await client.get("/requests")).json()["data"])


async def test_a_resend_within_the_grace_joins_the_running_request_one_prefill_one_booking(
        running_service: ServiceFactory, smollm2_model: Any) -> None:
    service = await started(running_service, smollm2_model, GRACE)
    snapshot = service.snapshot()
    body = chat_body(await long_text(snapshot, PROMPT_TOKENS, 17))
    before = await engine_counts(snapshot)

    await hang_up_while_read(service, body)
    text, usage = await answer_of(service, body)  # sent again at once, as Claude Code does

    after = await engine_counts(snapshot)
    # One prompt read, all of it, none of it cached: no second request reached the engine.
    assert after["prompt_tokens_total"] - before["prompt_tokens_total"] == usage["prompt_tokens"]
    assert after["prompt_tokens_cached_total"] == before["prompt_tokens_cached_total"]
    assert after["tokens_predicted_total"] - before["tokens_predicted_total"] \
        == usage["completion_tokens"]
    assert text and usage["completion_tokens"] > 0
    # One booking, which says that the resend joined.
    [record] = await records(service)
    assert record["joined"] == JOINED_RUNNING and record["status"] == 200
    assert record["prompt_tokens"] == usage["prompt_tokens"]
    assert record["output_tokens"] == usage["completion_tokens"]


async def test_without_a_resend_the_engine_stops_when_the_grace_ends(
        running_service: ServiceFactory, smollm2_model: Any) -> None:
    grace = 2.0
    service = await started(running_service, smollm2_model, grace)
    snapshot = service.snapshot()
    body = chat_body(await long_text(snapshot, 3 * PROMPT_TOKENS, 19))
    before = await engine_counts(snapshot)

    await hang_up_while_read(service, body)
    left = time.monotonic()
    # Kept working meanwhile (the prompt takes many times the grace to read)...
    assert (await engine_counts(snapshot))["requests_processing"] == 1
    # ... then cut as for any client that left, which the engine heeds between two steps
    # of its prompt (-b 256: seconds each on one thread).
    deadline = left + grace + 10.0
    while (await engine_counts(snapshot))["requests_processing"] != 0:
        assert time.monotonic() < deadline, "the engine still works after the grace"
        await asyncio.sleep(0.1)
    assert time.monotonic() - left >= grace - 0.5
    after = await engine_counts(snapshot)
    [record] = await records(service)
    assert record["status"] == 499 and record["joined"] is None
    # The engine counts the steps it read: far from the whole prompt, and no answer.
    read = after["prompt_tokens_total"] - before["prompt_tokens_total"]
    assert 0 < read < 3 * PROMPT_TOKENS / 2 and record["prefilled"] <= read
    assert after["tokens_predicted_total"] == before["tokens_predicted_total"]


async def test_a_resend_after_the_answer_finished_gets_it_without_a_second_generation(
        running_service: ServiceFactory, smollm2_model: Any) -> None:
    service = await started(running_service, smollm2_model, GRACE)
    snapshot = service.snapshot()
    body = chat_body(await long_text(snapshot, PROMPT_TOKENS, 23))

    await hang_up_while_read(service, body)
    deadline = time.monotonic() + 120
    while not await records(service):  # the work went on to the answer's end
        assert time.monotonic() < deadline
        await asyncio.sleep(0.2)
    [first] = await records(service)
    assert first["status"] == 499 and first["output_tokens"] > 0  # booked in full, once
    before = await engine_counts(snapshot)

    text, usage = await answer_of(service, body)

    after = await engine_counts(snapshot)
    assert after["prompt_tokens_total"] == before["prompt_tokens_total"]
    assert after["tokens_predicted_total"] == before["tokens_predicted_total"]
    assert text and usage["completion_tokens"] == first["output_tokens"]
    assert usage["prompt_tokens"] == first["prompt_tokens"]
    resent = (await records(service))[-1]
    assert resent["joined"] == JOINED_FINISHED and resent["status"] == 200
    assert resent["prompt_tokens"] is None  # booked once, by the first


async def test_a_request_whose_client_is_still_there_is_never_joined(
        running_service: ServiceFactory, smollm2_model: Any) -> None:
    # Two clients asking the same at once are asked twice (a burst of "Hello").
    service = await started(running_service, smollm2_model, GRACE)
    body = chat_body("Say hello.")
    answers = await asyncio.gather(answer_of(service, body), answer_of(service, body))
    assert all(text for text, _ in answers)
    assert [r["joined"] for r in await records(service)] == [None, None]


class _Orphan:
    metrics: Any = None

    async def adopt(self, listener: Any) -> bool:
        return True


def test_the_chat_tabs_stop_is_never_kept_for_a_resend_and_one_orphan_holds_a_key() -> None:
    resends = Resends(lambda: GRACE)
    assert not resends.orphaned("k", _Orphan(), CHAT_NAME)  # its Stop means stop
    first, second = _Orphan(), _Orphan()
    assert resends.orphaned("k", first, "alice") and not resends.orphaned("k", second, "alice")
    assert resends.orphan("k") is first and resends.orphan("k") is None
    assert not Resends(lambda: 0.0).orphaned("k", first, "alice")  # no grace: cut at once


def test_finished_answers_are_kept_for_the_grace_one_taker_each_and_bounded() -> None:
    now = [0.0]
    resends = Resends(lambda: GRACE, clock=lambda: now[0])
    answer: list[Message] = [{"type": "http.response.body", "body": b"x" * 1000,
                              "more_body": False}]
    resends.finished("a", answer)
    found = resends.answer("a")
    assert found is not None and list(found.messages) == answer
    assert resends.answer("a") is None  # one resend gets it
    resends.finished("b", answer)
    now[0] = GRACE + 0.1
    assert resends.answer("b") is None and not resends  # gone once its grace is over
    for n in range(FINISHED_ANSWERS + 1):
        resends.finished(str(n), answer)
    assert resends.answer("0") is None and resends.answer(str(FINISHED_ANSWERS)) is not None
    huge: list[Message] = [{"type": "http.response.body", "body": b"x" * (FINISHED_BYTES + 1)}]
    resends.finished("huge", huge)
    assert resends.answer("huge") is None
