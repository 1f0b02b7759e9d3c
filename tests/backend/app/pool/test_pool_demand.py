"""On-demand loads with real engines, as teams with named keys meet them: a key's limits
before any load or eviction, evictions that respect priority bands, loads that fit going
ahead of one that waits for room, load-waiters inside the waiting-bytes budget and
re-checked against their keys, a failed model that loads again after its cool-down, and
the resolved model name forwarded to a GGUF Studio upstream."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest

import backend.app.pool.local_models as local_models_module
from backend.app.pool.pool_config import ModelEntry, PoolConfig
from backend.app.pool.pool_status import Residency
from backend.app.pool.local_models import estimate_model_bytes
from backend.app.service import StudioService
from backend.keys.key_store import Priority
from backend.settings import Settings
from tests.backend.app.pool.test_pool import (LONG, SMALL, chat, other_tiny_model, studio_health,
                                         studio_model, stream_lines, text_of, until)
from tests.fake_upstream import FakeUpstream
from tests.backend.service_harness import ServiceFactory

__all__ = ["other_tiny_model"]  # the fixture, shared with test_pool


@pytest.fixture
async def service(running_service: ServiceFactory) -> StudioService:
    return await running_service(keepalive_interval=0.1, reload_grace=30, queue_timeout=120,
                                 max_waiting_body_bytes=1 << 20, max_restarts=1)


@pytest.fixture
def client(port_client: httpx.AsyncClient) -> httpx.AsyncClient:
    return port_client


def auth(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


async def one_at_a_time(service: StudioService, *entries: ModelEntry) -> None:
    """Serve `entries` (the first loaded) under a memory limit where only one fits."""
    limit_mib = (max(estimate_model_bytes(e) for e in entries) + (1 << 20)) >> 20
    assert all(sum(estimate_model_bytes(e) for e in pair) > limit_mib << 20
               for pair in ((entries[0], e) for e in entries[1:]))
    await service.start_pool(PoolConfig(models=entries, memory_limit_mib=limit_mib))


async def busy_stream(client: httpx.AsyncClient, model: str, **headers: str) -> asyncio.Task:
    started = asyncio.Event()
    task = asyncio.create_task(stream_lines_with(client, chat(model, True, **LONG), started,
                                                 headers))
    begun = asyncio.create_task(started.wait())
    await asyncio.wait({task, begun}, timeout=60, return_when=asyncio.FIRST_COMPLETED)
    if not started.is_set():
        begun.cancel()
        await cancel(task)
        raise AssertionError(f"the stream on {model} never began: {task!r}")
    begun.cancel()
    return task


async def stream_lines_with(client: httpx.AsyncClient, body: dict, started: asyncio.Event,
                            headers: dict[str, str]) -> list[str]:
    lines = []
    async with client.stream("POST", "/v1/chat/completions", json=body,
                             headers=headers) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if line:
                lines.append(line)
                if line.startswith("data: {"):
                    started.set()
    return lines


async def cancel(*tasks: asyncio.Task) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


# --- a key's limits before any load or eviction ----------------------------------------


async def test_a_key_whose_budget_is_spent_neither_loads_nor_evicts(
        service, client, tiny_model, other_tiny_model):
    await one_at_a_time(service, ModelEntry.for_file(str(tiny_model), settings=SMALL),
                        ModelEntry.for_file(str(other_tiny_model), settings=SMALL,
                                            preload=False))
    _record, secret = service.add_key("bob", tokens_per_day=100_000)
    text_of(await client.post("/v1/chat/completions", json=chat("tiny"), headers=auth(secret)))
    service.edit_key("bob", tokens_per_day=10)  # the owner cuts the budget below its use

    refused = await client.post("/v1/chat/completions", json=chat("other"), headers=auth(secret))

    assert service.pool.status("other").residency is Residency.UNLOADED  # nothing loaded
    assert service.pool.status("tiny").residency is Residency.READY  # nothing evicted
    assert refused.status_code == 429, refused.text
    assert "Daily token budget reached for key 'bob'" in refused.json()["error"]["message"]


# --- evictions respect priority bands --------------------------------------------------


async def test_a_batch_load_does_not_evict_a_model_an_interactive_key_just_used(
        service, client, tiny_model, other_tiny_model, monkeypatch):
    monkeypatch.setattr(local_models_module, "BAND_PROTECTION", 4.0, raising=False)
    await one_at_a_time(service, ModelEntry.for_file(str(tiny_model), settings=SMALL),
                        ModelEntry.for_file(str(other_tiny_model), settings=SMALL,
                                            preload=False))
    _a, alice = service.add_key("alice", priority=Priority.INTERACTIVE)
    _b, batch = service.add_key("nightly", priority=Priority.BATCH)
    used = time.monotonic()
    text_of(await client.post("/v1/chat/completions", json=chat("tiny"), headers=auth(alice)))

    waiting = asyncio.create_task(client.post("/v1/chat/completions", json=chat("other"),
                                              headers=auth(batch)))
    await until(lambda: "kept for its interactive requests"
                in service.pool.status("other").decision, timeout=10)
    assert service.pool.status("tiny").residency is Residency.READY  # idle, yet kept

    text_of(await waiting)  # once the protection lapsed, the batch load went ahead
    assert time.monotonic() - used >= 4.0
    assert service.pool.status("tiny").residency is Residency.EVICTED


# --- a load waiting for room blocks no other ---------------------------------------------


async def test_a_load_waiting_for_room_lets_a_load_that_fits_go_ahead(
        service, client, tiny_model, other_tiny_model, smollm2_model):
    busy = ModelEntry.for_file(str(tiny_model), settings=SMALL)
    big = ModelEntry.for_file(str(smollm2_model), name="smol", settings=SMALL, preload=False)
    small = ModelEntry.for_file(str(other_tiny_model), settings=SMALL, preload=False)
    sizes = {e.name: estimate_model_bytes(e) for e in (busy, big, small)}
    assert sizes["smol"] > sizes["other"]
    limit_mib = (sizes["tiny"] + sizes["other"] + (1 << 20)) >> 20  # tiny + smol do not fit
    await service.start_pool(PoolConfig(models=(busy, big, small), memory_limit_mib=limit_mib))
    running = await busy_stream(client, "tiny")
    waiting = asyncio.create_task(client.post("/v1/chat/completions", json=chat("smol")))
    await until(lambda: "waiting for room" in service.pool.status("smol").decision)

    fits = await asyncio.wait_for(client.post("/v1/chat/completions", json=chat("other")), 180)

    text_of(fits)
    assert not running.done() and not waiting.done()  # tiny still busy, smol still waits
    assert service.pool.status("smol").residency is Residency.LOADING
    await cancel(running, waiting)


# --- load-waiters: their bodies in the budget, their keys re-checked ----------------------


async def test_requests_waiting_for_a_load_hold_their_bodies_within_the_bound(
        service, client, tiny_model, other_tiny_model):
    await one_at_a_time(service, ModelEntry.for_file(str(tiny_model), settings=SMALL),
                        ModelEntry.for_file(str(other_tiny_model), settings=SMALL,
                                            preload=False))
    running = await busy_stream(client, "tiny")  # "other" waits for room behind it
    big = chat("other", messages=[{"role": "user", "content": "word " * 120_000}])  # 0.6 MiB
    first = asyncio.create_task(client.post("/v1/chat/completions", json=big))
    await until(lambda: service.registry.line("other").waiting == 1)

    second = await asyncio.wait_for(client.post("/v1/chat/completions", json=big), 30)

    assert second.status_code == 429, second.text  # as a request waiting in line would be
    assert "of request bodies (the bound is 1.0 MiB)" in second.json()["error"]["message"]
    assert service.registry.line("other").waiting == 1 and not first.done()
    await cancel(running, first)


async def test_a_key_revoked_while_its_request_waits_for_a_load_is_refused(
        service, client, tiny_model, other_tiny_model):
    await one_at_a_time(service, ModelEntry.for_file(str(tiny_model), settings=SMALL),
                        ModelEntry.for_file(str(other_tiny_model), settings=SMALL,
                                            preload=False))
    _record, secret = service.add_key("bob")
    _other, owner = service.add_key("carol")
    running = await busy_stream(client, "tiny", **auth(owner))
    waiting = asyncio.create_task(client.post("/v1/chat/completions", json=chat("other"),
                                              headers=auth(secret)))
    await until(lambda: service.registry.line("other").waiting == 1)

    service.revoke_key("bob")
    refused = await asyncio.wait_for(waiting, 30)

    assert refused.status_code == 401, refused.text
    assert "The API key 'bob' was revoked" in refused.json()["error"]["message"]
    assert not running.done()  # refused at once, not served once the model loaded
    await cancel(running)


# --- crashes ---------------------------------------------------------------------------


async def test_a_model_failed_by_crashes_loads_again_after_its_cool_down_naming_the_key(
        service, client, tiny_model, monkeypatch):
    monkeypatch.setattr(local_models_module, "FAILED_COOL_DOWN", 3.0, raising=False)
    await service.start_pool(PoolConfig(models=(
        ModelEntry.for_file(str(tiny_model), settings=SMALL),)))
    _record, secret = service.add_key("crasher")
    pool = service.pool
    killed = None
    for crash in range(2):  # max_restarts=1: the second crash leaves it failed
        # The restarted engine, not the killed one the supervisor has yet to see exit.
        await until(lambda: pool.snapshot("tiny").serving is not None
                    and pool.snapshot("tiny").pid != killed)
        running = await busy_stream(client, "tiny", **auth(secret))
        killed = pool.snapshot("tiny").pid
        os.kill(killed, signal.SIGKILL)
        await asyncio.gather(running, return_exceptions=True)
    await until(lambda: pool.status("tiny").residency is Residency.FAILED)
    failed = pool.status("tiny")
    assert "key 'crasher' were in flight at 2 of its crashes" in failed.decision

    refused = await client.post("/v1/chat/completions", json=chat("tiny"), headers=auth(secret))
    assert refused.status_code == 503, refused.text
    assert "loads again on demand in" in refused.json()["error"]["message"]
    await asyncio.sleep(float(refused.headers["retry-after"]))  # as a client is told to
    text_of(await client.post("/v1/chat/completions", json=chat("tiny"),
                              headers=auth(secret)))  # loaded on demand
    assert pool.status("tiny").residency is Residency.READY


# --- the resolved name goes to a GGUF Studio upstream -------------------------------------


async def test_a_gguf_studio_upstream_is_sent_the_name_this_port_resolved(tmp_path):
    """A fake GGUF Studio port (a real engine cannot show what it was sent)."""
    service = StudioService(Settings(port=0), log_dir=tmp_path / "logs")
    await service.start_gateway()
    try:
        async with FakeUpstream(n_tokens=5) as fake, httpx.AsyncClient(
                base_url=f"http://127.0.0.1:{service.gateway_port}", timeout=60) as client:
            fake.studio_health = studio_health(
                studio_model("a", "ready", 2, aliases=["alpha"]), studio_model("b", "ready", 1))
            await service.attach_upstream(fake.base_url)
            await until(lambda: bool(service.registry.line("a").engines))
            for spelling in ("A", "alpha", "a"):
                text_of(await client.post("/v1/chat/completions", json=chat(spelling)))
            assert [body["model"] for body in fake.received("/v1/chat/completions")] == [
                "a", "a", "a"]
    finally:
        await service.close()
