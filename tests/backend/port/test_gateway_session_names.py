"""Client-supplied session names through the port of a real engine: a named key that
names each request's session with 30 MiB holds no more of the port than one that names
it "agent-7", and the inspector's answer stays small."""

from __future__ import annotations

import gc
import json
import tracemalloc

import httpx
import pytest

from backend.app.pool_config import ModelEntry, PoolConfig
from backend.app.service import StudioService
from backend.llama.load import LoadSettings
from backend.port.request_log import RequestRecord
from tests.backend.service_harness import ServiceFactory

#: What a client once made the port keep four times over, each request anew.
HUGE = 30 << 20
REQUESTS = 20


@pytest.fixture
async def service(running_service: ServiceFactory, tiny_model) -> StudioService:
    service = await running_service()
    await service.start_pool(PoolConfig(models=(ModelEntry.for_file(
        str(tiny_model), settings=LoadSettings(parallel="2", ctx_size=2048)),)))
    return service


async def test_twenty_sessions_named_with_30_mib_each_add_less_than_50_mib_to_the_port(
        service: StudioService) -> None:
    _, secret = service.keys.add("mallory")
    exported: list[RequestRecord] = []
    service.requests.exporter = lambda record, traceparent: exported.append(record)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{service.gateway_port}",
                                 headers={"authorization": f"Bearer {secret}",
                                          "content-type": "application/json"},
                                 timeout=300) as client:
        await ask(client, b"warm-up")  # the port's own first-request allocations
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for n in range(REQUESTS):
                # A session per request, each name its own 30 MiB (built for the request
                # and gone after it: only what the port keeps is counted).
                await ask(client, b"%02d" % n + b"s" * (HUGE - 2))
            gc.collect()
            grown = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        print(f"{REQUESTS} sessions named with 30 MiB each: the port holds "
              f"{grown / (1 << 20):.1f} MiB more")
        assert grown < 50 << 20
        answer = await client.get("/requests", params={"limit": 1})
    assert answer.status_code == 200
    assert len(answer.content) < 4096, len(answer.content)
    (record,) = answer.json()["data"]
    # The owner still tells the sessions apart: each by its digest, in the records and
    # in what the span exporter hears.
    assert record["session"].startswith("sha256:") and len(record["session"]) == 39
    assert len({r.session for r in exported[-REQUESTS:]}) == REQUESTS
    assert all(r.session is not None and len(r.session) <= 128 for r in exported)
    assert all(len(s.key) < 256 for s in service.registry.sessions)
    assert all(len(s.session) < 256 for s in service.metrics.cache_book.snapshot())


async def ask(client: httpx.AsyncClient, session: bytes) -> None:
    """One answered turn whose `prompt_cache_key` is `session`."""
    head = json.dumps({"model": "tiny", "max_tokens": 1, "temperature": 0,
                       "messages": [{"role": "user", "content": "Say hi."}]})
    body = head[:-1].encode() + b', "prompt_cache_key": "' + session + b'"}'
    answer = await client.post("/v1/chat/completions", content=body)
    assert answer.status_code == 200, answer.text[:300]
