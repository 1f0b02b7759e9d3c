"""The pool with real engines: several models at once, on-demand loads and evictions,
idle unloads, engines elsewhere sharing one model's line, an embeddings model beside a
chat model."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from backend.app.pool.pool_status import Residency
from backend.app.pool.pool_config import ModelEntry, PoolConfig, UpstreamEntry
from backend.app.pool.local_models import estimate_model_bytes
from backend.app.service import StudioService
from backend.llama.kv_capacity import KvCapacity, KvLayout
from backend.llama.load import LoadSettings
from backend.llama.supervisor import pick_free_port
from backend.llama.remote_engine import LOADABLE_NOTE, RemoteEngine
from tests.backend.llama.test_remote_engine import (_until_health, _until_healthy, end_studio,
                                                    serve_upstream, start_llama_server,
                                                    start_studio, stop)
from tests.fake_upstream import FakeUpstream
from tests.model_factory import write_tiny_model
from tests.backend.service_harness import ServiceFactory

LONG = {"max_tokens": 4000, "ignore_eos": True}
STUDIO_KEY = "studio-key-0123456789"  # what `start_studio`'s port requires
SMALL = LoadSettings(parallel="1", ctx_size=2048)


@pytest.fixture
async def service(running_service: ServiceFactory) -> StudioService:
    return await running_service(keepalive_interval=0.1, reload_grace=30, queue_timeout=120)


@pytest.fixture
def client(port_client: httpx.AsyncClient) -> httpx.AsyncClient:
    return port_client


@pytest.fixture(scope="module")
def other_tiny_model(tmp_path_factory: pytest.TempPathFactory, vocab_path: Path) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("other") / "other.gguf", vocab_path, seed=7)


def chat(model: str | None, stream: bool = False, **extra: object) -> dict:
    body: dict = {"messages": [{"role": "user", "content": "What is the capital of France? Answer in one word."}],
                  "stream": stream, "temperature": 0, "max_tokens": 48, **extra}
    if model is not None:
        body["model"] = model
    return body


async def until(predicate, timeout: float = 60.0) -> None:
    """Poll the running system (engines' slots and residency have no events here)."""
    async def poll():
        while not predicate():
            await asyncio.sleep(0.02)
    await asyncio.wait_for(poll(), timeout)


async def attach_llama_servers(service: StudioService, ports: list[int], **options) -> None:
    """Attach the plain llama-servers on `ports` (once each answers) as upstreams of the
    port's "elsewhere" model, and wait until its line has them all."""
    for port in ports:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as probe:
            await _until_healthy(probe)
        await service.attach_upstream(f"http://127.0.0.1:{port}", **options)
    await until(lambda: len(service.registry.line("elsewhere").engines) == len(ports))


async def stream_lines(client: httpx.AsyncClient, body: dict,
                       started: asyncio.Event | None = None) -> list[str]:
    lines = []
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if line:
                lines.append(line)
                if started is not None and line.startswith("data: {"):
                    started.set()
    return lines


def studio_model(name: str, state: str, slots: int | None = None, **fields: object) -> dict:
    """One model in a GGUF Studio port's /health, with one local engine of `slots` slots."""
    engines = [] if slots is None else [{
        "id": f"local:{name}", "where": "this machine", "state": "ready", "slots": slots,
        "kv": {"total": 1024 * slots, "per_request": 1024, "unified": False},
        "active": 0, "waiting": 0, "reserved_tokens": 0, "note": None}]
    return {"id": name, "state": state, "default": False, "context_length": 1024, "aliases": [],
            "local": True, "embeddings": False, "error": None, "engines": engines, **fields}


def studio_health(*models: dict) -> dict:
    return {"state": "ready", "model": models[0]["id"], "effective_parallel_slots": 1,
            "active": 0, "waiting": 0, "kv": None, "models": list(models)}


def engines_of(health: dict, model: str) -> list[dict]:
    return next(m for m in health["models"] if m["id"] == model)["engines"]


def _delta(line: str) -> str:
    choices = json.loads(line.removeprefix("data: ")).get("choices") or [{}]
    return (choices[0].get("delta") or {}).get("content") or ""


def text_of(answer: httpx.Response) -> tuple[str, str]:
    assert answer.status_code == 200, answer.text
    choice = answer.json()["choices"][0]
    return choice["message"]["content"], choice["finish_reason"]


# --- several models at once --------------------------------------------------------------


async def test_two_models_at_once_answer_by_name_and_are_listed(service, client, tiny_model,
                                                              smollm2_model):
    await service.start_pool(PoolConfig(models=(
        ModelEntry.for_file(str(tiny_model), settings=SMALL),
        ModelEntry.for_file(str(smollm2_model), name="smol", settings=SMALL,
                            aliases=("SmolLM2",)))))

    tiny_text, tiny_end = text_of(await client.post("/v1/chat/completions", json=chat("tiny")))
    smol_text, smol_end = text_of(await client.post("/v1/chat/completions", json=chat("SmolLM2")))
    default_text, _ = text_of(await client.post("/v1/chat/completions", json=chat(None)))

    assert "Paris" in smol_text and smol_end == "stop"  # the trained model answers and stops
    assert tiny_end == "length" and tiny_text != smol_text  # random weights run to the limit
    assert default_text == tiny_text  # no model: the default, the first one
    models = (await client.get("/v1/models")).json()["data"]
    assert [(m["id"], m["state"], m["context_length"]) for m in models] == [
        ("tiny", "ready", 2048), ("smol", "ready", 2048), ("default", "ready", 2048)]
    unknown = await client.post("/v1/chat/completions", json=chat("gpt-4o"))
    assert unknown.status_code == 404
    error = unknown.json()["error"]
    assert error["code"] == "model_not_found" and "tiny, smol" in error["message"]
    hostile = await client.post("/v1/chat/completions", json=chat("gpt\x1b[2J" + "x" * 500))
    message = hostile.json()["error"]["message"]  # the client's string, escaped and cut
    assert "\\x1b[2J" in message and "\x1b" not in message and len(message) < 200
    health = (await client.get("/health")).json()
    assert [m["id"] for m in health["models"]] == ["tiny", "smol"]
    assert all(m["engines"][0]["where"] == "this machine" for m in health["models"])


# --- on demand, eviction, idleness ------------------------------------------------------


async def test_a_model_loads_on_demand_evicting_the_idle_one_never_the_busy_one(
        service, client, tiny_model, other_tiny_model, smollm2_model):
    # The busy one streams SmolLM2, whose answer outlasts the rest of the test: the tiny
    # model's 2,000 tokens ended before the load they were to outlast on a busy machine.
    busy = ModelEntry.for_file(str(smollm2_model), name="smol", settings=SMALL)
    idle = ModelEntry.for_file(str(tiny_model), settings=SMALL)
    third = ModelEntry.for_file(str(other_tiny_model), settings=SMALL, preload=False)
    sizes = [estimate_model_bytes(entry) for entry in (busy, idle, third)]
    limit_mib = (sum(sizes) - 1) // (1 << 20)  # two fit, not three
    await service.start_pool(PoolConfig(models=(busy, idle, third), memory_limit_mib=limit_mib))
    pool = service.pool
    assert pool.status("other").residency is Residency.UNLOADED

    running_started = asyncio.Event()
    running = asyncio.create_task(stream_lines(client, chat("smol", True, **LONG),
                                               running_started))
    await running_started.wait()
    text_of(await client.post("/v1/chat/completions", json=chat("tiny")))
    # The busy model is now the least recently used one; the idle one must go instead.
    demanded = await stream_lines(client, chat("other", True))

    assert demanded[0].startswith(":")  # keep-alives flowed while it loaded
    assert demanded[-1] == "data: [DONE]"
    assert pool.status("tiny").residency is Residency.EVICTED
    assert "evicted to make room for other" in pool.status("tiny").decision
    assert pool.status("smol").residency is Residency.READY and not running.done()
    running.cancel()
    await asyncio.gather(running, return_exceptions=True)
    # The evicted model comes back on demand (the idle "other" makes room for it).
    text_of(await client.post("/v1/chat/completions", json=chat("tiny")))
    assert pool.status("tiny").residency is Residency.READY


async def test_a_busy_model_is_never_evicted_its_stream_completes(
        service, client, smollm2_model, other_tiny_model):
    # SmolLM2's 400 tokens take seconds: the tiny model's could end before the waiter
    # was seen waiting for room on a busy machine.
    busy = ModelEntry.for_file(str(smollm2_model), name="smol", settings=SMALL)
    third = ModelEntry.for_file(str(other_tiny_model), settings=SMALL, preload=False)
    limit_mib = (max(estimate_model_bytes(busy), estimate_model_bytes(third)) + (1 << 20)) >> 20
    await service.start_pool(PoolConfig(models=(busy, third), memory_limit_mib=limit_mib))

    started = asyncio.Event()
    running = asyncio.create_task(stream_lines(
        client, chat("smol", True, max_tokens=400, ignore_eos=True), started))
    await started.wait()
    waiting = asyncio.create_task(client.post("/v1/chat/completions", json=chat("other")))
    await until(lambda: "waiting for room" in service.pool.status("other").decision)
    assert service.pool.status("smol").residency is Residency.READY

    lines = await running
    assert lines[-1] == "data: [DONE]" and '"finish_reason":"length"' in lines[-2]
    text_of(await waiting)  # loaded once the busy one was idle, which made room
    assert service.pool.status("smol").residency is Residency.EVICTED


async def test_a_sliding_window_model_and_a_hybrid_fit_a_limit_a_dense_count_would_break(
        service, client, gemma3_model, hybrid_model):
    # At 32k, Gemma 3 keeps the context in 3 layers and a 512-token window in 15 (116 MB;
    # 600 MB were every layer to keep it all, as with --swa-full); the hybrid's 3 recurrent
    # layers keep a state, not the context.  A limit of their estimates together holds
    # both, where counting every layer as full attention evicted one to load the other.
    long = LoadSettings(parallel="1", ctx_size=32768)
    gemma = ModelEntry.for_file(str(gemma3_model), name="gemma", settings=long)
    hybrid = ModelEntry.for_file(str(hybrid_model), name="hybrid", settings=long)
    limit_mib = ((estimate_model_bytes(gemma) + estimate_model_bytes(hybrid)) >> 20) + 1
    every_layer_full = dataclasses.replace(gemma, settings=dataclasses.replace(
        long, extra_args=("--swa-full",)))
    assert estimate_model_bytes(every_layer_full) + estimate_model_bytes(hybrid) > limit_mib << 20
    await service.start_pool(PoolConfig(models=(gemma, hybrid), memory_limit_mib=limit_mib))
    for name in ("gemma", "hybrid"):  # plain prompts: Gemma 3 270M has no chat template
        answer = await client.post("/v1/completions", json={"model": name, "prompt": "Paris is",
                                                             "max_tokens": 4})
        assert answer.status_code == 200, answer.text
    assert [service.pool.status(n).residency for n in ("gemma", "hybrid")] == [Residency.READY] * 2


async def test_an_idle_model_is_unloaded_after_its_ttl(service, client, tiny_model):
    await service.start_pool(PoolConfig(models=(
        ModelEntry.for_file(str(tiny_model), settings=SMALL, idle_ttl=0.5),)))
    text_of(await client.post("/v1/chat/completions", json=chat("tiny")))
    await until(lambda: service.pool.status("tiny").residency is Residency.EVICTED)
    assert "idle for 0.5 s" in service.pool.status("tiny").decision
    text_of(await client.post("/v1/chat/completions", json=chat("tiny")))  # back on demand


async def test_embeddings_go_to_the_embeddings_model_beside_the_chat_model(
        service, client, tiny_model, embedding_model):
    await service.start_pool(PoolConfig(models=(
        ModelEntry.for_file(str(tiny_model), settings=SMALL),
        ModelEntry.for_file(str(embedding_model), name="embed", embeddings=True,
                            settings=LoadSettings(parallel="2", ctx_size=1024,
                                                  extra_args=("--embeddings",))))))
    vectors = await client.post("/v1/embeddings", json={"input": ["a cat", "a dog"]})
    assert vectors.status_code == 200, vectors.text
    assert [len(item["embedding"]) for item in vectors.json()["data"]] == [64, 64]
    text_of(await client.post("/v1/chat/completions", json=chat(None)))  # chat: the tiny one


# --- engines elsewhere -------------------------------------------------------------------


async def test_two_upstreams_of_one_model_run_twice_the_slots_and_survive_one_dying(
        service, client, llama_server_binary, tiny_model):
    ports = [pick_free_port(), pick_free_port()]
    engines = [start_llama_server(llama_server_binary, tiny_model, port, parallel=2, ctx=4096)
               for port in ports]
    try:
        await attach_llama_servers(service, ports, kv_layout=KvLayout.SPLIT)

        first_tokens = [asyncio.Event() for _ in range(4)]
        running = [asyncio.create_task(stream_lines(client, chat("elsewhere", True, **LONG), ev))
                   for ev in first_tokens]
        await asyncio.gather(*(ev.wait() for ev in first_tokens))
        assert (service.registry.total_active, service.registry.total_waiting) == (4, 0)

        waiters = [asyncio.create_task(stream_lines(
            client, chat("elsewhere", True, max_tokens=40, ignore_eos=True))) for _ in range(2)]
        await until(lambda: service.registry.total_waiting == 2)
        stop(engines[0])  # SIGKILL: its running requests end, its waiters go to the other
        await until(lambda: sum(t.done() for t in running) >= 2)
        failed = [t.result() for t in running if t.done()]
        for lines in failed:
            assert lines[-1] == "data: [DONE]"
            assert json.loads(lines[-2].removeprefix("data: "))["error"]["code"] in (
                "upstream_failed", "model_reloaded")
        for task in running:
            if not task.done():
                task.cancel()  # the other engine's long streams: free its slots
        done = await asyncio.wait_for(asyncio.gather(*waiters), 60)
        for lines in done:
            assert lines[-1] == "data: [DONE]" and '"finish_reason":"length"' in lines[-2]
        await asyncio.gather(*running, return_exceptions=True)
    finally:
        for engine in engines:
            if engine.poll() is None:
                stop(engine)


async def test_a_model_served_by_two_upstreams_is_listed_once(service, client,
                                                               llama_server_binary, tiny_model):
    ports = [pick_free_port(), pick_free_port()]
    engines = [start_llama_server(llama_server_binary, tiny_model, port, parallel=1)
               for port in ports]
    try:
        await attach_llama_servers(service, ports)
        listed = (await client.get("/v1/models")).json()["data"]
        health = (await client.get("/health")).json()["models"]
    finally:
        for engine in engines:
            stop(engine)
    assert [m["id"] for m in listed] == ["elsewhere", "default"]  # and its stable alias
    assert [m["id"] for m in health] == ["elsewhere"]
    assert len(health[0]["engines"]) == 2


async def test_two_gguf_studio_ports_behind_a_third_share_one_models_line(
        service, client, tmp_path, llama_server_binary, tiny_model):
    ports = [pick_free_port(), pick_free_port()]
    homes = [tmp_path / f"studio{i}" for i in range(2)]
    for home in homes:
        home.mkdir()
    studios = [start_studio(home, llama_server_binary, tiny_model, port)
               for home, port in zip(homes, ports)]
    try:
        for port in ports:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as probe:
                await _until_healthy(probe)
            await service.attach_upstream(f"http://127.0.0.1:{port}",
                                          api_key="studio-key-0123456789")
        await until(lambda: len(service.registry.line("tiny").engines) == 2)

        first_tokens = [asyncio.Event() for _ in range(4)]
        running = [asyncio.create_task(stream_lines(client, chat("tiny", True, **LONG), ev))
                   for ev in first_tokens]
        # Bounded: a stream the inner ports refuse (they take no id_slot) never begins.
        await asyncio.wait_for(asyncio.gather(*(ev.wait() for ev in first_tokens)), 60)
        assert (service.registry.total_active, service.registry.total_waiting) == (4, 0)
        waiter = asyncio.create_task(stream_lines(
            client, chat("tiny", True, max_tokens=40, ignore_eos=True)))
        await until(lambda: service.registry.total_waiting == 1)

        studios[0].kill()  # SIGKILL: its engine dies with it
        await until(lambda: sum(t.done() for t in running) >= 2, timeout=90)
        for task in running:
            if not task.done():
                task.cancel()
        lines = await asyncio.wait_for(waiter, 90)
        assert lines[-1] == "data: [DONE]" and '"finish_reason":"length"' in lines[-2]
        await asyncio.gather(*running, return_exceptions=True)
    finally:
        for studio in studios:
            end_studio(studio)


async def test_every_model_of_a_gguf_studio_upstream_is_a_model_of_the_port_in_front(
        tmp_path, llama_server_binary, tiny_model, smollm2_model):
    """`serve --upstream INNER`, INNER being `serve --model tiny --model smol=...`, both
    real processes: the outer port lists both models, a request by each name reaches that
    model (their answers differ), and each model runs exactly its own slots at once."""
    port = pick_free_port()
    home = tmp_path / "inner"
    home.mkdir()
    inner = start_studio(home, llama_server_binary, tiny_model, port,
                         extra=("--model", f"smol={smollm2_model}", "--threads", "1"))
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=120) as inside:
            await _until_healthy(inside)
            await _until_health(inside, lambda h: [m["state"] for m in h.get("models", [])]
                                == ["ready", "ready"], timeout=120)
            async with serve_upstream(tmp_path, f"http://127.0.0.1:{port}",
                                      "--upstream-api-key", STUDIO_KEY) as (url, _ready):
                async with httpx.AsyncClient(base_url=url, timeout=120) as client:
                    await _until_health(client, lambda h: [(m["id"], m["state"]) for m in h["models"]]
                                        == [("tiny", "ready"), ("smol", "ready")])
                    answer = await client.get("/health")
                    assert f":{port}" not in answer.text  # "upstream 1", never its address
                    for name in ("tiny", "smol"):
                        assert [(e["where"], e["state"], e["slots"], e["kv"])
                                for e in engines_of(answer.json(), name)] == [
                            ("upstream 1", "ready", 2,
                             {"total": 4096, "per_request": 2048, "unified": False})]
                    listed = (await client.get("/v1/models")).json()["data"]
                    assert [(m["id"], m["state"], m["context_length"]) for m in listed] == [
                        ("tiny", "ready", 2048), ("smol", "ready", 2048), ("default", "ready", 2048)]

                    answers = {name: text_of(await client.post("/v1/chat/completions",
                                                               json=chat(name)))[0]
                               for name in ("tiny", "smol")}
                    assert "Paris" in answers["smol"] and answers["tiny"] != answers["smol"]

                    # Three streams for each model: two run there (its slots), one waits
                    # here, and the port behind never has one waiting.
                    for name, extra in (("tiny", {"max_tokens": 1900}),
                                        ("smol", {"max_tokens": 120, "ignore_eos": True})):
                        streams = [asyncio.create_task(stream_lines(client, chat(name, True, **extra)))
                                   for _ in range(3)]
                        await _until_health(client, lambda h: [(e["active"], e["waiting"]) for e
                                                               in engines_of(h, name)] == [(2, 1)])
                        (there,) = engines_of((await inside.get("/health")).json(), name)
                        assert there["active"] <= 2 and there["waiting"] == 0
                        for lines in await asyncio.wait_for(asyncio.gather(*streams), 120):
                            assert lines[-1] == "data: [DONE]"
                            assert '"finish_reason":"length"' in lines[-2]
    finally:
        end_studio(inner)


async def test_a_model_a_gguf_studio_upstream_can_load_is_routed_there_one_at_a_time(
        service, client, tmp_path, llama_server_binary, tiny_model, smollm2_model):
    """A model the port behind lists but has not loaded is listed here as it says; a
    request for it makes it load there (one at a time until it is ready: its slots are
    not known before), its idle TTL there takes it out of the routing here, and the next
    request loads it again."""
    port = pick_free_port()
    home = tmp_path / "inner"
    home.mkdir()
    (home / "pool.toml").write_text(f'[[model]]\nname = "smol"\npath = "{smollm2_model}"\n'
                                    'preload = false\nidle_ttl = 2\n')
    inner = start_studio(home, llama_server_binary, tiny_model, port,
                         extra=("--models-file", str(home / "pool.toml"), "--default-model",
                                "tiny", "--threads", "1"))
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as probe:
            await _until_healthy(probe)
        await service.attach_upstream(f"http://127.0.0.1:{port}", api_key=STUDIO_KEY)
        await until(lambda: set(service.pool.names()) == {"tiny", "smol"})
        smol = service.pool.status("smol")
        assert smol.residency is Residency.UNLOADED
        assert [(e.where, e.state, e.slots, e.kv, e.note) for e in smol.engines] == [
            ("upstream 1", "unloaded", 1, None, LOADABLE_NOTE)]
        listed = (await client.get("/v1/models")).json()["data"]
        assert {(m["id"], m["state"]) for m in listed if "alias_of" not in m} == {
            ("tiny", "ready"), ("smol", "unloaded")}

        service.pool.set_default("smol")  # a request naming no model is sent naming smol
        started = [asyncio.Event(), asyncio.Event()]
        streams = [asyncio.create_task(stream_lines(client, chat(None, True), ev)) for ev in started]
        line = service.registry.line("smol")
        await until(lambda: (line.waiting, sum(e.active for e in line.engines)) == (1, 1))
        done = await asyncio.wait_for(asyncio.gather(*streams), 120)
        for lines in done:
            text = "".join(_delta(line) for line in lines if line.startswith("data: {"))
            assert "Paris" in text  # smol's answer, not the upstream's default (tiny)
        assert any(line.startswith(":") for line in done[1])  # kept alive while it waited here
        # Learnt at this port's next health check of that port (each second): both answers
        # may end before it.
        await until(lambda: service.pool.status("smol").residency is Residency.READY)
        ready = service.pool.status("smol")
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as probe:
            (there,) = engines_of((await probe.get("/health")).json(), "smol")
        assert [(e.state, e.slots, e.kv) for e in ready.engines] == [
            ("ready", there["slots"], there["kv"])]  # its own, as that port gave them

        # Idle there for its TTL: unloaded there, out of the routing here (one slot again).
        await until(lambda: service.pool.status("smol").residency is Residency.EVICTED, timeout=30)
        assert [(e.state, e.slots) for e in service.pool.status("smol").engines] == [("evicted", 1)]
        assert "Paris" in text_of(await client.post("/v1/chat/completions", json=chat("smol")))[0]
    finally:
        end_studio(inner)


async def test_a_model_that_leaves_the_upstream_port_leaves_the_routing_here(service, client):
    """A fake GGUF Studio port (its models' states set at exact moments): a model that
    stops being ready there stops taking requests here, what ran on it goes on and its
    waiter keeps its place until it is back; one that failed there is a 503 here; one
    gone from its list is gone from here, and its waiter is told at once."""
    async with FakeUpstream(n_tokens=400, delay=0.01) as fake:
        fake.studio_health = studio_health(studio_model("a", "ready", 2), studio_model("b", "ready", 1))
        await service.attach_upstream(fake.base_url)
        await until(lambda: all(service.registry.find_line(n) is not None
                                and service.registry.find_line(n).engines for n in ("a", "b")))
        started = asyncio.Event()
        running = asyncio.create_task(stream_lines(client, chat("b", True, max_tokens=400), started))
        await started.wait()
        waiter = asyncio.create_task(stream_lines(client, chat("b", True, max_tokens=5)))
        line = service.registry.line("b")
        await until(lambda: line.waiting == 1)

        fake.studio_health = studio_health(studio_model("a", "ready", 2), studio_model("b", "unloading"))
        await until(lambda: not line.engines)
        assert service.pool.status("b").residency is Residency.UNLOADING
        ran = await asyncio.wait_for(running, 30)
        assert ran[-1] == "data: [DONE]" and '"finish_reason":"stop"' in ran[-2]
        assert line.waiting == 1 and not waiter.done()

        fake.studio_health = studio_health(studio_model("a", "ready", 2), studio_model("b", "ready", 1))
        waited = await asyncio.wait_for(waiter, 30)
        assert waited[-1] == "data: [DONE]" and '"finish_reason":"length"' in waited[-2]
        assert [body["model"] for body in fake.received("/v1/chat/completions")] == ["b", "b"]

        fake.studio_health = studio_health(studio_model("a", "failed", error="It did not load."),
                                           studio_model("b", "ready", 1))
        await until(lambda: service.pool.status("a").residency is Residency.FAILED)
        answer = await client.post("/v1/chat/completions", json=chat("a"))
        assert answer.status_code == 503, answer.text
        assert answer.json()["error"]["code"] == "model_not_ready"
        assert "It did not load." in answer.json()["error"]["message"]

        fake.studio_health = studio_health(studio_model("a", "unloading"), studio_model("b", "ready", 1))
        await until(lambda: service.pool.status("a").residency is Residency.UNLOADING)
        waiting_for_a = asyncio.create_task(client.post("/v1/chat/completions", json=chat("a")))
        await until(lambda: service.registry.line("a").waiting == 1)
        fake.studio_health = studio_health(studio_model("b", "ready", 1))
        await until(lambda: service.pool.names() == ["b"])
        for answer in (await asyncio.wait_for(waiting_for_a, 10),  # not at its queue timeout
                       await client.post("/v1/chat/completions", json=chat("a"))):
            assert answer.status_code == 404 and answer.json()["error"]["code"] == "model_not_found"
            assert "Models: b." in answer.json()["error"]["message"]


async def test_a_gguf_studio_port_older_than_the_pool_is_served_as_its_one_model(service, client):
    """Its /health has only the top-level fields (fake upstream: no such port to run)."""
    async with FakeUpstream() as fake:
        fake.studio_health = {"state": "ready", "model": "old", "effective_parallel_slots": 2,
                              "active": 0, "waiting": 0,
                              "kv": {"total": 4096, "per_request": 2048, "unified": False}}
        await service.attach_upstream(fake.base_url)
        await until(lambda: service.pool.names() == ["old"]
                    and bool(service.registry.line("old").engines))
        (queue,) = service.registry.line("old").engines
        assert (queue.key, queue.capacity, queue.kv) == (fake.base_url, 2,
                                                          KvCapacity(4096, 2048, unified=False))
        assert text_of(await client.post("/v1/chat/completions", json=chat(None)))[1] == "stop"
        assert "model" not in fake.received("/v1/chat/completions")[0]  # sent as it came


async def test_a_pool_of_local_and_remote_engines_lists_the_remote_model(
        service, client, llama_server_binary, tiny_model, other_tiny_model):
    port = pick_free_port()
    engine = start_llama_server(llama_server_binary, other_tiny_model, port, parallel=1)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as probe:
            await _until_healthy(probe)
        await service.start_pool(PoolConfig(
            models=(ModelEntry.for_file(str(tiny_model), settings=SMALL),),
            upstreams=(UpstreamEntry(f"http://127.0.0.1:{port}"),)))
        await until(lambda: "elsewhere" in service.pool.names())
        models = (await client.get("/v1/models")).json()["data"]
        assert [m["id"] for m in models] == ["tiny", "elsewhere", "default"]
        remote, _ = text_of(await client.post("/v1/chat/completions", json=chat("elsewhere")))
        local, _ = text_of(await client.post("/v1/chat/completions", json=chat("tiny")))
        assert remote != local  # two different models answered
    finally:
        stop(engine)


async def test_metrics_and_health_name_every_engine_by_model_and_where_it_runs(
        service, client, llama_server_binary, tiny_model, other_tiny_model):
    port, nobody = pick_free_port(), pick_free_port()
    engine = start_llama_server(llama_server_binary, other_tiny_model, port, parallel=2)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as probe:
            await _until_healthy(probe)
        await service.start_pool(PoolConfig(
            models=(ModelEntry.for_file(str(tiny_model), settings=SMALL),),
            upstreams=(UpstreamEntry(f"http://127.0.0.1:{port}", kv_layout=KvLayout.SPLIT),
                       UpstreamEntry(f"http://127.0.0.1:{nobody}"))))
        await until(lambda: "elsewhere" in service.pool.names()
                    and service.pool.upstream_statuses()[1].error is not None)
        started = asyncio.Event()
        running = asyncio.create_task(stream_lines(client, chat("elsewhere", True, **LONG),
                                                   started))
        await started.wait()

        scraped = (await client.get("/metrics")).text
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for family in text_string_to_metric_families(scraped) for s in family.samples}

        def value(name: str, **labels: str) -> float:
            return samples[(name, tuple(sorted(labels.items())))]

        far = {"model": "elsewhere", "engine": "upstream 1"}
        here = {"model": "tiny", "engine": "this machine"}
        assert value("gguf_studio_engine_requests_active", **far) == 1
        assert value("gguf_studio_engine_requests_active", **here) == 0
        assert value("gguf_studio_engine_ready", **far) == value("gguf_studio_engine_ready",
                                                                 **here) == 1
        assert value("gguf_studio_engine_effective_parallel_slots", **far) == 2
        assert value("gguf_studio_engine_effective_parallel_slots", **here) == 1
        assert value("gguf_studio_engine_kv_reserved_tokens", **far) > 0
        assert value("gguf_studio_engine_kv_capacity_tokens", **here) == 2048
        assert value("gguf_studio_model_state", model="tiny", state="ready") == 1
        assert value("gguf_studio_model_requests_waiting", model="elsewhere") == 0
        # The counts carry the same labels: the running stream waited on upstream 1.
        assert value("gguf_studio_queue_wait_seconds_count", **far) == 1
        assert value("gguf_studio_requeues_total", **far) == 0
        assert "127.0.0.1" not in scraped  # no addresses

        answer = await client.get("/health")
        health = answer.json()
        engines = {m["id"]: [(e["where"], e["state"], e["slots"], e["active"]) for e in m["engines"]]
                   for m in health["models"]}
        assert engines == {"tiny": [("this machine", "ready", 1, 0)],
                           "elsewhere": [("upstream 1", "ready", 2, 1)]}
        upstreams = [(u["engine"], u["serving"], u["models"], u["slots"], u["active"])
                     for u in health["upstreams"]]
        assert upstreams == [("upstream 1", True, ["elsewhere"], 2, 1),
                             ("upstream 2", False, [], None, 0)]
        assert health["upstreams"][1]["error"] == "The upstream does not answer."
        assert str(port) not in answer.text and str(nobody) not in answer.text  # no addresses
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
    finally:
        stop(engine)


async def test_an_agent_configured_with_the_default_alias_keeps_working_when_the_owner_swaps_models(
        service, client, tiny_model, smollm2_model):
    """The window's snippets name the default model `default`; /v1/models offers it beside
    the real names.  After the owner loads another model (the window's one load), the same
    config reaches the new model, while the old file's name is a 404 as any unknown name."""
    from backend.app.sharing.snippets import ClientTarget, codex_snippet
    from backend.models.model_names import DEFAULT_MODEL_ALIAS
    import tomllib

    def configured_model() -> str:
        target = ClientTarget(f"http://127.0.0.1:{service.gateway_port}/v1", service.pool.default_model,
                              default_alias=DEFAULT_MODEL_ALIAS)
        return tomllib.loads(codex_snippet(target).text)["model"]

    await service.load(SMALL.to_spec(str(tiny_model), model_id="tiny"))
    agent = configured_model()
    assert agent == "default"
    listed = (await client.get("/v1/models")).json()["data"]
    assert [(m["id"], m.get("alias_of")) for m in listed] == [("tiny", None), ("default", "tiny")]
    first = await client.post("/v1/chat/completions", json=chat(agent))
    assert first.status_code == 200, first.text

    await service.load(SMALL.to_spec(str(smollm2_model), model_id="smol"))
    assert configured_model() == agent  # nothing to edit in the agent's config
    listed = (await client.get("/v1/models")).json()["data"]
    assert [(m["id"], m.get("alias_of")) for m in listed] == [("smol", None), ("default", "smol")]
    second = await client.post("/v1/chat/completions", json=chat(agent))
    assert second.status_code == 200, second.text
    assert "Paris" in second.json()["choices"][0]["message"]["content"]  # the trained model answered

    for unknown in ("tiny", "defaults"):
        gone = await client.post("/v1/chat/completions", json=chat(unknown))
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"


async def test_the_default_model_moves_only_when_the_owner_says_so(service, client, tiny_model,
                                                                  other_tiny_model):
    """A model added beside leaves `default` where it was; unloading the default model
    sends `default` to the model the owner names, and with none refuses its requests
    (503) rather than handing them to whichever model is left."""
    def answered_by(answer: httpx.Response) -> str:
        assert answer.status_code == 200, answer.text
        return str(answer.json()["model"])

    await service.load(SMALL.to_spec(str(tiny_model), model_id="tiny"))
    await service.add_model(ModelEntry.for_file(str(other_tiny_model), settings=SMALL))
    assert answered_by(await client.post("/v1/chat/completions", json=chat("default"))) == "tiny"
    question = service.unload_question()
    assert question is not None and question.others == ("other",)

    await service.unload()  # no new default named
    for named in (None, "default"):
        refused = await client.post("/v1/chat/completions", json=chat(named))
        assert refused.status_code == 503, refused.text
        assert "The default model (tiny) is not served right now" in refused.json()["error"]["message"]
    assert answered_by(await client.post("/v1/chat/completions", json=chat("other"))) == "other"

    await service.load(SMALL.to_spec(str(tiny_model), model_id="tiny"))
    await service.unload(new_default="other")
    assert answered_by(await client.post("/v1/chat/completions", json=chat(None))) == "other"


async def test_a_default_model_not_known_yet_is_not_stood_in_for_by_another(service, tiny_model):
    """`serve --default-model coder` where coder is an engine elsewhere's, before it
    answers: a request naming no model is not ready, never sent to the local model."""
    from backend.errors import ModelNotReady

    await service.start_pool(PoolConfig(models=(ModelEntry.for_file(
        str(tiny_model), settings=dataclasses.replace(SMALL), preload=False),),
        default_model="coder", upstreams=(UpstreamEntry(f"http://127.0.0.1:{pick_free_port()}"),)))
    assert service.pool.resolve("/v1/chat/completions", "tiny") == "tiny"
    with pytest.raises(ModelNotReady, match="default model .coder. is not served right now"):
        service.pool.resolve("/v1/chat/completions", None)


async def test_a_long_request_goes_to_the_engine_of_the_model_whose_context_fits_it(
        service, client, llama_server_binary, tiny_model):
    """Two engines of one model, 1,024 and 4,096 tokens a slot: a prompt of about 2,900
    tokens runs on the large one every time, though the small one comes first and is free."""
    small_port, large_port = pick_free_port(), pick_free_port()
    engines = [start_llama_server(llama_server_binary, tiny_model, small_port, parallel=1, ctx=1024),
               start_llama_server(llama_server_binary, tiny_model, large_port, parallel=1, ctx=4096)]
    try:
        await attach_llama_servers(service, [small_port, large_port], kv_layout=KvLayout.SPLIT)
        prompt = "a " * 2900
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{large_port}") as probe:
            tokens = len((await probe.post("/tokenize", json={"content": prompt})).json()["tokens"])
        assert 2800 <= tokens <= 3000
        for _ in range(3):
            answer = await client.post("/v1/completions", json={
                "model": "elsewhere", "prompt": prompt, "max_tokens": 8, "ignore_eos": True})
            assert answer.status_code == 200, answer.text
            assert answer.json()["usage"]["prompt_tokens"] >= 2800
    finally:
        for engine in engines:
            stop(engine)


async def test_a_plain_upstreams_waiters_wait_for_it_to_come_back_and_are_served(
        service, client, llama_server_binary, tiny_model):
    """The only engine of a model dies with requests waiting for it: they keep their place
    (within their queue timeout) and are answered once it is back."""
    port = pick_free_port()
    engine = start_llama_server(llama_server_binary, tiny_model, port, parallel=1)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as probe:
            await _until_healthy(probe)
        await service.attach_upstream(f"http://127.0.0.1:{port}")
        await until(lambda: len(service.registry.line("elsewhere").engines) == 1)
        started = asyncio.Event()
        running = asyncio.create_task(stream_lines(client, chat("elsewhere", True, **LONG), started))
        await started.wait()
        waiters = [asyncio.create_task(client.post(
            "/v1/chat/completions", json=chat("elsewhere", max_tokens=8, ignore_eos=True)))
            for _ in range(2)]
        await until(lambda: service.registry.total_waiting == 2)

        stop(engine)
        lines = await asyncio.wait_for(running, 60)  # the running one ends, saying why
        assert json.loads(lines[-2].removeprefix("data: "))["error"]["code"] in (
            "upstream_failed", "model_reloaded")
        await until(lambda: service.pool.upstream_statuses()[0].error is not None)
        assert service.registry.total_waiting == 2 and not any(w.done() for w in waiters)

        engine = start_llama_server(llama_server_binary, tiny_model, port, parallel=1)
        answers = await asyncio.wait_for(asyncio.gather(*waiters), 90)
        assert [a.status_code for a in answers] == [200, 200], [a.text for a in answers]
        assert all(a.json()["choices"][0]["finish_reason"] == "length" for a in answers)
    finally:
        if engine.poll() is None:
            stop(engine)


async def test_a_request_a_crashed_engine_refused_goes_back_in_line_and_is_served_on_its_return(
        service, client, llama_server_binary, tiny_model):
    """The crash requeue, made certain: the port does not yet know the engine is gone (its
    health is read once, then not again), so the request is admitted onto it, its
    connection is refused, and it goes back to its place (a requeue, counted) instead of
    failing; it is served once the engine is back."""
    port = pick_free_port()
    url = f"http://127.0.0.1:{port}"
    engine = start_llama_server(llama_server_binary, tiny_model, port, parallel=1)
    try:
        async with httpx.AsyncClient(base_url=url) as probe:
            await _until_healthy(probe)
        await service.attach_upstream(url)
        (watch,) = [backend for _name, backend in service.pool.backends()
                    if isinstance(backend, RemoteEngine)]
        watch.interval = 3600.0  # set before its first check: that check is its last
        await until(lambda: len(service.registry.line("elsewhere").engines) == 1)

        stop(engine)  # nothing tells the port: the next request is what finds out
        answer = asyncio.create_task(client.post(
            "/v1/chat/completions", json=chat("elsewhere", max_tokens=8, ignore_eos=True)))
        await until(lambda: service.metrics.totals()["requeues"] >= 1)
        assert not answer.done()  # refused by the dead engine, yet waiting: not an error

        engine = start_llama_server(llama_server_binary, tiny_model, port, parallel=1)
        await service.attach_upstream(url)  # watched again as usual: it rejoins when healthy
        served = await asyncio.wait_for(answer, 90)
        assert served.status_code == 200, served.text
        assert served.json()["choices"][0]["finish_reason"] == "length"
        assert service.metrics.totals()["requeues"] <= 5  # MAX_REQUEUES: then it would fail
    finally:
        if engine.poll() is None:
            stop(engine)
