"""Client-supplied session names through the port of a real engine: a named key that
names each request's session with 30 MiB holds no more of the port than one that names
it "agent-7", and the inspector's answer stays small."""

from __future__ import annotations

import asyncio
import os
import sys

import httpx
import pytest

from backend.app.pool.pool_config import ModelEntry, PoolConfig
from backend.app.service import StudioService
from backend.llama.load import LoadSettings
from backend.port.request_log import RequestRecord
from tests.backend.service_harness import ServiceFactory

#: What a client once made the port keep four times over, each request anew.
HUGE = 30 << 20
REQUESTS = 20
#: The client, in a process of its own: only the port's memory is this process's.  A
#: session per request, each named with its own 30 MiB.
CLIENT = """
import os, httpx
head = (b'{"model": "tiny", "max_tokens": 1, "temperature": 0, "messages": '
        b'[{"role": "user", "content": "Say hi."}], "prompt_cache_key": "')
with httpx.Client(base_url=os.environ["PORT_URL"], timeout=300, headers={
        "authorization": "Bearer " + os.environ["PORT_KEY"],
        "content-type": "application/json"}) as client:
    for n in range(int(os.environ["REQUESTS"])):
        name = b"%02d" % n + b"s" * (int(os.environ["NAME_BYTES"]) - 2)
        answer = client.post("/v1/chat/completions", content=head + name + b'"}')
        assert answer.status_code == 200, answer.text[:300]
"""


@pytest.fixture
async def service(running_service: ServiceFactory, tiny_model) -> StudioService:
    service = await running_service()
    await service.start_pool(PoolConfig(models=(ModelEntry.for_file(
        str(tiny_model), settings=LoadSettings(parallel="2", ctx_size=2048)),)))
    return service


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
async def test_twenty_sessions_named_with_30_mib_each_add_less_than_50_mib_to_the_port(
        service: StudioService) -> None:
    _, secret = service.keys.add("mallory")
    exported: list[RequestRecord] = []
    service.requests.exporter = lambda record, traceparent: exported.append(record)
    await send(service, secret, requests=1, name_bytes=16)  # the port's first request
    before = resident_mib()
    await send(service, secret, requests=REQUESTS, name_bytes=HUGE)
    # No collection forced: what the port holds until its collector happens to run
    # counts (it held each request's body in a cycle that way).
    grown = resident_mib() - before
    print(f"{REQUESTS} sessions named with 30 MiB each: the port's resident memory "
          f"{before} -> {before + grown} MiB")
    assert grown < 50
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{service.gateway_port}",
                                 headers={"authorization": f"Bearer {secret}"}) as client:
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
    assert all(len(s.session) < 256 for s in service.registry.sessions.caches())


async def send(service: StudioService, secret: str, *, requests: int, name_bytes: int) -> None:
    """`requests` answered turns from the client process, each session named with
    `name_bytes`."""
    client = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CLIENT, env=dict(
            os.environ, PORT_URL=f"http://127.0.0.1:{service.gateway_port}", PORT_KEY=secret,
            REQUESTS=str(requests), NAME_BYTES=str(name_bytes)))
    assert await asyncio.wait_for(client.wait(), 600) == 0


def resident_mib() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) // 1024
    raise AssertionError("no VmRSS in /proc/self/status")
