"""The prompt cache, said per request, through the port of a real engine: the cached and
computed prompt tokens of each answer (/metrics), and a miss counted with its reason and
the token where the prompt changed (a line of the system prompt that changes every turn,
as a clock does)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from backend.app.pool.pool_config import ModelEntry, PoolConfig
from backend.app.service import StudioService
from backend.llama.api import engine_headers
from backend.llama.load import LoadSettings
from tests.backend.port.test_metrics_by_model import at, scrape, until
from tests.backend.service_harness import ServiceFactory

CHAT = "/v1/chat/completions"
RULES = " ".join(f"Rule {i}: keep the change small and say what it does." for i in range(40))
OUTPUT = " ".join(f"line {i} of the file" for i in range(60))


@pytest.fixture
async def service(running_service: ServiceFactory) -> StudioService:
    return await running_service(queue_timeout=120)


@pytest.fixture
def client(port_client: httpx.AsyncClient) -> httpx.AsyncClient:
    return port_client


def system(clock: str) -> dict[str, str]:
    return {"role": "system", "content": f"You are a coding agent.\n{RULES}\nNow: {clock}\n"
                                         f"Answer briefly."}


async def turn(client: httpx.AsyncClient, messages: list[dict[str, Any]]) -> dict[str, Any]:
    answer = await client.post(CHAT, json={"model": "tiny", "messages": messages,
                                           "max_tokens": 4, "temperature": 0,
                                           "prompt_cache_key": "thread-1"})
    assert answer.status_code == 200, answer.text
    body: dict[str, Any] = answer.json()
    return body


async def engine_tokens(service: StudioService, messages: list[dict[str, Any]]) -> list[int]:
    """The prompt's tokens as the engine renders and reads it."""
    (_, _, serving), = service.serving_engines()
    async with httpx.AsyncClient(base_url=serving.base_url, timeout=30,
                                 headers=engine_headers(serving.api_key)) as engine:
        prompt = (await engine.post("/apply-template", json={"messages": messages})).json()["prompt"]
        tokens: list[int] = (await engine.post("/tokenize", json={"content": prompt})).json()["tokens"]
        return tokens


async def test_each_answer_counts_its_cached_and_computed_prompt_tokens_and_a_changed_line_is_a_miss_where_it_changed(
        service, client, tiny_model):
    await service.start_pool(PoolConfig(models=(ModelEntry.for_file(
        str(tiny_model), settings=LoadSettings(parallel="1", ctx_size=4096)),)))
    metrics = service.metrics

    first = [system("2026-12-01 18:40:01"), {"role": "user", "content": "Read main.py."}]
    one = (await turn(client, first))["timings"]
    second = [*first, {"role": "assistant", "content": "Reading it."},
              {"role": "user", "content": OUTPUT}]
    two = (await turn(client, second))["timings"]
    # The second turn found the first one's prompt in the engine's cache.
    assert two["cache_n"] >= one["prompt_n"] + one["cache_n"] - 1
    await until(lambda: metrics.value("gguf_studio_prompt_tokens_total") == sum(
        t["prompt_n"] + t["cache_n"] for t in (one, two)))
    _, found = await scrape(client)
    assert at(found, "gguf_studio_prompt_tokens_total", kind="cached", model="tiny") == (
        one["cache_n"] + two["cache_n"])
    assert at(found, "gguf_studio_prompt_tokens_total", kind="computed", model="tiny") == (
        one["prompt_n"] + two["prompt_n"])
    assert at(found, "gguf_studio_prompt_cache_misses_total", reason="first_turn",
              model="tiny") == 1
    assert at(found, "gguf_studio_prompt_cache_misses_total", reason="prefix_changed",
              model="tiny") == 0

    # The client renders its clock into the system prompt: the next turn changes there.
    third = [system("2026-12-01 18:41:37"), *second[1:], {"role": "assistant", "content": "Ok."},
             {"role": "user", "content": "Run the tests."}]
    await turn(client, third)
    await until(lambda: metrics.value("gguf_studio_prompt_cache_misses_total",
                                      {"reason": "prefix_changed"}) == 1)
    _, found = await scrape(client)
    assert at(found, "gguf_studio_prompt_cache_misses_total", reason="prefix_changed",
              model="tiny") == 1
    session, = service.registry.sessions.caches()
    assert session.turns == 3
    miss = session.last_miss
    assert miss is not None and miss.cause == "changing_line"
    # Where the engine's tokens of the two prompts part: at the clock.
    before, after = await engine_tokens(service, second), await engine_tokens(service, third)
    common = next(i for i, (a, b) in enumerate(zip(before, after)) if a != b)
    assert abs(miss.at_token - common) <= 1, (miss.at_token, common)
    assert miss.describe().startswith(f"prefix changed at token {miss.at_token}")
    # The request inspector says it too: the third turn's record names the miss, the
    # second's (a hit) names none.
    records = service.requests.records()[-3:]
    assert [r.cache_miss for r in records[1:]] == [None, miss.describe()]
    assert records[2].computed_tokens is not None and records[2].computed_tokens > 0
