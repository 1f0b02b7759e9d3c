"""The whole backend: real llama-server, real admission, real port, on one loop."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
from pathlib import Path
from typing import Any

import httpx
import pytest

from backend.errors import SettingsError
from backend.addresses import client_urls
from backend.admission.hash_ring import HashRing
from backend.admission.placement import KeepPrefixes
from backend.app.pool.pool_config import ModelEntry, PoolConfig
from backend.app.service import StudioService, check_bind_allowed
from backend.settings import Settings
from backend.llama.api import engine_headers
from backend.llama.load import LoadSettings, LoadSpec, Snapshot, State
from tests.backend.service_harness import ServiceFactory

# A long generation holds a slot for seconds on the tiny model (random weights never
# stop by themselves; ignore_eos makes sure).
LONG: dict[str, Any] = {"max_tokens": 4000, "ignore_eos": True}


@pytest.fixture
async def service(running_service: ServiceFactory) -> StudioService:
    return await running_service(keepalive_interval=0.2, reload_grace=30)


@pytest.fixture
def client(port_client: httpx.AsyncClient) -> httpx.AsyncClient:
    return port_client


def spec(model: Path, parallel: str = "2", ctx: int = 16384) -> LoadSpec:
    return LoadSettings(parallel=parallel, ctx_size=ctx).to_spec(str(model))


def chat(stream: bool = True, **extra) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}],
            "stream": stream, **extra}


async def until(predicate, timeout: float = 30.0, interval: float = 0.02) -> None:
    """Poll a condition of the running system (slots of a real server have no events)."""
    async def poll():
        while not predicate():
            await asyncio.sleep(interval)
    await asyncio.wait_for(poll(), timeout)


async def busy_slots(snapshot: Snapshot) -> int:
    assert snapshot.serving is not None
    async with httpx.AsyncClient(headers=engine_headers(snapshot.serving.api_key), timeout=60) as c:
        slots = (await c.get(f"{snapshot.serving.base_url}/slots")).raise_for_status().json()
    return sum(1 for s in slots if s.get("is_processing"))


async def read_events(response: httpx.Response) -> list[str]:
    return [line async for line in response.aiter_lines() if line]


async def test_n_plus_one_streams_with_n_slots_one_waits_with_keepalives_then_completes(
        service, client, tiny_model):
    await service.load(spec(tiny_model, parallel="2"))
    # The first two must still run when the third arrives, however loaded the machine:
    # long enough that the third is queued behind them, not admitted after they ended.
    long, short = {"max_tokens": 2000, "ignore_eos": True}, {"max_tokens": 300, "ignore_eos": True}

    async def stream(limits: dict) -> list[str]:
        async with client.stream("POST", "/v1/chat/completions", json=chat(**limits)) as r:
            assert r.status_code == 200
            return await read_events(r)

    running = [asyncio.create_task(stream(long)) for _ in range(2)]
    await until(lambda: service.registry.total_active == 2)
    third = asyncio.create_task(stream(short))
    await until(lambda: service.registry.total_waiting == 1)  # exactly one has to wait
    results = await asyncio.gather(*running, third)
    assert results[2][0] == ": keep-alive"  # ...and was kept alive meanwhile
    for lines in results:
        assert lines[-1] == "data: [DONE]"
        last_chunk = json.loads(lines[-2].removeprefix("data: "))
        assert last_chunk["choices"][0]["finish_reason"] == "length"


async def test_disconnect_while_running_frees_the_engine_slot(service, client, tiny_model):
    snapshot = await service.load(spec(tiny_model, parallel="2"))
    first_token = asyncio.Event()

    async def read_until_gone() -> None:
        body = chat(max_tokens=8000, ignore_eos=True)  # far longer than the test takes
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data:"):
                    first_token.set()  # the request is running on the engine

    reading = asyncio.create_task(read_until_gone())
    await asyncio.wait_for(first_token.wait(), 60)
    # The engine's /slots, read until it shows the request (a loaded machine answers it
    # between batches, and late), while the client keeps reading.
    await until_slots(snapshot, lambda busy: busy == 1)
    assert not reading.done()
    reading.cancel()  # the client goes away mid-stream
    await asyncio.gather(reading, return_exceptions=True)
    # The port closes the engine's request: the slot is free long before 8,000 tokens.
    await until(lambda: service.registry.total_active == 0)
    await until_slots(snapshot, lambda busy: busy == 0)
    assert await engine_tokens_predicted(snapshot) < 8000


async def engine_tokens_predicted(snapshot: Snapshot) -> float:
    """Tokens the engine generated since it started (its own /metrics)."""
    assert snapshot.serving is not None
    async with httpx.AsyncClient(headers=engine_headers(snapshot.serving.api_key), timeout=60) as c:
        text = (await c.get(f"{snapshot.serving.base_url}/metrics")).raise_for_status().text
    return next(float(line.split()[-1]) for line in text.splitlines()
                if line.startswith("llamacpp:tokens_predicted_total"))


async def until_slots(snapshot: Snapshot, wanted, timeout: float = 60.0) -> None:
    """Read the engine's busy slots until `wanted(busy)` holds, or fail after `timeout`."""
    seen: list[int] = []

    async def poll() -> None:
        while not seen or not wanted(seen[-1]):
            seen.append(await busy_slots(snapshot))
            await asyncio.sleep(0.05)
    try:
        await asyncio.wait_for(poll(), timeout)
    except TimeoutError:
        raise AssertionError(f"the engine's busy slots never matched; read {seen[-10:]}") from None


async def test_disconnect_while_queued_leaves_the_line(service, client, tiny_model):
    await service.load(spec(tiny_model, parallel="1"))
    async with client.stream("POST", "/v1/chat/completions", json=chat(**LONG)) as running:
        # Each iterator held, not left by a `break`: a dropped one is closed when
        # collected, which hangs up at a random moment.
        running_lines = running.aiter_lines()
        async for line in running_lines:
            if line.startswith("data:"):
                break
        async with client.stream("POST", "/v1/chat/completions", json=chat(**LONG)) as queued:
            queued_lines = queued.aiter_lines()
            assert (await anext(queued_lines)).startswith(":")  # a keep-alive: it is waiting
            assert service.registry.total_waiting == 1
        await until(lambda: service.registry.total_waiting == 0, timeout=5)


async def test_engine_killed_mid_stream_ends_the_stream_with_an_error(service, client, tiny_model):
    snapshot = await service.load(spec(tiny_model, parallel="1"))
    async with client.stream("POST", "/v1/chat/completions", json=chat(**LONG)) as r:
        lines = []
        async for line in r.aiter_lines():
            if not line:
                continue
            lines.append(line)
            if len(lines) == 2:
                os.kill(snapshot.pid, signal.SIGKILL)
        assert lines[-1] == "data: [DONE]"
        error = json.loads(lines[-2].removeprefix("data: "))["error"]
        assert isinstance(error["code"], str)
        assert "127.0.0.1" not in json.dumps(error)
    # ...and the engine comes back by itself, on a new queue.
    await until(lambda: service.snapshot().state is State.READY and service.snapshot().pid != snapshot.pid)
    assert service.registry.current.key != snapshot.serving.base_url


async def test_engine_killed_with_requests_waiting_serves_the_waiting_ones_on_the_restarted_load(
        service, client, tiny_model):
    """Only the requests the engine had started fail; the ones waiting in line keep
    their place (the slots the dying load dropped stay empty while its crash is noticed,
    and a waiter promoted onto it anyway goes back to its place when its connection is
    refused: test_pool.py's crash requeue makes that certain) and are served by the
    restarted engine."""
    snapshot = await service.load(spec(tiny_model, parallel="2"))
    short = {"max_tokens": 40, "ignore_eos": True}
    first_token = [asyncio.Event(), asyncio.Event()]

    async def stream(body: dict, started: asyncio.Event | None = None) -> list[str]:
        async with client.stream("POST", "/v1/chat/completions", json=chat(**body)) as r:
            assert r.status_code == 200
            lines = []
            async for line in r.aiter_lines():
                if line:
                    lines.append(line)
                if started is not None and line.startswith("data:"):
                    started.set()
            return lines

    running = [asyncio.create_task(stream(LONG, started)) for started in first_token]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in first_token)), 30)
    waiting = [asyncio.create_task(stream(short)) for _ in range(3)]
    await until(lambda: service.registry.total_waiting == 3)
    os.kill(snapshot.pid, signal.SIGKILL)

    for lines in await asyncio.gather(*running):
        assert lines[-1] == "data: [DONE]"
        assert "error" in json.loads(lines[-2].removeprefix("data: "))
    for lines in await asyncio.gather(*waiting):
        assert lines[-1] == "data: [DONE]"
        last = json.loads(lines[-2].removeprefix("data: "))
        assert "error" not in last, last
        assert last["choices"][0]["finish_reason"] == "length"
    assert service.snapshot().pid != snapshot.pid
    assert service.registry.total_active == 0 and service.registry.total_waiting == 0


async def test_a_client_that_stops_reading_is_dropped_and_its_slot_freed(service, tiny_model):
    """A real socket with a tiny receive buffer that sends a streamed request and never
    reads: after `client_stall_timeout` without progress the port drops it, closes the
    engine's request and frees the slot."""
    service.settings = service.settings.replace(client_stall_timeout=1.0)
    snapshot = await service.load(spec(tiny_model, parallel="1"))
    # Top log-probabilities make each event ~3 KB, so the few MB the kernel buffers for
    # a socket fill within seconds.
    body = json.dumps(chat(max_tokens=12000, ignore_eos=True, logprobs=True,
                           top_logprobs=20)).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    sock.connect(("127.0.0.1", service.gateway_port))
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                 b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
                 + body)
    try:
        await until(lambda: service.registry.total_active == 1)
        await until(lambda: service.metrics.value("gguf_studio_stalled_clients_total") == 1,
                    timeout=20)
        # Counted under the engine that ran it.
        assert service.metrics.value("gguf_studio_stalled_clients_total",
                                     {"engine": "this machine"}) == 1
        await until(lambda: service.registry.total_active == 0, timeout=5)

        async def engine_idle() -> None:
            while await busy_slots(snapshot):
                await asyncio.sleep(0.05)
        await asyncio.wait_for(engine_idle(), 5)
        # The connection is gone: what the client reads ends (reset or end of stream).
        sock.setblocking(False)
        loop = asyncio.get_running_loop()

        async def read_to_end() -> None:
            while True:
                try:
                    if not await loop.sock_recv(sock, 65536):
                        return
                except ConnectionResetError:
                    return
        await asyncio.wait_for(read_to_end(), 10)
    finally:
        sock.close()
    assert service.snapshot().pid == snapshot.pid  # the engine was not harmed


async def test_reload_lets_running_requests_finish_moves_waiting_ones_and_prunes_the_old_queue(
        service, client, tiny_model):
    old = await service.load(spec(tiny_model, parallel="1"))

    # 600 tokens of the tiny model ended before the second stream was seen waiting on a
    # busy machine (2 runs in 5 with the other core loaded); 2,000 did in none of 10.
    medium: dict[str, Any] = {"max_tokens": 2000, "ignore_eos": True}

    async def stream() -> list[str]:
        async with client.stream("POST", "/v1/chat/completions", json=chat(**medium)) as r:
            return await read_events(r)

    running = asyncio.create_task(stream())
    await until(lambda: service.registry.total_active == 1)
    waiting = asyncio.create_task(stream())
    await until(lambda: service.registry.total_waiting == 1)
    reload = asyncio.create_task(service.load(spec(tiny_model, parallel="2")))
    # While the old load drains, a new request waits for the new load (its queue timeout
    # counts), instead of being told to come back.
    await until(lambda: service.registry.current is None)
    newcomer = asyncio.create_task(client.post("/v1/chat/completions", json=chat(stream=False)))

    new = await reload
    answered = await newcomer
    assert answered.status_code == 200, answered.text
    first, second = await asyncio.gather(running, waiting)
    assert first[-1] == "data: [DONE]" and '"finish_reason":"length"' in first[-2]
    assert second[-1] == "data: [DONE]" and '"finish_reason":"length"' in second[-2]
    assert [q.key for q in service.registry.queues] == [new.serving.base_url]
    assert old.serving.base_url != new.serving.base_url


async def test_reload_grace_expiry_ends_running_requests_cleanly(service, client, smollm2_model,
                                                               caplog):
    # SmolLM2, whose stream outlasts the reload many times over: the tiny model's whole
    # answer takes about as long as the reload, and a cancel that meets the end of its
    # generation can leave the pinned llama-server stuck, ignoring SIGTERM (seen 1 run
    # in 5 on a busy machine: its log ends at "cancel task"; the supervisor kills it).
    loaded = await service.load(spec(smollm2_model, parallel="1", ctx=4096))
    model = loaded.model_id
    service.settings = service.settings.replace(reload_grace=0.5)
    async with client.stream("POST", "/v1/chat/completions",
                             json=chat(model=model, **LONG)) as r:
        lines = []
        reload = None
        async for line in r.aiter_lines():
            if line:
                lines.append(line)
            if reload is None:
                reload = asyncio.create_task(
                    service.load(spec(smollm2_model, parallel="1", ctx=4096)))
        assert reload is not None
        await reload
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2].removeprefix("data: "))["error"]["code"] == "model_reloaded"
    # The port closed the engine's request, so the old engine stopped on SIGTERM alone
    # (llama-server otherwise finishes the generation first).
    assert "ignored SIGTERM" not in caplog.text


async def test_metrics_count_restarts_and_slots(service, client, tiny_model):
    snapshot = await service.load(spec(tiny_model, parallel="3"))
    text = (await client.get("/metrics")).text
    assert "gguf_studio_effective_parallel_slots 3.0" in text
    os.kill(snapshot.pid, signal.SIGKILL)
    await until(lambda: service.snapshot().state is State.READY and service.snapshot().pid != snapshot.pid)
    text = (await client.get("/metrics")).text
    assert "gguf_studio_backend_restarts_total 1.0" in text


async def test_health_and_models_describe_the_load(service, client, tiny_model):
    health = (await client.get("/health")).json()
    assert health["state"] == "stopped"
    assert (await client.get("/v1/models")).json()["data"] == []
    await service.load(spec(tiny_model, parallel="2", ctx=8192))
    health = (await client.get("/health")).json()
    assert health["state"] == "ready"
    assert health["effective_parallel_slots"] == 2
    model = (await client.get("/v1/models")).json()["data"][0]
    assert model["id"] == "tiny"
    assert model["context_length"] == service.snapshot().serving.context_length


def test_lan_bind_without_a_key_is_refused():
    with pytest.raises(SettingsError, match="without an API key"):
        check_bind_allowed(Settings(host="0.0.0.0"))
    check_bind_allowed(Settings(host="0.0.0.0", api_key="gs-0123456789abcdef"))
    check_bind_allowed(Settings(host="0.0.0.0", allow_no_key=True))
    check_bind_allowed(Settings(host="127.0.0.1"))


def test_urls_name_every_address_when_bound_to_all():
    urls = client_urls("0.0.0.0", 8899)
    assert "http://127.0.0.1:8899/v1" in urls
    assert urls[-1] == "http://127.0.0.1:8899/v1"  # loopback last: the LAN ones matter more
    assert client_urls("127.0.0.1", 8899) == ["http://127.0.0.1:8899/v1"]


async def test_loads_clicked_in_quick_succession_leave_one_engine_serving_the_last(service, client,
                                                                                    tiny_model):
    """What the window's Load button does when clicked again while a model starts (it stays
    enabled so that another model can be chosen mid-load): the last click wins."""
    from tests.backend.llama.test_supervisor import llama_server_children

    async with asyncio.timeout(120):
        results = await asyncio.gather(*(service.load(spec(tiny_model, parallel=str(n), ctx=2048))
                                         for n in (1, 2, 3)), return_exceptions=True)
    last = results[-1]
    assert not isinstance(last, BaseException), last
    assert llama_server_children() == [last.pid]
    assert service.snapshot().serving.slots == 3
    assert service.registry.current.capacity == 3
    answer = await client.post("/v1/chat/completions", json=chat(stream=False, max_tokens=2))
    assert answer.status_code == 200


async def test_a_models_line_takes_its_own_placement_else_the_ports_as_the_settings_change(
        running_service: ServiceFactory, tiny_model: Path) -> None:
    service = await running_service()
    await service.start_pool(PoolConfig(models=(
        ModelEntry.for_file(str(tiny_model), "ringed", placement="hash-ring", preload=False),
        ModelEntry.for_file(str(tiny_model), "plain", preload=False))))
    assert isinstance(service.registry.line("ringed").placement, HashRing)
    assert isinstance(service.registry.line("plain").placement, KeepPrefixes)
    await service.apply_settings(service.settings.replace(placement="hash-ring"))
    assert isinstance(service.registry.line("plain").placement, HashRing)
    await service.apply_settings(service.settings.replace(placement="keep-prefixes"))
    assert isinstance(service.registry.line("ringed").placement, HashRing)  # its own
    assert isinstance(service.registry.line("plain").placement, KeepPrefixes)
