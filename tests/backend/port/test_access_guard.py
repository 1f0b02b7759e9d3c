"""What a web page can and cannot do with the port, and the throttle of wrong keys.

Real sockets: the gateway harness's port, with the fake llama-server behind it (what
the engine would answer does not matter here: every refusal happens before it)."""

from __future__ import annotations

import asyncio
import json
import subprocess

import httpx
import openai
import pytest

from backend.port.access_guard import FORGET_FAILURES_AFTER, FREE_FAILURES
from tests.backend.gateway_harness import CHAT, KEY, assert_clean_error, chat

EVIL = "https://evil.example"


# --- Host: DNS rebinding ------------------------------------------------------------------


async def test_a_rebinding_host_name_is_refused_without_a_key(gw, fake):
    port = gw.url.rsplit(":", 1)[1]
    rebound = {"host": f"attacker.example:{port}"}
    response = await gw.client.post(CHAT, json=chat(), headers=rebound)
    assert_clean_error(response, 403, "host_not_allowed", gw)
    for path in ("/metrics", "/v1/models", "/health"):  # nothing to read either
        assert_clean_error(await gw.client.get(path, headers=rebound), 403, "host_not_allowed", gw)
    assert fake.requests == []
    assert gw.rejections("host_not_allowed") == 4

    for own in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "LOCALHOST"):
        response = await gw.client.post(CHAT, json=chat(), headers={"host": own})
        assert response.status_code == 200, (own, response.text)


async def test_a_host_name_the_user_allowed_is_served(gw):
    gw.configure(allow_hosts=["studio.lan"])
    assert (await gw.client.post(CHAT, json=chat(), headers={"host": "studio.lan:8899"})).status_code == 200
    response = await gw.client.post(CHAT, json=chat(), headers={"host": "other.lan"})
    assert_clean_error(response, 403, "host_not_allowed", gw)


async def test_with_a_key_any_host_name_may_be_used(gw):
    """A key is what a rebinding page lacks; LAN clients may reach the port by any name."""
    gw.configure(api_key=KEY)
    response = await gw.client.post(CHAT, json=chat(), headers={
        "host": "gpu-box.example", "authorization": f"Bearer {KEY}"})
    assert response.status_code == 200


async def test_with_a_key_a_rebinding_page_still_cannot_read_health(gw):
    """/health answers without the key (for probes), so the key does not guard it: a
    rebound page would read the model's and the devices' names there."""
    gw.configure(api_key=KEY)
    port = gw.url.rsplit(":", 1)[1]
    response = await gw.client.get("/health", headers={"host": f"attacker.example:{port}"})
    assert_clean_error(response, 403, "host_not_allowed", gw)
    assert "fake-model" not in response.text
    assert (await gw.client.get("/health", headers={"host": f"localhost:{port}"})).status_code == 200
    gw.configure(allow_hosts=["gpu-box.example"])  # a name the user allowed: probes work
    assert (await gw.client.get("/health", headers={"host": "gpu-box.example"})).status_code == 200


# --- Origin and CORS ---------------------------------------------------------------------------


async def test_a_foreign_web_page_is_refused(gw, fake):
    for headers in ({"origin": EVIL}, {"origin": "null"}):
        response = await gw.client.post(CHAT, json=chat(), headers=headers)
        assert_clean_error(response, 403, "origin_not_allowed", gw)
        assert "access-control-allow-origin" not in response.headers
    preflight = await gw.client.options(CHAT, headers={
        "origin": EVIL, "access-control-request-method": "POST"})
    assert_clean_error(preflight, 403, "origin_not_allowed", gw)
    gw.configure(api_key=KEY)  # also with a key: the page would need it in the preflight
    response = await gw.client.post(CHAT, json=chat(), headers={
        "origin": EVIL, "authorization": f"Bearer {KEY}"})
    assert_clean_error(response, 403, "origin_not_allowed", gw)
    assert fake.requests == []


async def test_an_allowed_origin_gets_cors_headers_and_a_working_preflight(gw, fake):
    app = "https://chat.example.com"
    gw.configure(allow_origins=[f"{app}, https://*.tools.example"])  # as the environment gives it
    preflight = await gw.client.options(CHAT, headers={
        "origin": app, "access-control-request-method": "POST",
        "access-control-request-headers": "authorization, content-type"})
    assert preflight.status_code == 204
    assert preflight.headers["access-control-allow-origin"] == app
    assert "POST" in preflight.headers["access-control-allow-methods"]
    assert preflight.headers["access-control-allow-headers"] == "authorization, content-type"
    assert fake.requests == []

    response = await gw.client.post(CHAT, json=chat(), headers={"origin": app})
    assert response.status_code == 200
    assert response.headers["access-control-allow-origin"] == app
    assert response.headers["vary"] == "Origin"
    assert response.json()["choices"][0]["message"]["content"]

    streamed = await gw.client.post(CHAT, json=chat(True), headers={"origin": "https://a.tools.example"})
    assert streamed.headers["access-control-allow-origin"] == "https://a.tools.example"
    assert streamed.text.rstrip().endswith("data: [DONE]")

    # An error the page should be able to read carries the headers as well.
    gw.configure(api_key=KEY)
    refused = await gw.client.post(CHAT, json=chat(), headers={"origin": app})
    assert_clean_error(refused, 401, "invalid_api_key", gw)
    assert refused.headers["access-control-allow-origin"] == app


async def test_pages_served_from_this_machines_loopback_are_allowed(gw):
    for origin in ("http://localhost:5173", "http://127.0.0.1:3000", "http://[::1]:8080"):
        response = await gw.client.post(CHAT, json=chat(), headers={"origin": origin})
        assert response.status_code == 200, origin
        assert response.headers["access-control-allow-origin"] == origin


# --- content type --------------------------------------------------------------------------------


@pytest.mark.parametrize("content_type", ["text/plain", "text/plain;charset=UTF-8",
                                          "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", None])
async def test_a_post_that_is_not_declared_json_is_refused_without_a_key(gw, fake, content_type):
    headers = {"content-type": content_type} if content_type else {}
    response = await gw.client.post(CHAT, content=json.dumps(chat()).encode(), headers=headers)
    if content_type is None:
        assert "content-type" not in response.request.headers
    error = assert_clean_error(response, 415, "unsupported_content_type", gw)
    assert "application/json" in error["message"]
    assert fake.requests == []


async def test_json_content_types_are_accepted(gw):
    for content_type in ("application/json", "application/json; charset=utf-8", "Application/JSON"):
        response = await gw.client.post(CHAT, content=json.dumps(chat()).encode(),
                                        headers={"content-type": content_type})
        assert response.status_code == 200, content_type


# --- ordinary clients are unaffected ----------------------------------------------------------------


async def test_the_openai_sdk_and_curl_work_as_before(gw):
    # openai takes an httpx client at run time but annotates only its own httpx2 fork's.
    sdk = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0,
                             http_client=httpx.AsyncClient(trust_env=False))  # type: ignore[arg-type]
    try:
        completion = await sdk.chat.completions.create(
            model="fake-model", messages=[{"role": "user", "content": "hi"}])
        assert completion.choices[0].message.content
        models = await sdk.models.list()
        assert [m.id for m in models.data] == ["fake-model", "default"]
    finally:
        await sdk.close()

    curl = await asyncio.to_thread(subprocess.run, [
        "curl", "-sS", "--noproxy", "*", gw.url + CHAT, "-H", "Content-Type: application/json",
        "-d", json.dumps(chat())], capture_output=True, text=True, timeout=60)
    assert json.loads(curl.stdout)["choices"][0]["message"]["content"], curl.stderr


# --- throttle of wrong keys --------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_repeated_wrong_keys_from_one_address_are_throttled(gw, fake):
    gw.configure(api_key=KEY)
    clock = gw.guard.clock = Clock()  # the lockout ends when the test says, not after a sleep
    wrong = {"authorization": "Bearer guess-guess-guess-guess"}
    for _ in range(FREE_FAILURES):
        assert_clean_error(await gw.client.post(CHAT, json=chat(), headers=wrong), 401,
                           "invalid_api_key", gw)
    locked = await gw.client.post(CHAT, json=chat(), headers=wrong)
    assert_clean_error(locked, 429, "too_many_failed_keys", gw)
    assert locked.headers["retry-after"] == "1"
    assert fake.requests == []

    clock.now += 1.0
    assert_clean_error(await gw.client.post(CHAT, json=chat(), headers=wrong), 401, "invalid_api_key", gw)
    again = await gw.client.get("/v1/models", headers=wrong)
    assert_clean_error(again, 429, "too_many_failed_keys", gw)
    assert again.headers["retry-after"] == "2"  # each further failure doubles the wait
    assert gw.rejections("too_many_failed_keys") == 2


async def test_a_wrong_key_flood_is_throttled_and_the_right_key_still_passes(gw, fake):
    """The guesser gets 429s; the rightful user behind the same address is served
    throughout, and its requests do not lift the guesser's lockout."""
    gw.configure(api_key=KEY)
    gw.guard.clock = Clock()
    wrong = {"authorization": "Bearer guess-guess-guess-guess"}
    answers = [(await gw.client.get("/v1/models", headers=wrong)).status_code for _ in range(50)]
    assert answers == [401] * FREE_FAILURES + [429] * (50 - FREE_FAILURES)

    right = await gw.client.post(CHAT, json=chat(), headers={"authorization": f"Bearer {KEY}"})
    assert right.status_code == 200, right.text
    assert len(fake.requests) == 1
    assert (await gw.client.get("/v1/models", headers={"x-api-key": KEY})).status_code == 200
    still = await gw.client.get("/v1/models", headers=wrong)
    assert_clean_error(still, 429, "too_many_failed_keys", gw)
    assert int(still.headers["retry-after"]) >= 1


async def test_one_request_is_at_most_two_guesses_however_many_key_headers_it_repeats(gw):
    gw.configure(api_key=KEY)
    guesses = [("x-api-key", f"guess-{i:02d}-guess-guess") for i in range(50)] + [("x-api-key", KEY)]
    response = await gw.client.get("/v1/models", headers=guesses)
    assert_clean_error(response, 401, "invalid_api_key", gw)  # the last one is not read
    first = await gw.client.get("/v1/models", headers=[("x-api-key", KEY)] + guesses)
    assert first.status_code == 200


async def test_a_keyless_flood_locks_nobody_out(gw, fake):
    """What a web page's <img> tags (or a client not set up yet) send: no key at all.
    It is told the key is missing, every time, and never counts toward a lockout."""
    gw.configure(api_key=KEY)
    gw.guard.clock = Clock()
    for headers in ({}, {"authorization": "Bearer"}, {"authorization": "Basic dXNlcjpwdw=="},
                    {"x-api-key": ""}):
        for _ in range(3 * FREE_FAILURES):
            response = await gw.client.get("/v1/models", headers=headers)
            error = assert_clean_error(response, 401, "invalid_api_key", gw)
            assert "Missing API key" in error["message"]
    assert gw.rejections("too_many_failed_keys") == 0

    right = await gw.client.post(CHAT, json=chat(), headers={"x-api-key": KEY})
    assert right.status_code == 200, right.text
    # A typo afterwards is a plain 401: the flood left no record behind.
    typo = await gw.client.get("/v1/models", headers={"x-api-key": KEY + "x"})
    assert_clean_error(typo, 401, "invalid_api_key", gw)


async def test_old_failures_are_forgotten(gw):
    gw.configure(api_key=KEY)
    clock = gw.guard.clock = Clock()
    wrong = {"authorization": "Bearer guess"}
    for _ in range(FREE_FAILURES - 1):
        assert (await gw.client.get("/v1/models", headers=wrong)).status_code == 401
    clock.now += FORGET_FAILURES_AFTER + 1
    for _ in range(FREE_FAILURES - 1):  # a fresh count: still no lockout
        assert (await gw.client.get("/v1/models", headers=wrong)).status_code == 401
    assert (await gw.client.get("/v1/models", headers={"x-api-key": KEY})).status_code == 200


@pytest.mark.parametrize("origin", ["http://localhost:80@evil.com", "http://127.0.0.1@evil.com",
                                    "http://localhost:5173/@evil.com", "http://localhost:x",
                                    "http://[::1]@evil.com:8080"])
async def test_an_origin_is_read_by_a_url_parser_so_userinfo_cannot_pass_for_loopback(gw, origin):
    response = await gw.client.post(CHAT, json=chat(), headers={"origin": origin})
    assert_clean_error(response, 403, "origin_not_allowed", gw)
    assert "access-control-allow-origin" not in response.headers


async def test_an_allowed_pattern_is_not_fooled_by_userinfo_either(gw):
    gw.configure(allow_origins=["https://*.tools.example"])
    sneaky = await gw.client.post(CHAT, json=chat(), headers={"origin": "https://evil.com@a.tools.example"})
    assert_clean_error(sneaky, 403, "origin_not_allowed", gw)
    fine = await gw.client.post(CHAT, json=chat(), headers={"origin": "https://a.tools.example"})
    assert fine.status_code == 200


# --- the Chat tab's own key ------------------------------------------------------------------


def _scope(secret: str) -> dict:
    return {"client": ("127.0.0.1", 5000),
            "headers": [(b"authorization", f"Bearer {secret}".encode())]}


@pytest.mark.parametrize("owner_key", ["", "owner-secret-0123456789"])
def test_the_chat_tabs_key_is_its_own_flow_with_the_owners_rights(owner_key: str):
    from backend.keys.key_store import CHAT_NAME
    from backend.port.access_guard import AccessGuard
    from backend.settings import Settings
    settings = Settings(api_key=owner_key)
    guard = AccessGuard(lambda: settings, chat_secret=lambda: "chat-secret")

    caller = guard.check_key(_scope("chat-secret"))

    assert (caller.flow, caller.name) == (CHAT_NAME, CHAT_NAME)
    assert caller.key is not None and caller.key.is_owner  # every model, its cache figures
    if owner_key:
        assert guard.check_key(_scope(owner_key)).name == "owner"
        with pytest.raises(Exception, match="Incorrect API key"):
            guard.check_key(_scope("chat-secre"))
