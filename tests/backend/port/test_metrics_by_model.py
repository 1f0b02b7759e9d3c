"""Counts by model and engine, through the port of a real pool: two models on this
machine, each request counted under the model it went to and the engine that ran it; a
refusal before there was a model counted without the client's string; queue waits
observed per model; /health's models carry the same counts.  And a requeue, counted
under the engine that refused the connection."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from backend.app.pool.pool_config import ModelEntry, PoolConfig
from backend.app.service import StudioService
from backend.llama.load import LoadSettings
from backend.llama.supervisor import pick_free_port
from backend.admission.admission_ticket import MAX_REQUEUES
from tests.backend.gateway_harness import open_gateway
from tests.backend.service_harness import ServiceFactory

CHAT = "/v1/chat/completions"
SMALL = LoadSettings(parallel="1", ctx_size=2048)
#: Runs until cancelled, or its context (2,048 tokens) is full: ignore_eos stops no model.
LONG = {"max_tokens": 4000, "ignore_eos": True}
HERE = "this machine"


@pytest.fixture
async def service(running_service: ServiceFactory) -> StudioService:
    return await running_service(keepalive_interval=0.1, queue_timeout=120)


@pytest.fixture
def client(port_client: httpx.AsyncClient) -> httpx.AsyncClient:
    return port_client


def chat(model: str, **extra: object) -> dict[str, object]:
    return {"model": model, "messages": [{"role": "user", "content": "Say hi."}],
            "temperature": 0, "max_tokens": 8, **extra}


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


async def scrape(client: httpx.AsyncClient) -> tuple[str, Samples]:
    text = (await client.get("/metrics")).text
    return text, {(s.name, tuple(sorted(s.labels.items()))): s.value
                  for family in text_string_to_metric_families(text) for s in family.samples}


def at(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


async def until(predicate, timeout: float = 60.0) -> None:
    """Poll the running port (its counts are taken after the answer is sent)."""
    async def poll() -> None:
        while not predicate():
            await asyncio.sleep(0.02)
    await asyncio.wait_for(poll(), timeout)


async def test_each_model_is_counted_under_its_own_labels_and_an_unknown_one_under_none(
        service, client, tiny_model, smollm2_model):
    await service.start_pool(PoolConfig(models=(
        ModelEntry.for_file(str(tiny_model), settings=SMALL),
        ModelEntry.for_file(str(smollm2_model), name="smol", settings=SMALL,
                            aliases=("SmolLM2",)))))
    metrics = service.metrics

    # smol's one slot held by a stream (SmolLM2 is the slow one: its stream outlasts
    # every step below, where the tiny model's 2,000 tokens may end on a busy machine):
    # the next request for smol waits in its line.
    started = asyncio.Event()

    async def holder() -> None:
        async with client.stream("POST", CHAT, json=chat("SmolLM2", stream=True, **LONG)) as r:
            async for line in r.aiter_lines():  # by its alias
                if line.startswith("data: {"):
                    started.set()

    holding = asyncio.create_task(holder())
    await started.wait()
    waiter = asyncio.create_task(client.post(CHAT, json=chat("smol")))
    await until(lambda: service.registry.find_line("smol").waiting == 1)
    health = (await client.get("/health")).json()
    smol_health = next(m for m in health["models"] if m["id"] == "smol")
    assert smol_health["requests"]["waiting"] == 1
    assert (await client.post(CHAT, json=chat("tiny"))).status_code == 200
    holding.cancel()
    await asyncio.gather(holding, return_exceptions=True)
    assert (await waiter).status_code == 200

    unknown = await client.post(CHAT, json=chat("gpt-4o-from-a-client"))
    assert unknown.status_code == 404
    malformed = await client.post(CHAT, content=b'{"model": "tiny", "messages": [',
                                  headers={"content-type": "application/json"})
    assert malformed.status_code == 400
    await until(lambda: metrics.value("gguf_studio_requests_total", {"route": CHAT}) == 5
                and metrics.value("gguf_studio_cancellations_total") == 1)

    text, found = await scrape(client)
    ok = {"route": CHAT, "status": "200"}
    # smol: the waiter answered; the holder left before its answer's end: 499, though its
    # stream had begun with a 200.
    assert at(found, "gguf_studio_requests_total", model="smol", engine=HERE, **ok) == 1
    assert at(found, "gguf_studio_requests_total", model="smol", engine=HERE, route=CHAT,
              status="499") == 1
    assert at(found, "gguf_studio_requests_total", model="tiny", engine=HERE, **ok) == 1
    # The client's string is no label value: the refusal counts under no model.
    assert "gpt-4o-from-a-client" not in text
    assert at(found, "gguf_studio_requests_total", model="", engine="", route=CHAT,
              status="404") == 1
    assert at(found, "gguf_studio_rejections_total", model="", engine="",
              reason="model_not_found") == 1
    # A body that could not be read named no model yet, whatever it began with.
    assert at(found, "gguf_studio_requests_total", model="", engine="", route=CHAT,
              status="400") == 1
    # The holder left while running on smol's engine.
    assert at(found, "gguf_studio_cancellations_total", model="smol", engine=HERE,
              stage="running") == 1
    # Queue waits per model and engine: smol's second request waited for the holder.
    assert at(found, "gguf_studio_queue_wait_seconds_count", model="smol", engine=HERE) == 2
    assert at(found, "gguf_studio_queue_wait_seconds_count", model="tiny", engine=HERE) == 1
    smol_waited = at(found, "gguf_studio_queue_wait_seconds_sum", model="smol", engine=HERE)
    assert smol_waited > at(found, "gguf_studio_queue_wait_seconds_sum", model="tiny",
                            engine=HERE)
    assert at(found, "gguf_studio_queue_wait_seconds_bucket", model="smol", engine=HERE,
              le="0.001") < 2  # one of them was not admitted at once
    assert at(found, "gguf_studio_requeues_total", model="tiny", engine=HERE) == 0  # exists

    # Summed over models and engines, the totals are the port's, as before.
    totals = metrics.totals()
    assert sum(totals["rejections"].values()) == 2  # the unknown model, the malformed body
    assert totals["queue_waits"] == 3
    assert metrics.value("gguf_studio_requests_total", ok) == 2  # the holder is counted under 499

    health = (await client.get("/health")).json()
    requests = {m["id"]: m["requests"] for m in health["models"]}
    assert requests == {
        "smol": {"answered": 2, "refused": 0, "cancelled": 1, "waiting": 0},
        "tiny": {"answered": 1, "refused": 0, "cancelled": 0, "waiting": 0}}


async def test_a_refused_connection_counts_under_the_engine_that_refused_it():
    """An engine that refuses every connection (nothing listens on its port): each try
    sends the request back in line, counted under that engine, then the 502 too."""
    nobody = pick_free_port()
    async with open_gateway(f"http://127.0.0.1:{nobody}", 1) as gw:
        queue = gw.registry.current
        assert queue is not None
        gw.registry.activate(queue.serving, label="upstream 1")
        answer = await gw.client.post(CHAT, json=chat("anything a client says"))
        assert answer.status_code == 502
        await until(lambda: gw.requests(CHAT, 502) == 1)
    far = {"engine": "upstream 1"}
    assert gw.metrics.value("gguf_studio_requeues_total", far) == MAX_REQUEUES
    assert gw.metrics.value("gguf_studio_rejections_total", far) == 1
    assert gw.metrics.value("gguf_studio_requests_total", {**far, "status": "502"}) == 1
    assert gw.metrics.value("gguf_studio_queue_wait_seconds_count", far) == 1  # its first try
    assert gw.metrics.totals()["requeues"] == MAX_REQUEUES
