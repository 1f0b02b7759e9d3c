"""The enrolment endpoint of a real port: refused and expired requests mint nothing, the
key is handed over once, and a flood finds bounded state, 429s and a port still serving."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from backend.enrolments import MAX_PER_ADDRESS, MAX_REQUESTS, PORT_BURST
from backend.key_store import KeyStore

OWNER_KEY = "owner-key-for-the-enrolment-tests-0123"


@pytest.fixture
async def service(running_service):
    return await running_service(api_key=OWNER_KEY, host="127.0.0.1")


def client(service, source: str = "127.0.0.1") -> httpx.AsyncClient:
    transport = httpx.AsyncHTTPTransport(local_address=source)
    return httpx.AsyncClient(base_url=f"http://127.0.0.1:{service.gateway_port}",
                             transport=transport, timeout=30)


async def ask(http: httpx.AsyncClient, name: str) -> httpx.Response:
    return await http.post("/v1/enrolments", json={"name": name})


async def test_an_approved_request_gets_its_key_once_and_the_key_works(service):
    async with client(service) as http:
        asked = (await ask(http, "bob")).json()
        polling = asyncio.ensure_future(http.get(asked["poll"], params={"wait": 20}))
        (pending,) = service.enrolments.pending()
        assert (pending.name, pending.code, pending.address) == ("bob", asked["code"], "127.0.0.1")
        service.approve_enrolment("bob", tokens_per_minute=1000)
        answer = await polling
        again = await http.get(asked["poll"])
        models = await http.get("/v1/models",
                                headers={"Authorization": f"Bearer {answer.json()['api_key']}"})

    assert answer.status_code == 200 and answer.json()["name"] == "bob", answer.text
    assert again.status_code == 404 and again.json()["error"]["code"] == "enrolment_not_found"
    assert models.status_code == 200, models.text
    minted = KeyStore().get("bob")
    assert minted is not None and minted.tokens_per_minute == 1000


async def test_a_refused_request_mints_nothing_and_is_told_so(service):
    async with client(service) as http:
        asked = (await ask(http, "mallory")).json()
        service.refuse_enrolment("mallory")
        answer = await http.get(asked["poll"])

    assert answer.status_code == 403, answer.text
    assert answer.json()["error"]["code"] == "enrolment_refused"
    assert KeyStore().records() == []


async def test_an_expired_request_mints_nothing_and_cannot_be_approved(running_service):
    service = await running_service(api_key=OWNER_KEY, enrolment_ttl=1.0)
    async with client(service) as http:
        asked = (await ask(http, "late")).json()
        # The poll is held until the request expires (1 s), then answered.
        answer = await http.get(asked["poll"], params={"wait": 10})

    assert answer.status_code == 404, answer.text
    assert answer.json()["error"]["code"] == "enrolment_not_found"
    with pytest.raises(Exception, match="No enrolment request named 'late'"):
        service.approve_enrolment("late")
    assert service.enrolments.pending() == []
    assert KeyStore().records() == []


async def test_a_flood_of_requests_gets_429s_keeps_bounded_state_and_the_port_serves(service):
    sources = [f"127.0.0.{i}" for i in range(2, 22)]  # twenty addresses of this machine
    clients = [client(service, source) for source in sources]
    try:
        answers = await asyncio.gather(*(
            ask(http, f"flood-{i}-{n}") for i, http in enumerate(clients) for n in range(15)))
        guesses = await asyncio.gather(*(clients[0].get(f"/v1/enrolments/guess{n}")
                                         for n in range(100)))
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{service.gateway_port}",
                                     timeout=30) as owner:
            health = await owner.get("/health")
            models = await owner.get("/v1/models",
                                     headers={"Authorization": f"Bearer {OWNER_KEY}"})
    finally:
        for http in clients:
            await http.aclose()

    statuses = [a.status_code for a in answers]
    accepted = statuses.count(202)
    assert accepted <= min(MAX_REQUESTS, PORT_BURST), statuses
    assert accepted >= 1
    assert set(statuses) == {202, 429}, set(statuses)
    assert all(a.headers.get("retry-after") for a in answers if a.status_code == 429)
    assert len(service.enrolments.pending()) == accepted <= MAX_REQUESTS
    per_address: dict[str, int] = {}
    for pending in service.enrolments.pending():
        per_address[pending.address] = per_address.get(pending.address, 0) + 1
    assert max(per_address.values()) <= MAX_PER_ADDRESS
    assert {g.status_code for g in guesses} == {404}
    assert health.status_code in (200, 503) and models.status_code == 200
    assert KeyStore().records() == []


async def test_a_port_without_a_key_takes_no_enrolment(running_service):
    service = await running_service()
    async with client(service) as http:
        answer = await ask(http, "bob")

    assert answer.status_code == 404 and answer.json()["error"]["code"] == "enrolment_closed"


async def test_the_access_log_leaves_out_a_polls_id(service, caplog):
    import logging

    from backend.port.access_log import ACCESS_LOGGER

    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    async with client(service) as http:
        asked = (await ask(http, "bob")).json()
        await http.get(asked["poll"])

    assert "GET /v1/enrolments/… 200" in caplog.text
    assert asked["id"] not in caplog.text
