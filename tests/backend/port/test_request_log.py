"""The request inspector: its ring, and its records of requests to a real engine (one
slot, two keys): why a request waited, what a named key and the Chat tab may read, no
content kept."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import httpx
import pytest

from backend.app.service import StudioService
from backend.keys.key_store import CHAT_NAME
from backend.llama.load import LoadSettings
from backend.admission.admission_ticket import WaitReason
from backend.port.access_log import ACCESS_LOGGER
from backend.port.request_log import RequestLog, RequestRecord, engine_figures
from tests.backend.service_harness import ServiceFactory

OWNER_KEY = "owner-key-0123456789abcdef"
#: Words no record may ever hold: they are the request's content.
SECRET_WORDS = "zebra quokka marzipan"  # letters only: a digit string can turn up inside a timing


# --- the ring -------------------------------------------------------------------------------

def test_the_ring_keeps_the_newest_and_hands_out_what_came_after_an_id():
    ring = RequestLog(3, clock=lambda: 1000.0)
    for n in range(5):
        ring.add(route="/v1/chat/completions", key="alice" if n % 2 else "bob",
                 output_tokens=n)
    assert [r.id for r in ring.records()] == [3, 4, 5] and ring.last_id == 5
    assert [r.id for r in ring.records(after=4)] == [5]
    assert [r.id for r in ring.records(limit=2)] == [4, 5]
    assert [r.id for r in ring.records(key="alice")] == [4]


def test_a_named_key_reads_its_records_without_the_shared_caches_figures():
    ring = RequestLog()
    ring.add(route="/v1/chat/completions", key="alice", prompt_tokens=900, cached_tokens=800,
             computed_tokens=100, prefill_ms=12.0, wait=2.0,
             wait_reason=WaitReason.FAIR_SHARE, waited_behind="bob")
    [own] = ring.records(key="alice")
    assert own.prompt_tokens == 900 and own.wait_reason == WaitReason.FAIR_SHARE
    assert (own.cached_tokens, own.computed_tokens, own.prefill_ms, own.waited_behind) == \
        (None, None, None, None)
    assert ring.records(key="bob") == []


def test_engine_figures_come_from_the_last_chunk_timings_or_the_usage():
    tail = (b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n'
            b'data: {"choices":[],"usage":{"prompt_tokens":30,"completion_tokens":5},'
            b'"timings":{"cache_n":20,"prompt_n":10,"prompt_ms":4.5,"predicted_n":5,'
            b'"predicted_per_second":250.0}}\n\ndata: [DONE]\n\n')
    figures = engine_figures(tail)
    assert (figures.prompt_tokens, figures.cached_tokens, figures.output_tokens,
            figures.prefill_ms, figures.tokens_per_second) == (30, 20, 5, 4.5, 250.0)
    body = b'{"usage":{"prompt_tokens":7,"completion_tokens":3,' \
           b'"prompt_tokens_details":{"cached_tokens":4}}}'
    assert (engine_figures(body).prompt_tokens, engine_figures(body).cached_tokens) == (7, 4)
    assert engine_figures(b"data: [DONE]\n\n").prompt_tokens is None


def test_an_anthropic_streams_figures_come_from_its_first_and_last_events():
    """llama-server names the prompt of a `/v1/messages` stream in `message_start` only
    (its cached part apart), and the output in the `message_delta` at the end."""
    stream = (b'event: message_start\ndata: {"type":"message_start","message":{"id":"m",'
              b'"type":"message","role":"assistant","content":[],"usage":'
              b'{"cache_read_input_tokens":62,"input_tokens":1,"output_tokens":0}}}\n\n'
              b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":'
              b'"max_tokens"},"usage":{"output_tokens":3}}\n\n')
    figures = engine_figures(stream)
    assert (figures.prompt_tokens, figures.cached_tokens, figures.output_tokens) == (63, 62, 3)


def test_a_record_survives_its_trip_as_json():
    record = RequestLog().add(route="/v1/messages", key="owner", slot=0, wait=0.5)
    assert RequestRecord.from_dict(json.loads(json.dumps(record.to_dict()))) == record


# --- against the real engine ------------------------------------------------------------------

@pytest.fixture
async def service(running_service: ServiceFactory, tiny_model: Path) -> StudioService:
    service = await running_service(keepalive_interval=0.1, queue_timeout=120, api_key=OWNER_KEY)
    await service.load(LoadSettings(parallel="1", ctx_size=8192).to_spec(str(tiny_model)))
    return service


def chat(max_tokens: int, **extra: object) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": f"Say {SECRET_WORDS}"}],
            "stream": True, "max_tokens": max_tokens, "ignore_eos": True, **extra}


async def read_stream(client: httpx.AsyncClient, key: str, body: dict,
                      headers: dict[str, str] | None = None) -> int:
    async with client.stream("POST", "/v1/chat/completions", json=body,
                             headers={"Authorization": f"Bearer {key}", **(headers or {})}
                             ) as response:
        assert response.status_code == 200, await response.aread()
        async for _ in response.aiter_bytes():
            pass
    return response.status_code


async def until(condition, what: str, timeout: float = 60.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        assert loop.time() < deadline, f"never: {what}"
        await asyncio.sleep(0.01)


async def requests_seen(client: httpx.AsyncClient, key: str) -> list[dict]:
    answer = await client.get("/requests", headers={"Authorization": f"Bearer {key}"})
    assert answer.status_code == 200, answer.text
    data: list[dict] = answer.json()["data"]
    return data


async def test_a_request_that_waited_behind_another_keys_request_names_that_keys_fair_share(service):
    """One slot.  The flood's first request runs, its second waits; the colleague's comes
    after it and goes first (its fair share).  The flood's second request's record says
    so, naming the colleague; nothing of what was asked is kept."""
    _, flood_key = service.keys.add("flood")
    _, colleague_key = service.keys.add("colleague")
    registry = service.registry
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{service.gateway_port}",
                                 timeout=120) as client:
        # Long enough (seconds) to hold the one slot while the others line up.
        long_one = asyncio.create_task(read_stream(client, flood_key, chat(8000)))
        await until(lambda: registry.total_active == 1, "the flood's first request runs")
        flood_second = asyncio.create_task(read_stream(
            client, flood_key, chat(8), {"x-session-id": "flood-agent-1"}))
        await until(lambda: registry.total_waiting == 1, "the flood's second request waits")
        colleague = asyncio.create_task(read_stream(client, colleague_key, chat(8)))
        await until(lambda: registry.total_waiting == 2, "the colleague's request waits")
        assert not long_one.done(), "the flood's first request ended before the others waited"
        long_one.cancel()  # the flood's first request leaves: its slot frees
        assert await colleague == 200 and await flood_second == 200
        with pytest.raises(asyncio.CancelledError):
            await long_one

        everything = await requests_seen(client, OWNER_KEY)
        flood_seen = await requests_seen(client, flood_key)
        colleague_seen = await requests_seen(client, colleague_key)
    assert len(everything) == 3, everything
    first, waited = [r for r in everything if r["key"] == "flood"]
    [theirs] = [r for r in everything if r["key"] == "colleague"]
    assert first["status"] == 499 and first["wait_reason"] is None
    assert first["longest_gap"] is not None and first["time_to_first_token"] > 0
    assert theirs["status"] == 200 and theirs["wait_reason"] == WaitReason.SLOTS_FULL
    assert waited["status"] == 200 and waited["error"] is None
    assert waited["wait_reason"] == WaitReason.FAIR_SHARE, waited
    assert waited["waited_behind"] == "colleague"
    assert waited["wait"] > theirs["wait"] > 0
    assert waited["session"] == "flood-agent-1"
    assert (waited["model"], waited["engine"], waited["slot"], waited["band"]) == \
        ("tiny", "this machine", 0, "normal")
    assert waited["output_tokens"] == 8 and waited["prompt_tokens"] > 0
    assert waited["cached_tokens"] is not None
    assert waited["computed_tokens"] == waited["prompt_tokens"] - waited["cached_tokens"]
    assert waited["time_to_first_token"] > 0 and waited["tokens_per_second"] > 0
    # No content: the words asked about are in no record, nor anything else of the body.
    text = json.dumps(everything)
    assert not any(word in text for word in SECRET_WORDS.split()), text
    assert "messages" not in text and "Say" not in text
    # A named key sees its own requests only, without the shared cache's figures.
    assert [r["id"] for r in flood_seen] == [first["id"], waited["id"]]
    assert all(r["cached_tokens"] is None and r["waited_behind"] is None for r in flood_seen)
    assert flood_seen[1]["wait_reason"] == WaitReason.FAIR_SHARE
    assert [r["id"] for r in colleague_seen] == [theirs["id"]]


async def test_a_key_at_its_own_concurrency_limit_is_told_so_not_that_the_slots_are_full(
        service):
    """One slot, a key that may run one request at once: its second request waits for
    its own limit (it would wait with a free slot too), and its keep-alives and its
    record say that, not "slots full" (which sends the owner after more slots)."""
    _, solo = service.keys.add("solo", max_concurrent=1)
    registry = service.registry
    comments: list[str] = []

    async def second() -> None:
        async with client.stream("POST", "/v1/chat/completions", json=chat(4),
                                 headers={"Authorization": f"Bearer {solo}"}) as response:
            assert response.status_code == 200, await response.aread()
            async for line in response.aiter_lines():
                if line.startswith(":"):
                    comments.append(line)

    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{service.gateway_port}",
                                 timeout=120) as client:
        first = asyncio.create_task(read_stream(client, solo, chat(8000)))
        await until(lambda: registry.total_active == 1, "the key's first request runs")
        waiting = asyncio.create_task(second())
        await until(lambda: registry.total_waiting == 1, "its second request waits")
        await until(lambda: len(comments) >= 2, "keep-alives while it waits")
        assert not first.done(), "the first request ended before the second waited"
        first.cancel()
        await waiting
        with pytest.raises(asyncio.CancelledError):
            await first
    await until(lambda: service.requests.last_id == 2, "both requests recorded")
    cut, waited = service.requests.records()
    assert cut.status == 499 and waited.status == 200
    assert waited.wait_reason == WaitReason.KEY_CONCURRENCY == "key_concurrency", waited
    assert waited.wait > 0
    assert ": keep-alive; waiting: key_concurrency" in comments, comments


async def test_a_stream_its_client_left_reads_499_stopped_by_the_client_everywhere(service, caplog):
    """The inspector's record, the access log and the request count say the same of a
    stream whose client went away mid-answer: 499, stopped by the client (the access log
    and the counts said 200, the status sent before it left); the log names its key and
    where it came from."""
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    _, alice = service.keys.add("alice")
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{service.gateway_port}",
                                 timeout=120) as client:
        stream = asyncio.create_task(read_stream(client, alice, chat(8000)))
        await until(lambda: service.registry.total_active == 1, "the stream runs")
        stream.cancel()
        with pytest.raises(asyncio.CancelledError):
            await stream
    await until(lambda: service.requests.last_id == 1, "the request recorded")
    [record] = service.requests.records()
    assert record.status == 499
    await until(lambda: " 499 " in caplog.text, "the access log's line")
    [line] = [r.getMessage() for r in caplog.records if r.name == ACCESS_LOGGER]
    assert line.startswith("POST /v1/chat/completions 499 (stopped by the client) ")
    assert line.endswith(" key alice from 127.0.0.1")
    assert service.metrics.registry.get_sample_value("gguf_studio_requests_total", {
        "route": "/v1/chat/completions", "status": "499", "model": "tiny",
        "engine": "this machine"}) == 1.0


async def test_the_chat_tabs_secret_reads_its_own_records_not_everyones(service):
    """The Chat tab's secret has the owner's rights on models, not on the inspector: were
    it to leak (it travels with every conversation), it shows no other key's requests."""
    _, alice = service.keys.add("alice")
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{service.gateway_port}",
                                 timeout=120) as client:
        for key in (alice, OWNER_KEY, service.chat_secret):
            await read_stream(client, key, chat(2))
        # Recorded once the port has settled each (maybe just after its last event).
        await until(lambda: service.requests.last_id == 3, "the three requests recorded")
        everything = await requests_seen(client, OWNER_KEY)
        chat_seen = await requests_seen(client, service.chat_secret)
    assert [r["key"] for r in everything] == ["alice", "owner", CHAT_NAME]
    assert [r["id"] for r in chat_seen] == [everything[2]["id"]]
    assert chat_seen[0]["waited_behind"] is None and chat_seen[0]["cached_tokens"] is None


async def test_a_refused_request_leaves_its_error_code(service):
    _, limited = service.keys.add("narrow", models=("other-*",))
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{service.gateway_port}",
                                 timeout=120) as client:
        answer = await client.post("/v1/chat/completions", json=chat(4),
                                   headers={"Authorization": f"Bearer {limited}"})
        assert answer.status_code == 403
        [record] = await requests_seen(client, OWNER_KEY)
        anonymous = await client.get("/requests")
    assert (record["key"], record["status"]) == ("narrow", 403)
    assert record["error"] == answer.json()["error"]["code"]
    assert anonymous.status_code == 401


async def test_a_streamed_claude_code_turns_record_says_what_the_cache_held(service):
    """Claude Code streams `/v1/messages`: its second turn's record names the prompt the
    client was told of, and the part of it the engine's cache held."""
    body = {"model": "tiny", "system": "You are a careful coding agent. " * 20,
            "messages": [{"role": "user", "content": f"Say {SECRET_WORDS}"}],
            "max_tokens": 3, "stream": True}
    told = []
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{service.gateway_port}",
                                 timeout=120) as client:
        for _ in range(2):
            async with client.stream("POST", "/v1/messages", json=body, headers={
                    "Authorization": f"Bearer {OWNER_KEY}",
                    "X-Claude-Code-Session-Id": "claude-1"}) as response:
                assert response.status_code == 200, await response.aread()
                async for line in response.aiter_lines():
                    if line.startswith("data:") and '"message_start"' in line:
                        told.append(json.loads(line[5:])["message"]["usage"])
        first, second = (await requests_seen(client, OWNER_KEY))[-2:]
    assert second["cached_tokens"] == told[1]["cache_read_input_tokens"] > 0
    assert second["prompt_tokens"] == told[1]["input_tokens"] + second["cached_tokens"]
    assert second["computed_tokens"] == told[1]["input_tokens"]
    assert first["prompt_tokens"] == second["prompt_tokens"]
