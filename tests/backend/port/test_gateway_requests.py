"""What the port answers to bad, capped and open requests: every 4xx, the output cap,
/v1/models, /health, /metrics and the access log (against the fake llama-server)."""

from __future__ import annotations

import asyncio
import json
import logging
import re
from typing import AsyncIterator

import pytest

from backend.llama.load import Snapshot
from tests.backend.gateway_harness import (
    CHAT, KEY, RESPONSES, assert_clean_error, cancel, chat, holding, stream, until)
from tests.fake_upstream import MODEL_PATH


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
    gw.guard.free_failures = 100  # the throttle of repeated failures has its own test
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
    def broken(path: str, requested: object) -> str:
        raise RuntimeError(f"boom in {MODEL_PATH}")

    gw.ctx.route = broken
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
        # the engine obeys max_completion_tokens here: 3, which every field now says
        (CHAT, chat(max_tokens=100, max_completion_tokens=3), {"max_tokens": 3, "max_completion_tokens": 3}),
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
    card = {"id": "fake-model", "object": "model", "owned_by": "gguf-studio",
            "context_length": 4096, "max_output_tokens": 4096,
            "state": "ready", "created": models["data"][0]["created"]}
    assert models["data"] == [card, dict(card, id="default", alias_of="fake-model")]
    gw.configure(max_output_tokens=1000)
    assert (await gw.client.get("/v1/models")).json()["data"][0]["max_output_tokens"] == 1000
    health = await gw.client.get("/health")
    assert health.status_code == 200
    assert health.json() == {"state": "ready", "model": "fake-model",
                             "effective_parallel_slots": 2, "active": 0, "waiting": 0, "kv": None,
                             "speed": None,  # not measured: an engine we did not start
                             "degraded": False, "engines_out": [],
                             "engine": None,  # a llama-server we did not start: no load report
                             "models": [{"id": "fake-model", "state": "ready", "default": True,
                                         "context_length": 4096,
                                         "requests": {"answered": 0, "refused": 0,
                                                      "cancelled": 0, "waiting": 0}}],
                             "upstreams": []}
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
    await gw.client.post(CHAT, content=b"{", headers={"content-type": "application/json"})
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
    # The holders and the waiter got their 200 headers, then left before their answers'
    # ends: 499, as the access log and the Requests tab say.
    assert gw.requests(CHAT, 200) == 4
    assert gw.requests(CHAT, 499) == 2 + 1
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
    assert re.fullmatch(r"POST /v1/chat/completions 200 [0-9.]+ms key anonymous from 127\.0\.0\.1",
                        lines[0]), lines[0]
    assert lines[1].startswith("GET /slots 404 ")
    assert not any("do-not-log" in line for line in lines)
