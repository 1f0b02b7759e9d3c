"""The OpenAI-compatible port, against a fake llama-server with exact timings and faults.

Every row of the overload contract (DESIGN.md, issue 3) has a test here.  No sleep is
used as synchronisation: tests wait for observable state (registry counts, what the fake
upstream saw) with `until`, which polls a condition under a timeout.

`open_gateway(base_url, slots)` is the harness: it takes any backend base URL, so the
same tests can be pointed at a real llama-server.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from dataclasses import dataclass, replace
from typing import Any, AsyncIterator, Callable

import httpx
import openai
import pytest

from backend.admission import AdmissionRegistry
from backend.errors import SettingsError
from backend.gateway import GatewayServer, create_app
from backend.gateway_errors import scrub
from backend.metrics import Metrics
from backend.settings import Settings
from backend.sse import EventFramer, ResponsesRewriter
from backend.supervisor import Snapshot, State
from tests.fake_upstream import MODEL_PATH, FakeUpstream

CHAT = "/v1/chat/completions"
RESPONSES = "/v1/responses"
KEY = "sk-test-key"


# --- harness -------------------------------------------------------------------------


class Context:
    """A GatewayContext whose snapshot the test controls."""

    def __init__(self, settings: Settings, snapshot: Snapshot) -> None:
        self.settings = settings
        self.registry = AdmissionRegistry(
            max_waiting_for=lambda slots: self.settings.effective_max_queue(slots))
        self.metrics = Metrics()
        self.metrics.bind_registry(self.registry)
        self._snapshot = snapshot
        self.metrics.set_backend(snapshot)

    def snapshot(self) -> Snapshot:
        return self._snapshot

    def set_snapshot(self, snapshot: Snapshot) -> None:
        self._snapshot = snapshot
        self.metrics.set_backend(snapshot)


@dataclass
class Gateway:
    ctx: Context
    server: GatewayServer
    client: httpx.AsyncClient
    url: str
    upstream_url: str

    @property
    def registry(self) -> AdmissionRegistry:
        return self.ctx.registry

    @property
    def metrics(self) -> Metrics:
        return self.ctx.metrics

    def configure(self, **changes: Any) -> None:
        """Change settings live: the gateway reads them on every request."""
        self.ctx.settings = self.ctx.settings.replace(**changes)

    def rejections(self, reason: str) -> float:
        return self.metrics.value("gguf_studio_rejections_total", {"reason": reason})

    def requests(self, route: str, status: int) -> float:
        return self.metrics.value("gguf_studio_requests_total", {"route": route, "status": str(status)})

    def cancellations(self, stage: str) -> float:
        return self.metrics.value("gguf_studio_cancellations_total", {"stage": stage})


@contextlib.asynccontextmanager
async def open_gateway(base_url: str, slots: int, *, model_id: str = "fake-model",
                       context_length: int = 4096, **settings: Any) -> AsyncIterator[Gateway]:
    """A gateway on 127.0.0.1:0 in front of the llama-server at `base_url`."""
    defaults = dict(keepalive_interval=0.05, queue_timeout=30.0)
    defaults.update(settings)
    snapshot = Snapshot(state=State.READY, model_id=model_id, base_url=base_url,
                        effective_parallel_slots=slots, context_length=context_length)
    ctx = Context(Settings(**defaults), snapshot)
    ctx.registry.activate(base_url, slots)
    server = await GatewayServer.start(create_app(ctx), "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.port}"
    client = httpx.AsyncClient(base_url=url, timeout=30.0, trust_env=False)
    try:
        yield Gateway(ctx, server, client, url, base_url)
    finally:
        await client.aclose()
        await server.stop()


@pytest.fixture
async def fake() -> AsyncIterator[FakeUpstream]:
    async with FakeUpstream(slots=2, n_tokens=8) as upstream:
        yield upstream


@pytest.fixture
async def gw(fake: FakeUpstream) -> AsyncIterator[Gateway]:
    async with open_gateway(fake.base_url, fake.slots) as gateway:
        yield gateway


async def until(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    """Wait until `condition()` holds (polled), or fail after `timeout` seconds."""
    async def poll() -> None:
        while not condition():
            await asyncio.sleep(0.002)
    await asyncio.wait_for(poll(), timeout)


async def stream(client: httpx.AsyncClient, path: str, body: dict[str, Any],
                 **kwargs: Any) -> tuple[httpx.Response, bytes]:
    """POST and read the whole (streamed) answer."""
    async with client.stream("POST", path, json=body, **kwargs) as response:
        raw = b"".join([chunk async for chunk in response.aiter_raw()])
    return response, raw


def events(raw: bytes) -> list[dict[str, Any]]:
    """SSE blocks as {"event", "data" (parsed JSON, "[DONE]" or None), "comment"}."""
    out = []
    for block in raw.decode().split("\n\n"):
        if not block.strip():
            continue
        event: dict[str, Any] = {"event": None, "data": None, "comment": None}
        for line in block.split("\n"):
            if line.startswith(":"):
                event["comment"] = line[1:].strip()
            elif line.startswith("event:"):
                event["event"] = line[6:].strip()
            elif line.startswith("data:"):
                data = line[5:].strip()
                event["data"] = data if data == "[DONE]" else json.loads(data)
        out.append(event)
    return out


def chat(stream_: bool = False, **fields: Any) -> dict[str, Any]:
    return {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}],
            "stream": stream_, **fields}


def assert_clean_error(response: httpx.Response, status: int, code: str,
                       gw: Gateway | None = None) -> dict[str, Any]:
    """An OpenAI-style error body with a string code and nothing internal in it."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert {"message", "type", "code", "param"} <= set(error)
    assert error["code"] == code and isinstance(error["code"], str)
    assert_no_internals(response.text, gw)
    return error


def assert_no_internals(text: str, gw: Gateway | None = None) -> None:
    for needle in ("127.0.0.1", "Traceback", "/srv/", "/home/", "/tmp/", "/usr/", "/work/",
                   "secret-dir", ".py", "http://"):
        assert needle not in text, f"{needle!r} leaked in {text!r}"
    if gw is not None:
        for url in (gw.url, gw.upstream_url):
            port = url.rsplit(":", 1)[1]
            assert port not in text, f"port {port} leaked in {text!r}"


@contextlib.asynccontextmanager
async def holding(gw: Gateway, n: int = 1, **fake: Any) -> AsyncIterator[list[asyncio.Task]]:
    """`n` streams that occupy slots until the block ends (they hang upstream)."""
    before = gw.registry.total_active
    tasks = [asyncio.create_task(stream(gw.client, CHAT, chat(True, fake={"hang": True, **fake})))
             for _ in range(n)]
    await until(lambda: gw.registry.total_active == before + n)
    try:
        yield tasks
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await until(lambda: gw.registry.total_active == before)


async def cancel(*tasks: asyncio.Task) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


# --- N+1 streams: one waits, hears keep-alives, completes ------------------------------


async def test_n_plus_one_chat_streams_exactly_one_waits_with_keepalive_comments(gw, fake):
    body = chat(True, fake={"delay": 0.05, "n_tokens": 10})
    tasks = [asyncio.create_task(stream(gw.client, CHAT, body)) for _ in range(fake.slots + 1)]
    await until(lambda: gw.registry.current.active == fake.slots and gw.registry.current.waiting == 1)
    results = await asyncio.wait_for(asyncio.gather(*tasks), 10)

    waited = [raw for _, raw in results if b": keep-alive" in raw]
    assert len(waited) == 1
    for response, raw in results:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        parsed = events(raw)
        assert parsed[-1]["data"] == "[DONE]"
        finals = [e["data"]["choices"][0]["finish_reason"] for e in parsed
                  if isinstance(e["data"], dict) and e["data"]["choices"][0]["finish_reason"]]
        assert finals == ["stop"]
        assert sum(1 for e in parsed if isinstance(e["data"], dict)) == 1 + 10 + 1
    parsed = events(waited[0])
    first_data = next(i for i, e in enumerate(parsed) if e["data"] is not None)
    assert first_data >= 1 and all(e["comment"] == "keep-alive" for e in parsed[:first_data])
    assert not any(e["comment"] for e in parsed[first_data:])
    assert gw.registry.total_active == 0 and gw.registry.total_waiting == 0
    assert gw.metrics.value("gguf_studio_queue_wait_seconds_count") == fake.slots + 1


async def test_n_plus_one_responses_streams_keep_one_response_id_throughout(gw, fake):
    body = {"model": "fake-model", "input": "hi", "stream": True,
            "fake": {"delay": 0.05, "n_tokens": 10}}
    tasks = [asyncio.create_task(stream(gw.client, RESPONSES, body)) for _ in range(fake.slots + 1)]
    await until(lambda: gw.registry.current.active == fake.slots and gw.registry.current.waiting == 1)
    results = await asyncio.wait_for(asyncio.gather(*tasks), 10)

    waited = [raw for _, raw in results if b"resp_upstream" not in raw]
    assert len(waited) == 1, "exactly one stream waited and had its id rewritten"
    parsed = events(waited[0])
    assert not any(e["comment"] for e in parsed), "Codex ignores comments: events only"
    types = [e["data"]["type"] for e in parsed]
    assert types[0] == "response.created"
    first_upstream = types.index("response.output_item.added")
    assert types[1:first_upstream].count("response.in_progress") >= 2
    assert types.count("response.created") == 1
    assert types[-2:] == ["response.output_item.done", "response.completed"]
    ours = parsed[0]["data"]["response"]["id"]
    assert ours.startswith("resp_")
    ids = {e["data"]["response"]["id"] for e in parsed if "response" in e["data"]}
    assert ids == {ours}
    assert parsed[-1]["data"]["response"]["status"] == "completed"
    assert parsed[-1]["data"]["response"]["output"][0]["content"][0]["text"].startswith("tok0 ")
    for response, raw in results:
        assert response.status_code == 200
        ids = {e["data"]["response"]["id"] for e in events(raw) if "response" in e["data"]}
        assert len(ids) == 1


async def test_a_stream_admitted_at_once_is_relayed_unchanged(gw, fake):
    response, raw = await stream(gw.client, RESPONSES, {"input": "hi", "stream": True})
    async with httpx.AsyncClient(base_url=fake.base_url, trust_env=False) as direct_client:
        _, direct_raw = await stream(direct_client, RESPONSES, {"input": "hi", "stream": True})
    assert response.status_code == 200
    shape = [(e["event"], e["data"]["type"]) for e in events(raw)]
    assert shape == [(e["event"], e["data"]["type"]) for e in events(direct_raw)]
    assert b"resp_upstream" in raw


async def test_a_silent_engine_reading_a_long_prompt_gets_keepalives_too(gw, fake):
    """Admitted at once, but llama-server sends nothing until it has read the prompt."""
    body = chat(True, fake={"prompt_delay": 0.4, "n_tokens": 3})
    response, raw = await stream(gw.client, CHAT, body)
    parsed = events(raw)
    first_data = next(i for i, e in enumerate(parsed) if e["data"] is not None)
    assert first_data >= 2 and all(e["comment"] == "keep-alive" for e in parsed[:first_data])
    assert parsed[-1]["data"] == "[DONE]"


async def test_a_silent_engine_on_the_responses_wire_gets_our_created_event_and_one_id(gw, fake):
    body = {"model": "fake-model", "input": "hi", "stream": True,
            "fake": {"prompt_delay": 0.4, "n_tokens": 3}}
    response, raw = await stream(gw.client, RESPONSES, body)
    parsed = events(raw)
    assert not any(e["comment"] for e in parsed), "Codex ignores comments: events only"
    types = [e["data"]["type"] for e in parsed]
    assert types[0] == "response.created" and types.count("response.created") == 1
    assert types[1] == "response.in_progress"
    assert types[-1] == "response.completed"
    assert b"resp_upstream" not in raw
    assert len({e["data"]["response"]["id"] for e in parsed if "response" in e["data"]}) == 1


# --- refusals before any byte ------------------------------------------------------------


async def test_queue_full_gives_exact_429s_with_retry_after(gw, fake):
    gw.configure(max_queue=2)
    gw.registry.set_capacity(fake.slots)  # max_waiting is re-read from the settings
    async with holding(gw, fake.slots):
        waiters = [asyncio.create_task(stream(gw.client, CHAT, chat(True))) for _ in range(2)]
        await until(lambda: gw.registry.total_waiting == 2)
        before = gw.rejections("server_is_overloaded"), gw.requests(CHAT, 429)

        refused = await asyncio.gather(*[gw.client.post(CHAT, json=chat(stream_)) for stream_ in
                                         (False, True, False, True, False)])

        for response in refused:
            error = assert_clean_error(response, 429, "server_is_overloaded", gw)
            assert error["type"] == "server_error"
            assert int(response.headers["retry-after"]) >= 1
        assert gw.rejections("server_is_overloaded") - before[0] == 5
        assert gw.requests(CHAT, 429) - before[1] == 5
        assert gw.registry.total_waiting == 2
        await cancel(*waiters)
    await until(lambda: gw.registry.total_waiting == 0)


async def test_model_not_ready_is_503_with_retry_after(gw):
    ready = gw.ctx.snapshot()
    for snapshot in (replace(ready, state=State.STARTING),
                     replace(ready, state=State.STARTING, restarting=True),
                     Snapshot()):
        gw.ctx.set_snapshot(snapshot)
        for path, body in ((CHAT, chat()), (RESPONSES, {"input": "x", "stream": True}),
                           ("/v1/embeddings", {"input": "x"})):
            response = await gw.client.post(path, json=body)
            assert_clean_error(response, 503, "model_not_ready", gw)
            assert int(response.headers["retry-after"]) >= 1
    assert gw.rejections("model_not_ready") == 9

    gw.ctx.set_snapshot(ready)
    gw.registry.retire_current()  # a reload under way: no current queue
    response = await gw.client.post(CHAT, json=chat())
    assert_clean_error(response, 503, "model_not_ready", gw)
    assert "retry-after" in response.headers


async def test_queue_timeout_before_any_byte_is_503(gw, fake):
    gw.configure(queue_timeout=0.2)
    async with holding(gw, fake.slots):
        response = await gw.client.post(CHAT, json=chat())
        assert_clean_error(response, 503, "queue_timeout", gw)
        assert int(response.headers["retry-after"]) >= 1
        assert gw.registry.total_waiting == 0
    assert gw.rejections("queue_timeout") == 1


# --- refusals inside a stream ------------------------------------------------------------


@pytest.mark.parametrize("path", [CHAT, "/v1/completions", "/v1/messages"])
async def test_queue_timeout_after_keepalives_is_a_final_in_stream_error(gw, fake, path):
    gw.configure(queue_timeout=0.3)
    body = {"prompt": "x", "stream": True} if path == "/v1/completions" else chat(True)
    async with holding(gw, fake.slots):
        response, raw = await asyncio.wait_for(stream(gw.client, path, body), 5)
    assert response.status_code == 200
    parsed = events(raw)
    assert parsed[0]["comment"] == "keep-alive" and parsed[-2]["comment"] is None
    error = parsed[-2]["data"]["error"]
    assert error["code"] == "queue_timeout" and error["type"] == "server_error"
    assert error["message"] and "param" in error
    if path == "/v1/messages":
        assert parsed[-2]["event"] == "error" and parsed[-2]["data"]["type"] == "error"
    assert parsed[-1]["data"] == "[DONE]", "the client must see the stream as finished"
    assert_no_internals(raw.decode(), gw)
    assert gw.rejections("queue_timeout") == 1
    assert gw.registry.total_waiting == 0


async def test_responses_queue_timeout_after_keepalives_is_response_failed(gw, fake):
    gw.configure(queue_timeout=0.3)
    async with holding(gw, fake.slots):
        response, raw = await asyncio.wait_for(
            stream(gw.client, RESPONSES, {"input": "x", "stream": True}), 5)
    parsed = events(raw)
    assert [e["event"] for e in parsed][0] == "response.created"
    assert {e["event"] for e in parsed[1:-1]} == {"response.in_progress"}
    failed = parsed[-1]
    assert failed["event"] == "response.failed" and failed["data"]["type"] == "response.failed"
    assert failed["data"]["response"]["id"] == parsed[0]["data"]["response"]["id"]
    assert failed["data"]["response"]["status"] == "failed"
    assert failed["data"]["response"]["error"]["code"] == "queue_timeout"
    assert isinstance(failed["data"]["response"]["error"]["message"], str)
    assert gw.rejections("queue_timeout") == 1


async def test_upstream_error_after_keepalives_ends_the_stream_with_its_message(gw, fake):
    body = chat(True, fake={"status": 400, "error_type": "exceed_context_size_error",
                            "message": f"request exceeds the context; model {MODEL_PATH}"})
    async with holding(gw, fake.slots) as holders:
        async with gw.client.stream("POST", CHAT, json=body) as response:
            chunks = response.aiter_raw()
            raw = await chunks.__anext__()
            assert raw == b": keep-alive\n\n"
            await cancel(holders[0])  # a slot frees: the waiter goes upstream
            raw += b"".join([chunk async for chunk in chunks])
    parsed = events(raw)
    assert parsed[-2]["data"]["error"]["code"] == "context_length_exceeded"
    assert "exceeds the context" in parsed[-2]["data"]["error"]["message"]
    assert parsed[-1]["data"] == "[DONE]"
    assert_no_internals(raw.decode(), gw)
    assert gw.rejections("context_length_exceeded") == 0, "llama-server's answer, not ours"


# --- clients that go away ------------------------------------------------------------------


async def test_disconnect_while_queued_leaves_the_line_at_once(gw, fake):
    async with holding(gw, fake.slots):
        streamed = asyncio.create_task(stream(gw.client, CHAT, chat(True)))
        plain = asyncio.create_task(gw.client.post(CHAT, json=chat()))
        responses = asyncio.create_task(stream(gw.client, RESPONSES, {"input": "x", "stream": True}))
        await until(lambda: gw.registry.total_waiting == 3)
        await cancel(streamed, plain, responses)
        await until(lambda: gw.registry.total_waiting == 0, timeout=1.0)
        await until(lambda: gw.cancellations("queued") == 3, timeout=1.0)
        assert gw.registry.total_active == fake.slots
        assert len(fake.requests) == fake.slots, "nothing that left the line reached the engine"


@pytest.mark.parametrize("streamed", [True, False])
async def test_disconnect_while_running_closes_upstream_and_frees_the_slot(gw, fake, streamed):
    body = chat(streamed, fake={"delay": 0.05, "n_tokens": 1000} if streamed else {"hang": True})

    async def read_some() -> None:
        async with gw.client.stream("POST", CHAT, json=body) as response:
            async for _ in response.aiter_raw():
                break
            await asyncio.Event().wait()

    task = asyncio.create_task(read_some() if streamed else gw.client.post(CHAT, json=body))
    await until(lambda: fake.active == 1 and gw.registry.total_active == 1)
    await cancel(task)
    await until(lambda: fake.disconnects == 1, timeout=2.0)
    await until(lambda: gw.registry.total_active == 0, timeout=1.0)
    assert gw.cancellations("running") == 1 and gw.cancellations("queued") == 0
    assert fake.completed == 0


# --- the engine fails ---------------------------------------------------------------------


async def test_upstream_dying_mid_stream_gives_a_final_error_event(gw, fake):
    response, raw = await asyncio.wait_for(
        stream(gw.client, CHAT, chat(True, fake={"die_after": 3})), 5)
    assert response.status_code == 200
    parsed = events(raw)
    assert [e["data"]["choices"][0]["delta"] for e in parsed[:3]] == [
        {"role": "assistant", "content": None}, {"content": "tok0 "}, {"content": "tok1 "}]
    assert parsed[3]["data"]["error"]["code"] == "upstream_failed"
    assert parsed[4:] == [{"event": None, "data": "[DONE]", "comment": None}]
    assert_no_internals(raw.decode(), gw)
    assert gw.registry.total_active == 0
    assert gw.rejections("upstream_failed") == 1


async def test_upstream_dying_mid_responses_stream_fails_the_response_it_started(gw, fake):
    _, raw = await asyncio.wait_for(
        stream(gw.client, RESPONSES, {"input": "x", "stream": True, "fake": {"die_after": 2}}), 5)
    parsed = events(raw)
    started = parsed[0]["data"]["response"]["id"]
    assert parsed[-1]["event"] == "response.failed"
    assert parsed[-1]["data"]["response"]["id"] == started
    assert parsed[-1]["data"]["response"]["error"]["code"] == "upstream_failed"


async def test_upstream_dying_after_a_reload_says_the_model_was_reloaded(gw, fake):
    body = chat(True, fake={"delay": 0.05, "n_tokens": 20, "die_after": 5})
    async with gw.client.stream("POST", CHAT, json=body) as response:
        chunks = response.aiter_raw()
        first = await chunks.__anext__()
        gw.registry.activate("http://127.0.0.1:9", 1)  # a new load took over meanwhile
        raw = first + b"".join([chunk async for chunk in chunks])
    parsed = events(raw)
    assert parsed[-2]["data"]["error"]["code"] == "model_reloaded"
    assert parsed[-1]["data"] == "[DONE]"
    await until(lambda: gw.registry.queue_for(fake.base_url) is None)  # drained, pruned


async def test_upstream_dying_before_a_non_streamed_answer_is_502(gw, fake):
    response = await gw.client.post(CHAT, json=chat(fake={"die_after": 1}))
    assert_clean_error(response, 502, "upstream_failed", gw)


async def test_unreachable_upstream_is_a_clean_502():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{probe.getsockname()[1]}"
    async with open_gateway(dead, 1) as gw:
        for body in (chat(), chat(True)):
            response = await gw.client.post(CHAT, json=body)
            assert_clean_error(response, 502, "upstream_unavailable", gw)
        assert gw.registry.total_active == 0
        assert gw.rejections("upstream_unavailable") == 2


async def test_upstream_error_answers_pass_through_without_internals(gw, fake):
    leaky = f"failed to open {MODEL_PATH} (listening on 127.0.0.1:{fake.port}, http://127.0.0.1:{fake.port}/slots)"
    response = await gw.client.post(CHAT, json=chat(fake={"status": 500, "message": leaky}))
    error = assert_clean_error(response, 500, "server_error", gw)
    assert error["message"].startswith("failed to open")

    context = chat(True, fake={"status": 400, "error_type": "exceed_context_size_error",
                               "message": "request (9000 tokens) exceeds the available context size (4096 tokens)"})
    response = await gw.client.post(CHAT, json=context)
    error = assert_clean_error(response, 400, "context_length_exceeded", gw)
    assert error["type"] == "exceed_context_size_error"
    assert "exceeds the available context size" in error["message"]
    assert sum(gw.metrics.totals()["rejections"].values()) == 0


# --- every 4xx ---------------------------------------------------------------------------


BAD_BODIES = [
    (b"{not json", None),
    (b"[1, 2]", None),
    (b"\xff\xfe", None),
    (json.dumps({"messages": "hi"}).encode(), "messages"),
    (json.dumps({"model": "m"}).encode(), "messages"),
    (json.dumps({"messages": [], "stream": "yes"}).encode(), "stream"),
    (json.dumps({"messages": [], "max_tokens": 0}).encode(), "max_tokens"),
    (json.dumps({"messages": [], "max_tokens": "5"}).encode(), "max_tokens"),
    (json.dumps({"messages": [], "max_completion_tokens": True}).encode(), "max_completion_tokens"),
    (json.dumps({"messages": [], "model": 5}).encode(), "model"),
]


@pytest.mark.parametrize("raw,param", BAD_BODIES)
async def test_malformed_bodies_are_400_with_param(gw, fake, raw, param):
    response = await gw.client.post(CHAT, content=raw, headers={"content-type": "application/json"})
    error = assert_clean_error(response, 400, "invalid_request", gw)
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"
    assert fake.requests == []
    assert gw.rejections("invalid_request") == 1


async def test_responses_checks_its_own_limit_field(gw):
    response = await gw.client.post(RESPONSES, json={"input": "x", "max_output_tokens": -1})
    assert assert_clean_error(response, 400, "invalid_request", gw)["param"] == "max_output_tokens"


async def test_bodies_over_the_limit_are_413_by_header_and_by_count(gw, fake):
    gw.configure(max_body_bytes=1000)
    big = json.dumps(chat(padding="x" * 2000)).encode()
    response = await gw.client.post(CHAT, content=big, headers={"content-type": "application/json"})
    assert_clean_error(response, 413, "request_too_large", gw)

    async def chunked() -> AsyncIterator[bytes]:  # no Content-Length: counted as it comes
        for start in range(0, len(big), 300):
            yield big[start:start + 300]

    response = await gw.client.post(CHAT, content=chunked(), headers={"content-type": "application/json"})
    assert "content-length" not in response.request.headers
    assert_clean_error(response, 413, "request_too_large", gw)
    assert fake.requests == []
    assert gw.rejections("request_too_large") == 2

    small = json.dumps(chat()).encode()
    response = await gw.client.post(CHAT, content=small, headers={"content-type": "application/json"})
    assert response.status_code == 200


async def test_api_key_missing_or_wrong_is_401(gw, fake):
    gw.configure(api_key=KEY)
    for headers in ({}, {"authorization": "Bearer nope"}, {"x-api-key": "nope"},
                    {"authorization": KEY}, {"authorization": "Basic " + KEY}):
        for method, path in (("POST", CHAT), ("GET", "/v1/models"), ("GET", "/metrics")):
            response = await gw.client.request(method, path, json=chat(), headers=headers)
            error = assert_clean_error(response, 401, "invalid_api_key", gw)
            assert KEY not in response.text and "nope" not in error["message"]
    assert gw.rejections("invalid_api_key") == 15
    assert fake.requests == []

    for headers in ({"authorization": f"Bearer {KEY}"}, {"x-api-key": KEY}):
        assert (await gw.client.post(CHAT, json=chat(), headers=headers)).status_code == 200
        assert (await gw.client.get("/v1/models", headers=headers)).status_code == 200
    assert (await gw.client.get("/health")).status_code == 200, "/health stays open for probes"


@pytest.mark.parametrize("method,path", [
    ("GET", "/"), ("GET", "/slots"), ("GET", "/props"), ("POST", "/props"),
    ("POST", "/models/load"), ("GET", "/models"), ("POST", "/completion"), ("POST", "/tokenize"),
    ("GET", "/v1/slots"), ("POST", "/v1/chat/completions/"), ("GET", "/metrics/x"),
    ("POST", "/v1/rerank"), ("GET", "/../etc/passwd"),
])
async def test_unknown_paths_and_llama_server_endpoints_are_404(gw, fake, method, path):
    response = await gw.client.request(method, path, json={})
    assert_clean_error(response, 404, "not_found", gw)
    assert fake.requests == []
    assert gw.requests("other", 404) == 1


@pytest.mark.parametrize("method,path", [("GET", CHAT), ("PUT", RESPONSES), ("DELETE", "/v1/embeddings"),
                                         ("POST", "/v1/models"), ("POST", "/health")])
async def test_wrong_method_is_405(gw, method, path):
    response = await gw.client.request(method, path)
    assert_clean_error(response, 405, "method_not_allowed", gw)
    assert response.headers["allow"]


async def test_websocket_upgrade_on_responses_is_426(gw):
    headers = {"connection": "Upgrade", "upgrade": "websocket", "sec-websocket-version": "13",
               "sec-websocket-key": "dGhlIHNhbXBsZSBub25jZQ=="}
    response = await gw.client.get(RESPONSES, headers=headers)
    assert_clean_error(response, 426, "websocket_not_supported", gw)
    assert gw.rejections("websocket_not_supported") == 1


async def test_unexpected_errors_are_a_generic_500(gw, caplog):
    def broken() -> Snapshot:
        raise RuntimeError(f"boom in {MODEL_PATH}")

    gw.ctx.snapshot = broken
    with caplog.at_level(logging.ERROR, logger="gguf_studio.gateway"):
        response = await gw.client.post(CHAT, json=chat())
    error = assert_clean_error(response, 500, "internal_error", gw)
    assert "boom" not in response.text
    assert error["type"] == "server_error"
    assert any("boom" in str(r.exc_info[1]) for r in caplog.records if r.exc_info)


# --- the output cap ------------------------------------------------------------------------


async def test_output_cap_is_default_and_ceiling(gw, fake):
    gw.configure(max_output_tokens=5)
    cases = [
        (CHAT, chat(), {"max_tokens": 5}),
        (CHAT, chat(max_tokens=100), {"max_tokens": 5}),
        (CHAT, chat(max_completion_tokens=100), {"max_completion_tokens": 5}),
        (CHAT, chat(max_tokens=100, max_completion_tokens=3), {"max_tokens": 5, "max_completion_tokens": 3}),
        (CHAT, chat(max_tokens=3), {"max_tokens": 3}),
        (CHAT, chat(n_predict=-1), {"n_predict": 5}),
        ("/v1/completions", {"prompt": "x"}, {"max_tokens": 5}),
        (RESPONSES, {"input": "x"}, {"max_output_tokens": 5}),
        (RESPONSES, {"input": "x", "max_output_tokens": 64}, {"max_output_tokens": 5}),
        ("/v1/messages", chat(max_tokens=32000), {"max_tokens": 5}),
    ]
    for path, body, expected in cases:
        response = await gw.client.post(path, json=body)
        assert response.status_code == 200, response.text
        received = fake.received(path)[-1]
        assert {k: received.get(k) for k in expected} == expected, (body, received)
    reply = (await gw.client.post(CHAT, json=chat(max_tokens=100))).json()
    assert reply["choices"][0]["finish_reason"] == "length"
    assert reply["usage"]["completion_tokens"] == 5

    gw.configure(max_output_tokens=0)
    raw = b'{"messages": [],   "max_tokens": 100000}'
    await gw.client.post(CHAT, content=raw, headers={"content-type": "application/json"})
    assert fake.received(CHAT)[-1] == {"messages": [], "max_tokens": 100000}


# --- the open routes and the metrics --------------------------------------------------------


async def test_models_and_health(gw, fake):
    models = (await gw.client.get("/v1/models")).json()
    assert models["object"] == "list"
    assert models["data"] == [{"id": "fake-model", "object": "model", "owned_by": "gguf-studio",
                               "context_length": 4096, "created": models["data"][0]["created"]}]
    health = await gw.client.get("/health")
    assert health.status_code == 200
    assert health.json() == {"state": "ready", "model": "fake-model",
                             "effective_parallel_slots": 2, "active": 0, "waiting": 0}
    async with holding(gw, fake.slots):
        waiter = asyncio.create_task(stream(gw.client, CHAT, chat(True)))
        await until(lambda: gw.registry.total_waiting == 1)
        health = (await gw.client.get("/health")).json()
        assert (health["active"], health["waiting"]) == (2, 1)
        await cancel(waiter)

    gw.ctx.set_snapshot(Snapshot())
    assert (await gw.client.get("/v1/models")).json() == {"object": "list", "data": []}
    health = await gw.client.get("/health")
    assert health.status_code == 503 and health.json()["state"] == "stopped"


async def test_metrics_deltas_are_exact(gw, fake):
    async def scrape() -> str:
        response = await gw.client.get("/metrics")
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/plain")
        return response.text

    text = await scrape()
    assert "gguf_studio_effective_parallel_slots 2.0" in text
    assert "gguf_studio_requests_waiting 0.0" in text
    before = gw.metrics.totals()

    for _ in range(3):
        assert (await gw.client.post(CHAT, json=chat())).status_code == 200
    await stream(gw.client, CHAT, chat(True))
    await gw.client.get("/nope")
    await gw.client.post(CHAT, content=b"{")
    async with holding(gw, fake.slots):
        waiter = asyncio.create_task(stream(gw.client, CHAT, chat(True)))
        await until(lambda: gw.registry.total_waiting == 1)
        text = await scrape()
        assert "gguf_studio_requests_active 2.0" in text
        assert "gguf_studio_requests_waiting 1.0" in text
        await cancel(waiter)
    await until(lambda: gw.cancellations("queued") == 1)

    after = gw.metrics.totals()
    assert after["rejections"] == {"not_found": 1, "invalid_request": 1}
    assert after["cancellations"] == {"queued": 1, "running": 2}  # the two holders
    # The holders and the waiter got their 200 headers before they left.
    assert gw.requests(CHAT, 200) == 4 + 2 + 1
    assert gw.requests(CHAT, 400) == 1 and gw.requests("other", 404) == 1
    assert gw.requests("/metrics", 200) == 2
    assert after["requests"] - before["requests"] == 4 + 1 + 1 + 2 + 1 + 1
    assert gw.metrics.value("gguf_studio_queue_wait_seconds_count") == 4 + 2


async def test_access_log_has_one_line_per_request_without_bodies(gw, caplog):
    with caplog.at_level(logging.INFO, logger="gguf_studio.access"):
        await gw.client.post(CHAT, json=chat(secret="do-not-log"))
        await gw.client.get("/slots")
        await until(lambda: len([r for r in caplog.records if r.name == "gguf_studio.access"]) >= 2)
    lines = [r.getMessage() for r in caplog.records if r.name == "gguf_studio.access"]
    assert len(lines) == 2
    assert lines[0].startswith("POST /v1/chat/completions 200 ") and lines[0].endswith("ms")
    assert lines[1].startswith("GET /slots 404 ")
    assert not any("do-not-log" in line for line in lines)


# --- the server -------------------------------------------------------------------------------


async def test_a_taken_port_is_a_clear_settings_error(gw):
    with pytest.raises(SettingsError, match="already in use"):
        await GatewayServer.start(create_app(gw.ctx), "127.0.0.1", gw.server.port)


async def test_stop_ends_running_streams_cleanly(fake):
    async with open_gateway(fake.base_url, fake.slots) as gw:
        task = asyncio.create_task(stream(gw.client, CHAT, chat(True, fake={"hang": True})))
        await until(lambda: gw.registry.total_active == 1)
        await asyncio.wait_for(gw.server.stop(grace=0.1), 5)
        response, raw = await asyncio.wait_for(task, 5)
    assert response.status_code == 200
    parsed = events(raw)
    assert parsed[-2]["data"]["error"]["code"] == "model_not_ready"
    assert parsed[-1]["data"] == "[DONE]"
    assert gw.registry.total_active == 0


# --- the OpenAI Python SDK -----------------------------------------------------------------------


def sdk(gw: Gateway, **kwargs: Any) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=KEY, **kwargs)


async def test_openai_sdk_chat_streamed_chat_responses_streamed_responses(gw, fake):
    gw.configure(api_key=KEY)
    gw.client.headers["authorization"] = f"Bearer {KEY}"  # for the slot holders
    async with sdk(gw, max_retries=0) as client:
        reply = await client.chat.completions.create(
            model="fake-model", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert reply.choices[0].message.content == "tok0 tok1 tok2 tok3 "
        assert reply.choices[0].finish_reason == "length"

        text, finish = "", None
        async for chunk in await client.chat.completions.create(
                model="fake-model", messages=[{"role": "user", "content": "hi"}], stream=True):
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
        assert text.startswith("tok0 ") and finish == "stop"

        response = await client.responses.create(model="fake-model", input="hi")
        assert response.output[0].content[0].text.startswith("tok0 ")

        # Streamed, and made to wait first: the SDK sees the gateway's events, one id.
        async with holding(gw, fake.slots):
            task = asyncio.create_task(_collect_responses(client))
            await until(lambda: gw.registry.total_waiting == 1)
        kinds, ids, final = await asyncio.wait_for(task, 5)
        assert kinds[0] == "response.created" and "response.in_progress" in kinds
        assert kinds[-2:] == ["response.output_item.done", "response.completed"]
        assert len(ids) == 1 and final.output[0].content[0].text.startswith("tok0 ")

        models = await client.models.list()
        assert [m.id for m in models.data] == ["fake-model"]


async def _collect_responses(client: openai.AsyncOpenAI) -> tuple[list[str], set[str], Any]:
    kinds: list[str] = []
    ids: set[str] = set()
    final = None
    async for event in await client.responses.create(model="fake-model", input="hi", stream=True):
        kinds.append(event.type)
        if getattr(event, "response", None) is not None:
            ids.add(event.response.id)
            final = event.response
    return kinds, ids, final


async def test_openai_sdk_sees_an_in_stream_error_as_an_error(gw):
    async with sdk(gw, max_retries=0) as client:
        with pytest.raises(openai.APIError, match="stopped while answering"):
            async for _ in await client.chat.completions.create(
                    model="fake-model", messages=[{"role": "user", "content": "hi"}], stream=True,
                    extra_body={"fake": {"die_after": 2}}):
                pass


async def test_openai_sdk_retries_a_429_after_retry_after_and_succeeds(gw, fake):
    gw.configure(max_queue=1)
    gw.registry.set_capacity(1)  # one slot, one place in line
    assert (await gw.client.post(CHAT, json=chat())).status_code == 200  # learn a short service time
    busy = chat(True, fake={"delay": 0.05, "n_tokens": 6})
    holder = asyncio.create_task(stream(gw.client, CHAT, busy))
    await until(lambda: gw.registry.total_active == 1)
    waiter = asyncio.create_task(stream(gw.client, CHAT, busy))
    await until(lambda: gw.registry.total_waiting == 1)

    first = await gw.client.post(CHAT, json=chat())
    assert first.status_code == 429 and first.headers["retry-after"] == "1"
    async with sdk(gw, max_retries=2) as client:
        reply = await asyncio.wait_for(client.chat.completions.create(
            model="fake-model", messages=[{"role": "user", "content": "hi"}]), 10)
    assert reply.choices[0].message.content.startswith("tok0 ")
    assert gw.rejections("server_is_overloaded") == 2, "our probe and the SDK's first try"
    await asyncio.gather(holder, waiter)


# --- the relay's byte handling, chunk by chunk ----------------------------------------------


def relay_through(chunks: list[bytes], our_id: str | None) -> tuple[list[bytes], ResponsesRewriter]:
    framer, rewriter = EventFramer(), ResponsesRewriter(our_id)
    sent = [rewriter.feed(framer.feed(chunk)) for chunk in chunks]
    sent.append(rewriter.feed(framer.flush()) + rewriter.flush())
    return sent, rewriter


UPSTREAM_HEAD = (b'event: response.created\ndata: {"type":"response.created","response":'
                 b'{"id":"resp_up1","object":"response","status":"in_progress"}}\n\n')
UPSTREAM_BODY = (b'event: response.in_progress\ndata: {"type":"response.in_progress","response":'
                 b'{"id":"resp_up1"}}\n\nevent: response.completed\ndata: {"type":"response.completed",'
                 b'"response":{"id":"resp_up1","status":"completed"}}\n\n')


@pytest.mark.parametrize("cut", [1, 7, 30, len(UPSTREAM_HEAD) - 1, len(UPSTREAM_HEAD) + 40,
                                 len(UPSTREAM_HEAD) + 75])
def test_the_upstream_id_is_replaced_wherever_the_chunks_are_cut(cut):
    stream_ = b": ping\n\n" + UPSTREAM_HEAD + UPSTREAM_BODY
    sent, rewriter = relay_through([stream_[:cut], stream_[cut:]], "resp_ours")
    out = b"".join(sent)
    assert rewriter.upstream_id == "resp_up1" and rewriter.client_id == "resp_ours"
    assert b"resp_up1" not in out and b"response.created" not in out
    assert out.startswith(b": ping\n\n")
    assert out.count(b'"id":"resp_ours"') == 2
    assert all(not chunk or chunk.endswith(b"\n\n") for chunk in sent), "whole events only"


def test_a_stream_nobody_waited_for_keeps_the_upstream_id():
    sent, rewriter = relay_through([UPSTREAM_HEAD + UPSTREAM_BODY], None)
    assert b"".join(sent) == UPSTREAM_HEAD + UPSTREAM_BODY
    assert rewriter.client_id == "resp_up1"


def test_a_stream_that_does_not_start_with_response_created_is_passed_on():
    error = b'data: {"error":{"code":500,"message":"x"}}\n\n'
    sent, rewriter = relay_through([error, UPSTREAM_BODY], "resp_ours")
    assert b"".join(sent) == error + UPSTREAM_BODY
    assert rewriter.client_id == "resp_ours"


def test_the_framer_holds_partial_events_and_understands_crlf():
    framer = EventFramer()
    assert framer.feed(b"data: 1\n\ndata: 2") == b"data: 1\n\n"
    assert framer.feed(b"2\n") == b""
    assert framer.feed(b"\ndata: 3\r\n\r\n") == b"data: 22\n\ndata: 3\r\n\r\n"
    assert framer.feed(b"data: half") == b""
    framer.drop()  # the upstream died: the half event is never sent
    assert framer.flush() == b""
    big = b"x" * (EventFramer.LIMIT + 1)
    assert framer.feed(big) == big, "not SSE at all: let it through rather than hoard it"


def test_scrub_removes_internals_but_keeps_the_sentence():
    text = ("cannot open /home/ann/models/llama 3.gguf or C:\\Users\\ann\\m.gguf via "
            "http://127.0.0.1:8080/slots at 10.0.0.5:8080, [::1]:9000 and localhost:1234")
    cleaned = scrub(text)
    for needle in ("/home", "C:\\", "127.0.0.1", "10.0.0.5", "8080", "9000", "1234", "http"):
        assert needle not in cleaned
    assert cleaned.startswith("cannot open")
    assert scrub("request (9000 tokens) exceeds the available context size (4096 tokens)") == \
        "request (9000 tokens) exceeds the available context size (4096 tokens)"
