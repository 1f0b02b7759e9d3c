"""Work done before a request waits in line or runs is bounded: the bytes of bodies being
read, parsed and counted (`max_incoming_body_bytes`), and the prompt counts asked of the
engine at once (`max_prompt_counts`); past either a request gets 429 with Retry-After,
and the port stays responsive.  Requests with tools are admitted on their byte bound
when it proves they fit, without a count.

The fake upstream stands in for the engine because only it can hold counts open
deterministically (`count_gate`): a slow counter.  Requests with an image are always
counted (an image's bytes bound nothing), so they all reach the counting stage.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from backend.llama.kv_capacity import KvCapacity
from backend.llama.load import Serving
from tests.backend.gateway_harness import (CHAT, Gateway, assert_clean_error, chat, open_gateway,
                                           until)
from tests.fake_upstream import FakeUpstream

ROOT = Path(__file__).resolve().parents[3]
MiB = 1024 * 1024
SLOTS = 4


def with_image(size: int) -> bytes:
    """A chat body of about `size` bytes whose prompt must be counted by the engine."""
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * size}}
    return httpx.Request("POST", "/", json=chat(messages=[{"role": "user", "content": [
        {"type": "text", "text": "What is this?"}, image]}])).content


def rss(pid: int) -> int:
    """Resident memory of process `pid`, in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.fixture
async def slow_counter() -> AsyncIterator[FakeUpstream]:
    """An engine whose prompt counts are held until the test lets them go."""
    async with FakeUpstream(slots=SLOTS, n_ctx=1 << 24) as fake:
        yield fake
        if fake.count_gate is not None:
            fake.count_gate.set()


@pytest.fixture
async def serve(slow_counter: FakeUpstream, tmp_path: Path) -> AsyncIterator[tuple[str, int]]:
    """`gguf-studio serve` attached to the slow counter, in a process of its own (its
    memory is the port's alone): (base URL, pid)."""
    env = dict(os.environ, XDG_CONFIG_HOME=str(tmp_path / "config"),
               XDG_STATE_HOME=str(tmp_path / "state"), XDG_CACHE_HOME=str(tmp_path / "cache"))
    env = {k: v for k, v in env.items() if not k.startswith("GGUF_STUDIO_")}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "backend.app.cli", "serve", "--upstream", slow_counter.base_url,
        "--port", "0", "--max-incoming-body-bytes", os.environ.get("PG_BUDGET", str(4 * MiB)), "--max-prompt-counts", "100",
        "--max-body-bytes", str(8 * MiB), cwd=ROOT, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    try:
        url = ""
        ready = False
        while not (url and ready):
            line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
            assert line, (await proc.stderr.read()).decode()  # serve exited
            if line.strip().startswith("http://"):
                url = line.strip().removesuffix("/v1")
            ready = ready or line.startswith("[ready]")
        yield url, proc.pid
    finally:
        proc.terminate()
        await proc.wait()


async def test_forty_counted_requests_keep_the_ports_memory_within_the_budget(slow_counter, serve):
    url, pid = serve
    body = with_image(MiB)  # one body object for every request: the client's memory is flat
    async with httpx.AsyncClient(base_url=url, timeout=60, trust_env=False,
                                 limits=httpx.Limits(max_connections=100)) as client:
        async def post() -> httpx.Response:
            return await client.post(CHAT, content=body,
                                     headers={"content-type": "application/json"})

        # Warm up (template probe, first count, the port's buffers), then measure.
        assert (await post()).status_code == 200
        before = rss(pid)
        slow_counter.count_gate = asyncio.Event()
        counted = len(slow_counter.counted)
        fits = 4 * MiB // len(body)  # 3 bodies of 1 MiB and a bit
        requests = [asyncio.create_task(post()) for _ in range(40)]
        await until(lambda: sum(t.done() for t in requests) == 40 - fits, timeout=30)
        refused = [t.result() for t in requests if t.done()]
        await until(lambda: len(slow_counter.counted) - counted == fits, timeout=30)
        during = rss(pid)
        health = await asyncio.wait_for(client.get("/health"), 2)  # responsive meanwhile

        slow_counter.count_gate.set()
        answers = await asyncio.gather(*requests)

    assert health.status_code == 200
    for response in refused:
        error = assert_clean_error(response, 429, "bodies_in_flight_full")
        assert "4 MiB" in error["message"]
        assert response.headers["retry-after"] == "1"
    assert sorted(r.status_code for r in answers) == [200] * fits + [429] * (40 - fits)
    growth = during - before
    print(f"\nport memory while {fits} requests of {len(body) / MiB:.1f} MiB were counted and "
          f"{40 - fits} refused: +{growth / MiB:.1f} MiB (budget 4 MiB)")
    # A held request keeps its body, its parse and the copy sent to be counted, and the
    # allocator keeps what reading and parsing it took: measured here +17 MiB for the
    # three held (4.2x the budget), where the 40 unbounded took +200 MiB.
    assert growth < 6 * 4 * MiB


async def test_a_declared_length_alone_takes_nothing_from_the_budget(slow_counter, gw_counting):
    """Declaring 8 MiB and sending nothing costs a client nothing: it must not shut
    others out of a 4 MiB budget (only bytes received are held)."""
    gw = gw_counting
    gw.configure(max_incoming_body_bytes=4 * MiB, max_body_bytes=8 * MiB)
    loop = asyncio.get_running_loop()
    with socket.socket() as sock:
        sock.setblocking(False)
        await loop.sock_connect(sock, ("127.0.0.1", gw.server.port))
        await loop.sock_sendall(sock, b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                                      b"Content-Type: application/json\r\n"
                                      b"Content-Length: %d\r\n\r\n{" % (8 * MiB))
        await until(lambda: gw.server.served.incoming.used == 1)
        counted = len(slow_counter.counted)
        response = await gw.client.post(CHAT, content=with_image(2 * MiB),
                                        headers={"content-type": "application/json"})
        assert response.status_code != 429, response.text
        assert len(slow_counter.counted) == counted + 1  # read, parsed and counted
    await until(lambda: gw.server.served.incoming.used == 0)


# --- the counts asked of the engine at once ------------------------------------------------


@pytest.fixture
async def gw_counting(slow_counter: FakeUpstream) -> AsyncIterator[Gateway]:
    async with open_gateway(slow_counter.base_url, SLOTS, kv=KvCapacity.shared(SLOTS * 4096),
                            max_output_tokens=64) as gw:
        response = await gw.client.post(CHAT, json=chat())  # measures the template
        assert response.status_code == 200
        yield gw


async def test_past_twice_the_slots_in_counts_a_request_is_refused_and_the_port_answers(
        slow_counter, gw_counting):
    gw = gw_counting
    slow_counter.count_gate = asyncio.Event()
    body = with_image(1000)
    requests = [asyncio.create_task(gw.client.post(
        CHAT, content=body, headers={"content-type": "application/json"})) for _ in range(20)]
    await until(lambda: sum(t.done() for t in requests) == 20 - 2 * SLOTS)
    assert len([r for r in slow_counter.counted if "messages" in r.body
                and isinstance(r.body["messages"][0]["content"], list)]) == 2 * SLOTS
    for task in requests:
        if task.done():
            error = assert_clean_error(task.result(), 429, "prompt_counts_full", gw)
            assert task.result().headers["retry-after"] == "1"
            assert "counting" in error["message"]
    assert (await asyncio.wait_for(gw.client.get("/health"), 2)).status_code == 200
    assert gw.registry.total_active == 0 and gw.registry.total_waiting == 0

    slow_counter.count_gate.set()
    answers = await asyncio.gather(*requests)
    assert sorted(r.status_code for r in answers) == [200] * 2 * SLOTS + [429] * 12
    assert gw.rejections("prompt_counts_full") == 12


async def test_the_cap_of_counts_follows_the_settings_live(slow_counter, gw_counting):
    gw = gw_counting
    gw.configure(max_prompt_counts=1)
    slow_counter.count_gate = asyncio.Event()
    body = with_image(1000)
    first = asyncio.create_task(gw.client.post(CHAT, content=body,
                                               headers={"content-type": "application/json"}))
    await until(lambda: gw.server.served.planner.planner_for(gw.registry.current).counter.counting == 1)
    second = await gw.client.post(CHAT, content=body, headers={"content-type": "application/json"})
    assert_clean_error(second, 429, "prompt_counts_full", gw)
    slow_counter.count_gate.set()
    assert (await first).status_code == 200


async def test_a_pools_counts_at_once_follow_the_slots_of_all_its_engines(slow_counter,
                                                                          gw_counting):
    """One engine plans (and counts) for its model's whole line: a pool of two engines of
    `SLOTS` slots takes twice the slots of both in counts at once, not of one (the first
    turns of 6 agents on 2 engines were refused 429 while slots were free)."""
    gw = gw_counting
    async with FakeUpstream(slots=SLOTS, n_ctx=1 << 24) as other:
        gw.registry.activate(Serving(other.base_url, SLOTS, kv=KvCapacity.shared(SLOTS * 4096)),
                             engine="other")
        slow_counter.count_gate = asyncio.Event()
        other.count_gate = asyncio.Event()
        body = with_image(1000)
        requests = [asyncio.create_task(gw.client.post(
            CHAT, content=body, headers={"content-type": "application/json"}))
            for _ in range(4 * SLOTS)]

        def counting() -> int:
            return sum(1 for fake in (slow_counter, other) for r in fake.counted
                       if "messages" in r.body and isinstance(r.body["messages"][0]["content"],
                                                              list))

        try:
            await until(lambda: counting() == 4 * SLOTS or any(t.done() for t in requests))
            assert not [t.result().text for t in requests if t.done()]
        finally:
            slow_counter.count_gate.set()
            other.count_gate.set()
            answers = await asyncio.gather(*requests)
        assert [r.status_code for r in answers] == [200] * 4 * SLOTS
        assert gw.rejections("prompt_counts_full") == 0


# --- tools on their byte bound --------------------------------------------------------------


TOOLS = [{"type": "function", "function": {
    "name": f"tool_{i}", "description": "Does one thing to a file of the project.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                   "required": ["path"]}}} for i in range(3)]


async def test_a_short_request_with_tools_is_admitted_on_its_bound_without_a_count(
        slow_counter, gw_counting):
    """Agents send tools with every request: a short one is reserved at its byte bound
    (the tools' share measured once per engine), not counted first."""
    gw = gw_counting
    body = chat(messages=[{"role": "user", "content": "List the files."}], tools=TOOLS)
    first = await gw.client.post(CHAT, json=body)  # measures what tools cost, once
    assert first.status_code == 200
    probes = len(slow_counter.counted)
    slow_counter.count_gate = asyncio.Event()  # a count now would hang the request
    again = await asyncio.wait_for(gw.client.post(CHAT, json=body), 5)
    assert again.status_code == 200
    assert len(slow_counter.counted) == probes  # not counted
    counter = gw.server.served.planner.planner_for(gw.registry.current).counter
    assert counter.tool_costs is not None
