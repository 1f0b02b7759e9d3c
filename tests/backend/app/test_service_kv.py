"""Admission by KV tokens, end to end: real llama-server, real counting, real port.

The tiny model was trained on 8,192 tokens; loaded with Auto slots and a context of
16,384, llama-server runs 4 slots sharing one pool of 16,384 tokens, each request
capped at 8,192.  Requests of ~6,500 tokens each fit alone, two fit together, three do
not: without the port's accounting llama-server fails them all mid-batch ("Context
size has been exceeded.").
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from backend.llama.kv_capacity import KvCapacity
from backend.llama.api import engine_headers
from backend.llama.load import LoadSettings, LoadSpec, Snapshot, State
from backend.app.service import StudioService
from tests.backend.service_harness import ServiceFactory

POOL = 16384
PER_REQUEST = 8192

WORDS = ("function return value error import class module test file path string list "
         "index buffer stream token parse build change commit branch merge").split()


@pytest.fixture
async def service(running_service: ServiceFactory) -> StudioService:
    return await running_service(keepalive_interval=0.2)


def auto_spec(model: Path) -> LoadSpec:
    return LoadSettings(parallel="auto", ctx_size=POOL).to_spec(str(model))


def port_client(service: StudioService, *, idle_timeout: float = 60.0) -> httpx.AsyncClient:
    """`idle_timeout`: the longest silence the client accepts (httpx's read timeout)."""
    return httpx.AsyncClient(base_url=f"http://127.0.0.1:{service.gateway_port}",
                             timeout=httpx.Timeout(60.0, read=idle_timeout))


def engine(snapshot: Snapshot, **options) -> httpx.AsyncClient:
    """A client of the engine's own port, with the key only the app knows."""
    assert snapshot.serving is not None
    return httpx.AsyncClient(base_url=snapshot.serving.base_url, headers=engine_headers(snapshot.serving.api_key),
                             **options)


async def prompt_of(snapshot: Snapshot, tokens: int) -> str:
    """Text of about `tokens` tokens for the engine's own tokenizer."""
    words = " ".join(WORDS[i % len(WORDS)] for i in range(tokens))
    async with engine(snapshot) as c:
        counted = len((await c.post("/tokenize", json={"content": words})).json()["tokens"])
    return " ".join(WORDS[i % len(WORDS)] for i in range(tokens * tokens // counted))


async def engine_prompt_tokens_total(snapshot: Snapshot) -> float:
    async with engine(snapshot) as c:
        text = (await c.get("/metrics")).text
    for line in text.splitlines():
        if line.startswith("llamacpp:prompt_tokens_total"):
            return float(line.split()[-1])
    raise AssertionError("llama-server reported no prompt_tokens_total")


async def busy_slots(snapshot: Snapshot) -> int:
    # llama-server answers /slots between batches: slow while it evaluates a long prompt.
    async with engine(snapshot, timeout=60) as c:
        return sum(1 for s in (await c.get("/slots")).json() if s.get("is_processing"))


async def read_events(response: httpx.Response) -> list[str]:
    return [line async for line in response.aiter_lines() if line]


class Watch:
    """Samples, until stopped, the engine's busy slots and the port's reserved tokens."""

    def __init__(self, service: StudioService, snapshot: Snapshot) -> None:
        self.service = service
        self.snapshot = snapshot
        self.most_busy = 0
        self.most_reserved = 0
        self.most_active = 0
        self.most_waiting = 0
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            registry = self.service.registry
            self.most_reserved = max(self.most_reserved, registry.total_reserved_tokens)
            self.most_active = max(self.most_active, registry.total_active)
            self.most_waiting = max(self.most_waiting, registry.total_waiting)
            self.most_busy = max(self.most_busy, await busy_slots(self.snapshot))
            await asyncio.sleep(0.02)

    async def stop(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


async def test_auto_slots_load_reports_its_shared_pool_in_health_and_metrics(service, tiny_model):
    snapshot = await service.load(auto_spec(tiny_model))
    assert snapshot.serving.slots == 4
    assert snapshot.serving.kv == KvCapacity(total=POOL, per_request=PER_REQUEST, unified=True)
    async with port_client(service) as client:
        health = (await client.get("/health")).json()
        assert health["kv"] == {"total": POOL, "per_request": PER_REQUEST, "unified": True,
                                "reserved": 0}
        metrics = (await client.get("/metrics")).text
        assert f"gguf_studio_kv_capacity_tokens {POOL:.1f}" in metrics
        assert "gguf_studio_kv_reserved_tokens 0.0" in metrics
        model = (await client.get("/v1/models")).json()["data"][0]
        assert model["context_length"] == PER_REQUEST


async def test_streams_that_fit_alone_but_not_together_all_complete_one_waiting_with_keepalives(
        service, tiny_model):
    snapshot = await service.load(auto_spec(tiny_model))
    prompt = await prompt_of(snapshot, 4500)
    body = {"model": "tiny", "stream": True, "max_tokens": 2000, "ignore_eos": True,
            "messages": [{"role": "user", "content": prompt}]}
    watch = Watch(service, snapshot)

    # The third stream waits for room (two requests of ~2,000 generated tokens each must
    # finish first) far longer than an impatient client's silence; the port keeps it
    # alive meanwhile.  Each line's arrival is timed here: a client timeout of 1 s also
    # cut the running streams on a loaded 2-core machine, silent through their long prompts.
    async with port_client(service) as client:
        async def stream() -> list[tuple[float, str]]:
            async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200
                return [(time.monotonic(), line) async for line in r.aiter_lines() if line]

        timed = await asyncio.gather(*(stream() for _ in range(3)))
    await watch.stop()

    for lines in ([line for _at, line in one] for one in timed):
        assert lines[-1] == "data: [DONE]"
        assert not any('"error"' in line for line in lines)
        assert json.loads(lines[-2].removeprefix("data: "))["choices"][0]["finish_reason"] == "length"
    assert watch.most_waiting == 1  # one waited, kept alive
    assert watch.most_active == 2 and watch.most_busy == 2  # a slot stayed free: tokens held it
    assert 2 * 6000 < watch.most_reserved <= POOL
    waited = service.metrics.value("gguf_studio_queue_wait_seconds_sum")
    assert waited > 1.0
    # The one that waited heard a keep-alive every keepalive_interval (0.2 s) until its
    # first token: never a silence of more than a fraction of its wait.
    before_tokens = [[at for at, line in one[:_first_data(one)]] for one in timed]
    kept = max(before_tokens, key=len)
    gaps = [later - earlier for earlier, later in zip(kept, kept[1:])]
    assert kept[-1] - kept[0] > 1.0 and len(kept) >= 5
    assert max(gaps) < (kept[-1] - kept[0]) / 2, gaps


def _first_data(timed: list[tuple[float, str]]) -> int:
    return next(i for i, (_at, line) in enumerate(timed) if line.startswith("data:"))


async def test_a_responses_stream_waiting_for_tokens_gets_in_progress_events_and_completes(
        service, tiny_model):
    snapshot = await service.load(auto_spec(tiny_model))
    prompt = await prompt_of(snapshot, 4500)
    chat = {"model": "tiny", "stream": True, "max_tokens": 2000, "ignore_eos": True,
            "messages": [{"role": "user", "content": prompt}]}
    responses = {"model": "tiny", "stream": True, "max_output_tokens": 2000,
                 "input": [{"role": "user", "content": prompt}]}
    async with port_client(service, idle_timeout=1.0) as client:
        async def chat_stream() -> list[str]:
            async with client.stream("POST", "/v1/chat/completions", json=chat) as r:
                return await read_events(r)

        async def responses_stream() -> list[str]:
            async with client.stream("POST", "/v1/responses", json=responses) as r:
                assert r.status_code == 200
                return await read_events(r)

        running = [asyncio.create_task(chat_stream()) for _ in range(2)]
        await until(lambda: service.registry.total_active == 2)
        waiting = asyncio.create_task(responses_stream())
        await until(lambda: service.registry.total_waiting == 1)
        lines = await waiting
        await asyncio.gather(*running)

    names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    assert names[0] == "response.created"
    assert names[1] == "response.in_progress"  # our keep-alive while it waited
    assert names[-1] == "response.completed"
    assert not any("error" in name or "failed" in name for name in names)
    assert service.metrics.value("gguf_studio_queue_wait_seconds_sum") > 1.0


async def test_four_short_requests_still_run_at_once(service, tiny_model):
    snapshot = await service.load(auto_spec(tiny_model))
    body = {"model": "tiny", "stream": True, "max_tokens": 400, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Write a function that parses a path."}]}
    watch = Watch(service, snapshot)
    async with port_client(service) as client:
        async def stream() -> list[str]:
            async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                return await read_events(r)

        results = await asyncio.gather(*(stream() for _ in range(4)))
    await watch.stop()
    assert all(lines[-1] == "data: [DONE]" for lines in results)
    assert watch.most_active == 4
    assert watch.most_waiting == 0


async def test_a_prompt_that_can_never_fit_is_refused_at_once_before_the_engine_starts_it(
        service, tiny_model):
    snapshot = await service.load(auto_spec(tiny_model))
    prompt = await prompt_of(snapshot, PER_REQUEST + 500)
    before = await engine_prompt_tokens_total(snapshot)
    async with port_client(service) as client:
        for stream in (True, False):
            started = time.monotonic()
            r = await client.post("/v1/chat/completions", json={
                "model": "tiny", "stream": stream,
                "messages": [{"role": "user", "content": prompt}]})
            assert time.monotonic() - started < 1.0
            assert r.status_code == 400
            error = r.json()["error"]
            assert error["code"] == "context_length_exceeded"
            assert f"{PER_REQUEST:,} tokens per request" in error["message"]
        metrics = (await client.get("/metrics")).text
    # Refused before admission: counted under its model, on no engine.
    assert ('gguf_studio_rejections_total{engine="",model="tiny",'
            'reason="context_length_exceeded"} 2.0') in metrics
    assert await busy_slots(snapshot) == 0
    assert await engine_prompt_tokens_total(snapshot) == before  # nothing evaluated


async def until(predicate, timeout: float = 30.0, interval: float = 0.02) -> None:
    async def poll():
        while not predicate():
            await asyncio.sleep(interval)
    await asyncio.wait_for(poll(), timeout)


async def test_without_admission_the_engines_context_error_reaches_clients_with_a_string_code(
        service, tiny_model):
    """The same three streams with admission switched off: llama-server runs them all,
    its pool overflows mid-generation and it ends each stream with an error event whose
    code is the number 500; the port relays it as OpenAI's `context_length_exceeded`."""
    snapshot = await service.load(auto_spec(tiny_model))
    await service.apply_settings(service.settings.replace(admission_enabled=False))
    prompt = await prompt_of(snapshot, 4500)
    body = {"model": "tiny", "stream": True, "max_tokens": 2000, "ignore_eos": True,
            "messages": [{"role": "user", "content": prompt}]}
    async with port_client(service) as client:
        async def stream() -> list[str]:
            async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200
                return await read_events(r)

        results = await asyncio.gather(*(stream() for _ in range(3)))
    failed = [lines for lines in results if '"error"' in lines[-2]]
    assert failed  # the engine could not hold them together
    for lines in failed:
        assert lines[-1] == "data: [DONE]"
        error = json.loads(lines[-2].removeprefix("data: "))["error"]
        assert error["code"] == "context_length_exceeded"
        assert error["message"] == "Context size has been exceeded."


async def test_when_the_engine_cannot_count_in_time_the_documented_estimate_decides(
        service, tiny_model, caplog):
    """The real engine, but the counter's deadline is made too short for any answer:
    counting fails as it does for a busy or an older engine, and the request is
    measured by its bytes (plus TEMPLATE_ALLOWANCE), with one warning in the log."""
    snapshot = await service.load(auto_spec(tiny_model))
    gateway = service._gateway.served
    planner = gateway.planner.planner_for(service.registry.current)
    assert planner is not None
    planner.counter.timeout = 1e-9
    prompt = await prompt_of(snapshot, 700)  # beyond the byte bound's shortcut
    async with port_client(service) as client:
        ok = await client.post("/v1/chat/completions", json={
            "model": "tiny", "max_tokens": 20,
            "messages": [{"role": "user", "content": prompt}]})
        assert ok.status_code == 200
        assert ok.json()["choices"][0]["message"]["content"]
        # ~5 bytes a token: 2,100 real tokens are estimated above the 8,192 limit.  The
        # estimate errs on the safe side: refused, never overflowing the engine.
        too_long = await client.post("/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": " ".join([prompt] * 3)}]})
        assert too_long.status_code == 400
        assert too_long.json()["error"]["code"] == "context_length_exceeded"
    warnings = [r for r in caplog.records if "conservative estimate" in r.getMessage()]
    assert len(warnings) == 1


async def test_the_cache_is_forgotten_with_the_slots_when_the_engine_stops_and_read_again(
        service, tiny_model):
    seen: list[Snapshot] = []
    service.add_listener(seen.append)
    first = await service.load(auto_spec(tiny_model))
    os.kill(first.pid, signal.SIGKILL)
    await until(lambda: service.snapshot().state is State.READY
                and service.snapshot().pid != first.pid)
    restarting = [s for s in seen if s.restarting]
    assert restarting and all(s.serving is None
                              for s in restarting)
    assert service.snapshot().serving.kv == first.serving.kv
    assert service.registry.kv_capacity == POOL
