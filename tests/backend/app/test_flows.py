"""Named keys and fair share with a real engine: a flood from one key does not hold back
another's request, token limits answer 429 the SDK obeys, revocation ends waiting
requests, allowed models, usage per key in /metrics."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import AsyncIterator

import httpx
import openai
import pytest

from backend.app.pool.pool_status import Residency
from backend.app.pool.pool_config import ModelEntry
from backend.app.service import StudioService
from backend.keys.key_store import KeyStore, Priority
from backend.llama.api import engine_headers
from backend.llama.load import LoadSettings
from backend.models.model_names import file_names
from backend.admission.caller import Caller
from backend.admission.rate_limits import TokenLimits
from tests.backend.service_harness import ServiceFactory

OWNER_KEY = "owner-key-0123456789abcdef"


@pytest.fixture
async def service(running_service: ServiceFactory, tiny_model: Path) -> StudioService:
    service = await running_service(keepalive_interval=0.1, queue_timeout=120, api_key=OWNER_KEY)
    await service.load(LoadSettings(parallel="2", ctx_size=8192).to_spec(str(tiny_model)))
    return service


def url(service: StudioService) -> str:
    return f"http://127.0.0.1:{service.gateway_port}"


def chat(**extra: object) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}],
            "stream": True, "max_tokens": 150, "ignore_eos": True, **extra}


async def first_token(client: httpx.AsyncClient, key: str, body: dict,
                      times: list[float], priority: str | None = None,
                      durations: list[float] | None = None) -> list[str]:
    """Stream `body` with `key`; note when the first token came; return the events."""
    lines: list[str] = []
    headers = {"Authorization": f"Bearer {key}"}
    if priority is not None:
        headers["x-priority"] = priority
    async with client.stream("POST", "/v1/chat/completions", json=body,
                             headers=headers) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if line.startswith("data: {") and not lines:
                times.append(time.monotonic())
            if line.startswith("data:"):
                lines.append(line)
    if durations is not None and times:
        durations.append(time.monotonic() - times[-1])
    return lines


async def test_one_keys_flood_does_not_hold_back_anothers_request(service):
    keys = service.keys
    _, flood_key = keys.add("flood")
    _, colleague_key = keys.add("colleague")
    async with httpx.AsyncClient(base_url=url(service), timeout=120) as client:
        # Each of the flood's requests holds a slot far longer than a request takes to
        # arrive, so "the next free slot" is well defined.
        durations: list[float] = []
        flood = [asyncio.create_task(first_token(client, flood_key, chat(max_tokens=800), [],
                                                 durations=durations)) for _ in range(16)]
        while service.registry.total_waiting < 14:
            await asyncio.sleep(0.02)
        await first_token(client, colleague_key, chat(max_tokens=20), [])
        await asyncio.gather(*flood)
    usage = service.usage.snapshot()
    # The colleague got the first slot that freed: it waited about one of the flood's
    # requests (those running when it came, with their prompts), where first come first
    # served would have made it wait for the 14 queued before it: 7 rounds of 2 slots.
    # (The bound leaves room for a loaded machine: 1.51 was measured beside 4 busy jobs.)
    one_flood_request = sorted(durations)[len(durations) // 2]
    assert usage["colleague"].mean_wait < 2.5 * one_flood_request, (usage["colleague"],
                                                                    one_flood_request)
    # Fair or not, the flood's 16 on 2 slots wait 3.5 of its requests on average; the
    # bound leaves room for rounds that run faster than the median one.
    assert usage["flood"].mean_wait > 2.5 * one_flood_request
    assert usage["flood"].requests == 16 and usage["colleague"].requests == 1
    assert usage["colleague"].completion_tokens == 20


async def test_a_tokens_per_minute_limit_is_a_429_the_sdk_waits_out(service):
    keys = KeyStore()
    _, secret = keys.add("metered", tokens_per_minute=1200)
    body = chat(stream=False, max_tokens=600)
    async with httpx.AsyncClient(base_url=url(service), timeout=120,
                                 headers={"Authorization": f"Bearer {secret}"}) as client:
        first = await client.post("/v1/chat/completions", json=body)
        assert first.status_code == 200, first.text
        assert int(first.headers["x-ratelimit-limit-tokens"]) == 1200
        refused = await client.post("/v1/chat/completions", json=body)
    assert refused.status_code == 429
    error = refused.json()["error"]
    assert error["code"] == "rate_limit_exceeded" and "per minute" in error["message"]
    wait = float(refused.headers["retry-after-ms"]) / 1000
    assert 0 < wait <= int(refused.headers["retry-after"]) and wait < 60
    assert refused.headers["x-ratelimit-remaining-tokens"].isdigit()

    sdk = openai.AsyncOpenAI(base_url=url(service) + "/v1", api_key=secret, max_retries=3)
    started = time.monotonic()
    answer = await sdk.chat.completions.create(model="tiny", messages=body["messages"],
                                               max_tokens=600, extra_body={"ignore_eos": True})
    assert answer.choices[0].finish_reason == "length"
    assert time.monotonic() - started >= wait * 0.5  # it waited for the window, then passed
    await sdk.close()
    assert service.usage.snapshot()["metered"].refusals.get("tokens_per_minute", 0) >= 1


async def test_a_revoked_key_is_refused_at_once_also_while_waiting(service):
    keys = KeyStore()
    _, secret = keys.add("leaver")
    headers = {"Authorization": f"Bearer {secret}"}
    async with httpx.AsyncClient(base_url=url(service), timeout=120, headers=headers) as client:
        running = [asyncio.create_task(client.post("/v1/chat/completions",
                                                   json=chat(stream=False, max_tokens=2000)))
                   for _ in range(4)]
        while service.registry.total_waiting < 2:
            await asyncio.sleep(0.02)
        KeyStore().revoke("leaver")  # as `gguf-studio keys revoke` in another process
        answers = await asyncio.wait_for(asyncio.gather(*running), 60)
        statuses = sorted(a.status_code for a in answers)
        assert statuses == [401, 401, 401, 401]  # the waiting ones and the running ones
        assert all(a.json()["error"]["code"] == "invalid_api_key"
                   for a in answers if a.status_code == 401)
        again = await client.post("/v1/chat/completions", json=chat(stream=False))
        assert again.status_code == 401 and "revoked" in again.json()["error"]["message"]


async def test_a_key_uses_only_its_models_and_usage_shows_by_name(service):
    keys = KeyStore()
    _, secret = keys.add("narrow", models=("other-*",))
    async with httpx.AsyncClient(base_url=url(service), timeout=60) as client:
        refused = await client.post("/v1/chat/completions", json=chat(stream=False),
                                    headers={"Authorization": f"Bearer {secret}"})
        assert refused.status_code == 403
        assert refused.json()["error"]["code"] == "model_not_allowed"
        ok = await client.post("/v1/chat/completions", json=chat(stream=False, max_tokens=5),
                               headers={"Authorization": f"Bearer {OWNER_KEY}"})
        assert ok.status_code == 200
        metrics = (await client.get("/metrics",
                                    headers={"Authorization": f"Bearer {OWNER_KEY}"})).text
    assert 'gguf_studio_key_refusals_total{key="narrow",reason="model_not_allowed"} 1.0' in metrics
    assert 'gguf_studio_key_tokens_total{key="owner",kind="completion"} 5.0' in metrics
    assert secret not in metrics


async def test_a_key_cannot_load_a_model_it_may_not_use(service, tiny_model, tmp_path):
    spare = tmp_path / "spare.gguf"
    spare.symlink_to(tiny_model)
    service.pool.add_model(ModelEntry.for_file(str(spare), preload=False))
    _, secret = KeyStore().add("narrow", models=("tiny",))
    async with httpx.AsyncClient(base_url=url(service), timeout=60) as client:
        refused = await client.post("/v1/chat/completions", json=chat(model="spare", stream=False),
                                    headers={"Authorization": f"Bearer {secret}"})
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "model_not_allowed"
    assert service.pool.status("spare").residency is Residency.UNLOADED  # nothing loaded for it


async def test_a_request_may_lower_its_priority_but_not_raise_it(service):
    keys = KeyStore()
    _, batch_key = keys.add("nightly", priority=Priority.BATCH)
    _, normal_key = keys.add("human")
    async with httpx.AsyncClient(base_url=url(service), timeout=120) as client:
        times: dict[str, list[float]] = {"raised": [], "plain": [], "lowered": [], "late": []}

        async def waiting(name: str, key: str, priority: str | None) -> asyncio.Task:
            task = asyncio.create_task(first_token(client, key, chat(max_tokens=5), times[name],
                                                   priority))
            expected = service.registry.total_waiting + 1
            while service.registry.total_waiting < expected:
                await asyncio.sleep(0.02)
            return task

        # Two long requests hold the slots; the first ends well before the second, so
        # the waiters are admitted one at a time.
        hold = [asyncio.create_task(first_token(client, normal_key, chat(max_tokens=n), []))
                for n in (1000, 4000)]
        while service.registry.total_active < 2:
            await asyncio.sleep(0.02)
        queued = [await waiting("raised", batch_key, "interactive"),  # may not raise it
                  await waiting("lowered", normal_key, "batch"),  # may lower it
                  await waiting("plain", normal_key, None)]
        await asyncio.gather(*queued)
        hold[1].cancel()
        await asyncio.gather(*hold, return_exceptions=True)
    assert times["plain"][0] < times["raised"][0]  # normal before batch, though later
    assert times["plain"][0] < times["lowered"][0]  # its own lowered one waits behind it


# --- what a user of a narrow or metered key would notice ---------------------------------


async def test_a_key_is_refused_a_model_under_every_name_the_model_answers_to(
        service, tiny_model, tmp_path):
    """Models are reached by name, alias or file name, ignoring case: a key allowed only
    `spare` is refused `tiny` however it is spelled, and reaches `spare` however it is."""
    spare = tmp_path / "Spare-Q8_0.gguf"
    spare.symlink_to(tiny_model)
    service.pool.add_model(ModelEntry.for_file(str(spare), name="spare", aliases=("backup",),
                                               preload=False))
    _, secret = KeyStore().add("narrow", models=("spare",))
    tiny_names = file_names(tiny_model)
    assert "tiny.gguf" in tiny_names
    spellings = {spelling for name in tiny_names for spelling in (name, name.upper(), name.title())}
    headers = {"Authorization": f"Bearer {secret}"}
    async with httpx.AsyncClient(base_url=url(service), timeout=60, headers=headers) as client:
        for spelling in sorted(spellings):
            refused = await client.post("/v1/chat/completions",
                                        json=chat(model=spelling, stream=False, max_tokens=2))
            assert refused.status_code == 403, (spelling, refused.text)
            assert refused.json()["error"]["code"] == "model_not_allowed"
        for spelling in ("SPARE", "Backup", "spare-q8_0.gguf"):
            allowed = await client.post("/v1/chat/completions",
                                        json=chat(model=spelling, stream=False, max_tokens=2))
            assert allowed.status_code == 200, (spelling, allowed.text)
    assert service.usage.snapshot()["narrow"].refusals == {"model_not_allowed": len(spellings)}


async def test_short_answers_give_their_unused_reservation_back_to_the_keys_minute(
        service, smollm2_model):
    """A reservation is the prompt plus max_tokens; SmolLM2 answers in a word.  With
    1,000 tokens a minute, three requests that each reserve about 460 and use about 40
    all pass: what each did not use went back to the minute."""
    await service.add_model(ModelEntry.for_file(str(smollm2_model), name="smol",
                                                settings=LoadSettings(parallel="1", ctx_size=2048)))
    _, secret = KeyStore().add("metered", tokens_per_minute=1000)
    body = {"model": "smol", "temperature": 0, "max_tokens": 400,
            "messages": [{"role": "user", "content": "What is the capital of France? One word."}]}
    async with httpx.AsyncClient(base_url=url(service), timeout=60,
                                 headers={"Authorization": f"Bearer {secret}"}) as client:
        for attempt in range(3):
            answer = await client.post("/v1/chat/completions", json=body)
            assert answer.status_code == 200, (attempt, answer.text)
            usage = answer.json()["usage"]
            assert usage["completion_tokens"] < 20 and usage["total_tokens"] < 100
    assert "tokens_per_minute" not in service.usage.snapshot()["metered"].refusals


# --- the books: every token counted, nothing of another key's prompt told -------------------


async def content_events(response: httpx.Response, wanted: int) -> int:
    """Read `wanted` content events of a chat stream (then stop reading); how many."""
    seen = 0
    async for line in response.aiter_lines():
        if line.startswith("data: {") and '"content":"' in line:
            seen += 1
            if seen == wanted:
                break
    return seen


async def test_a_stream_the_client_cuts_is_booked_what_was_relayed_and_the_books_survive_a_restart(
        service, tmp_path):
    _, secret = service.keys.add("cutter", tokens_per_day=100_000)
    headers = {"Authorization": f"Bearer {secret}"}
    async with httpx.AsyncClient(base_url=url(service), timeout=120, headers=headers) as client:
        async with client.stream("POST", "/v1/chat/completions",
                                 json=chat(max_tokens=3000)) as response:
            assert response.status_code == 200
            read = await content_events(response, 40)
        # The client hung up after 40 tokens: the engine's usage never reached it.
        deadline = time.monotonic() + 30
        while service.usage.usage("cutter").requests == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
    booked = service.usage.usage("cutter")
    assert booked.requests == 1
    assert booked.prompt_tokens > 0
    # What was relayed: at least the 40 events the client read, far from the 3,000 asked.
    assert read <= booked.completion_tokens < 3000, booked
    limits = TokenLimits(per_day=100_000)
    record = service.keys.get("cutter")
    used_now = 100_000 - int(service.flows.headers(Caller("cutter", record))[
        "x-ratelimit-remaining-tokens"])
    assert used_now == booked.total_tokens  # the day window charged the same
    # A restart: the books are read back, and the day's window with them.
    service.usage.save()
    again = StudioService(service.settings, log_dir=tmp_path / "again")
    try:
        assert again.usage.usage("cutter").total_tokens == booked.total_tokens
        remaining = again.flows.limiter.headers("cutter", limits)["x-ratelimit-remaining-tokens"]
        assert int(remaining) == 100_000 - booked.total_tokens
    finally:
        await again.close()


async def test_a_non_streamed_answer_the_client_left_is_booked_its_reservation(service):
    _, secret = service.keys.add("impatient")
    headers = {"Authorization": f"Bearer {secret}"}
    async with httpx.AsyncClient(base_url=url(service), timeout=120, headers=headers) as client:
        asking = asyncio.create_task(client.post("/v1/chat/completions",
                                                 json=chat(stream=False, max_tokens=3000)))
        while service.registry.total_active == 0:
            await asyncio.sleep(0.02)
        asking.cancel()  # the client gives up while the engine answers
        await asyncio.gather(asking, return_exceptions=True)
        deadline = time.monotonic() + 30
        while service.usage.usage("impatient").requests == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
    booked = service.usage.usage("impatient")
    # Nothing of it was relayed to count: it costs what it reserved, as in its limits.
    assert booked.requests == 1 and booked.prompt_tokens > 0
    assert booked.completion_tokens == 3000


async def read_stream(lines: AsyncIterator[str]) -> list[str]:
    return [line async for line in lines if line.startswith(("data:", "event:"))]


@pytest.mark.parametrize("route", ["chat", "responses", "revoked elsewhere"])
async def test_revoking_a_key_ends_its_running_stream_with_an_error_and_frees_the_slot(
        service, route):
    name = f"leaver-{route.split()[0]}"
    _, secret = service.keys.add(name)
    headers = {"Authorization": f"Bearer {secret}"}
    if route == "responses":
        path, body = "/v1/responses", {"model": "tiny", "input": "Hello", "stream": True,
                                       "max_output_tokens": 3000, "ignore_eos": True}
    else:
        path, body = "/v1/chat/completions", chat(max_tokens=3000)
    async with httpx.AsyncClient(base_url=url(service), timeout=120, headers=headers) as client:
        async with client.stream("POST", path, json=body) as response:
            assert response.status_code == 200
            lines: list[str] = []
            events = response.aiter_lines()
            async for line in events:
                if line.startswith(("data:", "event:")):
                    lines.append(line)
                if sum('"delta"' in seen for seen in lines) == 10:
                    break
            if route == "revoked elsewhere":
                KeyStore().revoke(name)  # `gguf-studio keys revoke` in another terminal
            else:
                service.revoke_key(name)
            lines += await asyncio.wait_for(read_stream(events), 30)
    assert sum('"delta"' in line for line in lines) < 3000, "the stream ran to its end"
    if route == "responses":
        assert lines[-2:][0] == "event: response.failed"
        failed = json.loads(lines[-1].removeprefix("data: "))
        assert failed["response"]["status"] == "failed"
        assert failed["response"]["error"]["code"] == "invalid_api_key"
    else:
        assert lines[-1] == "data: [DONE]"
        error = json.loads(lines[-2].removeprefix("data: "))["error"]
        assert error["code"] == "invalid_api_key" and "revoked" in error["message"]
    # The upstream request was closed: the engine's slot is free again, and the tokens
    # relayed before the revocation are on the key's books.
    snapshot = service.snapshot()
    assert snapshot.serving is not None
    async with httpx.AsyncClient(headers=engine_headers(snapshot.serving.api_key)) as engine:
        deadline = time.monotonic() + 10
        while True:
            slots = (await engine.get(f"{snapshot.serving.base_url}/slots")).json()
            if not any(slot.get("is_processing") for slot in slots):
                break
            assert time.monotonic() < deadline, slots
            await asyncio.sleep(0.05)
    assert service.registry.total_active == 0
    assert service.usage.usage(name).completion_tokens >= 10


SECRET = "Remember this: the password is TANGO-9182, and tell it to no one."
# Guesses a word at a time: however the tokenizer cuts digits, the right word is at least
# one more token shared with the secret.
RIGHT, WRONG = "Remember this: the password is TANGO", "Remember this: the password is MANGO"


def cache_figures(answer: dict) -> dict:
    """Everything in an answer that tells what the engine's prompt cache held."""
    usage = answer.get("usage") or answer.get("response", {}).get("usage") or {}
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
    return {"timings": answer.get("timings"), "cached": details.get("cached_tokens"),
            "cache_read": usage.get("cache_read_input_tokens")}


async def probe(client: httpx.AsyncClient, key: str, route: str, guess: str) -> dict:
    """What `guess`'s answer says of the cache on `route` (the final event of a stream)."""
    headers = {"Authorization": f"Bearer {key}"}
    if route.startswith("chat"):
        stream = route == "chat stream"
        body = {"model": "tiny", "messages": [{"role": "user", "content": guess}],
                "max_tokens": 1, "stream": stream, "stream_options": {"include_usage": True}}
        if not stream:
            del body["stream_options"]
        path = "/v1/chat/completions"
    elif route == "responses":
        path, body = "/v1/responses", {"model": "tiny", "input": guess, "max_output_tokens": 1}
    else:
        path, body = "/v1/messages", {"model": "tiny", "max_tokens": 1,
                                      "messages": [{"role": "user", "content": guess}]}
    if route != "chat stream":
        answer = await client.post(path, json=body, headers=headers)
        assert answer.status_code == 200, answer.text
        return cache_figures(answer.json())
    figures: dict = {"timings": None, "cached": None, "cache_read": None}
    async with client.stream("POST", path, json=body, headers=headers) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                found = cache_figures(json.loads(line.removeprefix("data: ")))
                figures.update({k: v for k, v in found.items() if v is not None})
    return figures


async def test_one_key_cannot_read_anothers_prompt_through_the_cache_figures(service):
    _, alice = service.keys.add("alice")
    _, mallory = service.keys.add("mallory")
    async with httpx.AsyncClient(base_url=url(service), timeout=60) as client:
        said = await client.post("/v1/chat/completions", headers={"Authorization": f"Bearer {alice}"},
                                 json={"model": "tiny", "max_tokens": 1,
                                       "messages": [{"role": "user", "content": SECRET}]})
        assert said.status_code == 200
        assert cache_figures(said.json()) == {"timings": None, "cached": 0, "cache_read": None}
        # The engine's cache is an oracle: the owner (who may see it) is told one more
        # cached token for the right character.  (No request is steered to another key's
        # slot: alice's prompt is found once her idle slot is saved to the engine's RAM
        # prompt cache, which the start of any next request does.)
        assert (await client.post("/v1/chat/completions", headers={"Authorization": f"Bearer {OWNER_KEY}"},
                                  json={"model": "tiny", "max_tokens": 1,
                                        "messages": [{"role": "user", "content": "Hello"}]})
                ).status_code == 200
        right = await probe(client, OWNER_KEY, "chat", RIGHT)
        wrong = await probe(client, OWNER_KEY, "chat", WRONG)
        assert right["cached"] > wrong["cached"] and right["timings"]["cache_n"] > 0
        # Another key's guesses are told nothing of it, on every route.
        for route in ("chat", "chat stream", "responses", "messages"):
            figures = [await probe(client, mallory, route, guess) for guess in (RIGHT, WRONG)]
            assert figures[0] == figures[1], route
            assert figures[0]["timings"] is None and figures[0]["cached"] in (0, None), route
            assert figures[0]["cache_read"] in (0, None), route
        # Anthropic's input_tokens leave out what the cache held: told in full instead.
        body = {"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": RIGHT}]}
        told = {}
        for name, key in (("owner", OWNER_KEY), ("mallory", mallory)):
            answer = await client.post("/v1/messages", json=body,
                                       headers={"Authorization": f"Bearer {key}"})
            told[name] = answer.json()["usage"]
        assert told["owner"]["cache_read_input_tokens"] > 0
        assert told["mallory"]["input_tokens"] == (told["owner"]["input_tokens"]
                                                   + told["owner"]["cache_read_input_tokens"])
    # The books still have the prompts (counted from the usage the engine sent).
    assert service.usage.usage("mallory").prompt_tokens > 0


async def test_a_named_key_is_told_the_cache_hits_of_its_own_session_and_no_more(service):
    """An agent's next turn continues its own last one: what the cache held of that turn
    (its key sent it) is told, at most that turn's prompt, streamed or not; the same turn
    sent by another key, whose own session holds nothing of it, is told 0."""
    _, alice = service.keys.add("alice")
    _, mallory = service.keys.add("mallory")
    first = [{"role": "system", "content": "You are a careful assistant. " * 40},
             {"role": "user", "content": SECRET}]

    def body(messages: list[dict], stream: bool = False) -> dict:
        asked = {"model": "tiny", "messages": messages, "max_tokens": 8, "ignore_eos": True,
                 "prompt_cache_key": f"alice-agent-{stream}", "stream": stream}
        return dict(asked, stream_options={"include_usage": True}) if stream else asked

    async def told(key: str, asked: dict) -> tuple[dict, int, dict]:
        """The answer's usage, the engine's own cached count (the inspector's), and the
        answer's message."""
        before = service.requests.last_id
        headers = {"Authorization": f"Bearer {key}"}
        usage: dict = {}
        said = ""
        if asked["stream"]:
            async with client.stream("POST", "/v1/chat/completions", json=asked,
                                     headers=headers) as response:
                assert response.status_code == 200, await response.aread()
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        event = json.loads(line.removeprefix("data: "))
                        usage = event.get("usage") or usage
                        for choice in event.get("choices") or ():
                            said += (choice.get("delta") or {}).get("content") or ""
        else:
            answer = await client.post("/v1/chat/completions", json=asked, headers=headers)
            assert answer.status_code == 200, answer.text
            usage = answer.json()["usage"]
            said = answer.json()["choices"][0]["message"]["content"]
        await until(lambda: service.requests.last_id > before)
        [record] = service.requests.records(after=before)
        assert "timings" not in usage
        return usage, record.cached_tokens or 0, {"role": "assistant", "content": said}

    def cached(usage: dict) -> int:
        return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)

    async with httpx.AsyncClient(base_url=url(service), timeout=60) as client:
        for stream in (True, False):  # an agent that streams, and one that does not
            messages = list(first)
            usage, _, said = await told(alice, body(messages, stream))
            assert cached(usage) == 0  # its first turn: nothing of its own was cached
            earlier = usage["prompt_tokens"]
            messages += [said, {"role": "user", "content": "And what did I tell you?"}]
            usage, engine_cached, said = await told(alice, body(messages, stream))
            assert engine_cached > 0, usage
            assert cached(usage) == min(engine_cached, earlier) > 0, (usage, engine_cached)
        # mallory sends alice's very turn: the cache holds it, mallory's own session nothing.
        usage, engine_cached, _ = await told(mallory, body(messages))
        assert engine_cached > 0 and cached(usage) == 0, usage


def cache_fields(value: object) -> list[tuple[str, object]]:
    """Every field of a payload by which the engine tells what its prompt cache held,
    with its value, wherever it is nested."""
    found: list[tuple[str, object]] = []
    if isinstance(value, dict):
        for name, inner in value.items():
            if name in ("timings", "prompt_progress", "cached_tokens",
                        "cache_read_input_tokens", "tokens_cached"):
                found.append((name, inner))
            else:
                found += cache_fields(inner)
    elif isinstance(value, list):
        for inner in value:
            found += cache_fields(inner)
    return found


async def test_a_named_keys_streamed_answer_tells_nothing_of_anothers_cached_prompt(service):
    """The main streaming path: a normal answer of many chunks, its usage and (asked per
    token) its timings and prompt progress, while the engine did reuse another key's
    prompt for it.  Not one chunk tells the named key so; the owner's record does."""
    _, alice = service.keys.add("alice")
    _, mallory = service.keys.add("mallory")
    async with httpx.AsyncClient(base_url=url(service), timeout=60) as client:
        for key in (alice, OWNER_KEY):  # alice's prompt, then a request that keeps it cached
            said = await client.post("/v1/chat/completions",
                                     headers={"Authorization": f"Bearer {key}"},
                                     json={"model": "tiny", "max_tokens": 1,
                                           "messages": [{"role": "user", "content": SECRET}]})
            assert said.status_code == 200, said.text
        asked = {"model": "tiny", "messages": [{"role": "user", "content": SECRET}],
                 "max_tokens": 40, "ignore_eos": True, "stream": True,
                 "stream_options": {"include_usage": True}}
        for extra in ({}, {"timings_per_token": True, "return_progress": True}):
            told, usage, events = [], None, 0
            before = service.requests.last_id
            async with client.stream("POST", "/v1/chat/completions", json={**asked, **extra},
                                     headers={"Authorization": f"Bearer {mallory}"}) as response:
                assert response.status_code == 200, await response.aread()
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        event = json.loads(line.removeprefix("data: "))
                        events += 1
                        told += [field for field in cache_fields(event)
                                 if field[1] not in (0, None)]
                        usage = event.get("usage") or usage
            await until(lambda: service.requests.last_id > before)
            [record] = service.requests.records(after=before)
            # The engine did reuse the other keys' prompt, and streamed the answer in
            # many chunks with its usage at the end.
            assert record.cached_tokens is not None and record.cached_tokens > 0, record
            assert record.key == "mallory" and record.output_tokens == 40 and events > 40
            assert usage is not None
            assert usage["prompt_tokens"] == record.prompt_tokens, usage
            assert told == [], extra


async def until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "never came true"
        await asyncio.sleep(0.01)


async def test_an_isolated_model_reuses_no_prompt_even_when_a_request_asks(service, tiny_model,
                                                                           tmp_path):
    spare = tmp_path / "apart.gguf"
    spare.symlink_to(tiny_model)
    await service.add_model(ModelEntry.for_file(str(spare), isolated=True,
                                                settings=LoadSettings(parallel="2", ctx_size=4096)))
    body = {"messages": [{"role": "user", "content": SECRET}], "max_tokens": 1,
            "cache_prompt": True}
    owner = {"Authorization": f"Bearer {OWNER_KEY}"}
    async with httpx.AsyncClient(base_url=url(service), timeout=60, headers=owner) as client:
        cached = {}
        for model in ("tiny", "apart"):
            for _ in range(2):
                answer = await client.post("/v1/chat/completions", json={"model": model, **body})
                assert answer.status_code == 200, answer.text
            cached[model] = answer.json()["timings"]["cache_n"]
    assert cached["tiny"] > 0  # the same prompt twice: the second was read from the cache
    assert cached["apart"] == 0  # not on the isolated model, whatever the request asked


@pytest.mark.parametrize("stream", [False, True])
async def test_a_messages_answer_is_booked_its_whole_prompt_also_what_the_cache_held(service,
                                                                                     stream):
    """Anthropic's `input_tokens` leave out the prompt tokens read from the cache (and a
    stream says them only in its first event): the books count the whole prompt."""
    _, secret = service.keys.add("claude")
    # Long enough that the stream's first event is far behind its last ones.
    body = {"model": "tiny", "max_tokens": 60, "ignore_eos": True,
            "messages": [{"role": "user", "content": SECRET}]}
    owner = {"Authorization": f"Bearer {OWNER_KEY}"}
    async with httpx.AsyncClient(base_url=url(service), timeout=60) as client:
        told = (await client.post("/v1/messages", json=body, headers=owner)).json()["usage"]
        prompt = told["input_tokens"] + told["cache_read_input_tokens"]
        answer = await client.post("/v1/messages", json={**body, "stream": stream},
                                   headers={"Authorization": f"Bearer {secret}"})
        assert answer.status_code == 200, answer.text
    booked = service.usage.usage("claude")
    assert (booked.prompt_tokens, booked.completion_tokens) == (prompt, 60)
