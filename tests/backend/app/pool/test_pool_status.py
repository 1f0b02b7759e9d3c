"""What /health says about a pool, with real engines: ready while the default model has an
engine that serves (one engine of two killed: still 200, the survivor's slots, the dead
one named), the state only for a client off this machine without the key, and errors
without the paths and addresses a raw load error names."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from backend.addresses import lan_addresses
from backend.errors import LoadError
from backend.app.pool.pool_config import ModelEntry, PoolConfig
from backend.app.pool.pool_status import scrubbed
from backend.app.service import StudioService
from backend.llama.kv_capacity import KvLayout
from backend.llama.load import LoadSettings
from backend.llama.supervisor import pick_free_port
from tests.backend.app.pool.test_pool import attach_llama_servers, until
from tests.backend.llama.test_remote_engine import start_llama_server, stop
from tests.backend.service_harness import ServiceFactory

KEY = "sk-health-key-0123456789"
SMALL = LoadSettings(parallel="1", ctx_size=2048)


@pytest.fixture
async def service(running_service: ServiceFactory) -> StudioService:
    return await running_service(queue_timeout=60)


CHAT = {"model": "elsewhere", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


async def test_one_engine_of_two_killed_leaves_health_ready_with_the_survivor_and_names_the_dead(
        service: StudioService, llama_server_binary: Path, tiny_model: Path) -> None:
    ports = [pick_free_port(), pick_free_port()]
    engines = [start_llama_server(llama_server_binary, tiny_model, port, parallel=slots, ctx=2048 * slots)
               for port, slots in zip(ports, (2, 3))]
    try:
        await attach_llama_servers(service, ports, kv_layout=KvLayout.SPLIT)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{service.gateway_port}",
                                     timeout=60) as client:
            both = await client.get("/health")
            assert both.status_code == 200, both.text
            assert both.json()["state"] == "ready" and both.json()["model"] == "elsewhere"
            assert both.json()["effective_parallel_slots"] == 5  # the pool's, not the first engine's
            assert both.json()["kv"]["total"] == 2 * 2048 + 3 * 2048
            assert (both.json()["degraded"], both.json()["engines_out"]) == (False, [])

            stop(engines[0])  # SIGKILL: upstream 1 is out, upstream 2 serves every request
            await until(lambda: service.pool.upstream_statuses()[0].error is not None)
            assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200
            answer = await client.get("/health")
            assert answer.status_code == 200, answer.text  # a balancer keeps the port
            health = answer.json()
            assert (health["state"], health["model"]) == ("ready", "elsewhere")
            assert health["effective_parallel_slots"] == 3  # upstream 2's
            assert health["kv"]["total"] == 3 * 2048
            assert health["degraded"] is True
            assert [(e["engine"], e["model"]) for e in health["engines_out"]] == [
                ("upstream 1", "elsewhere")]
            assert health["engines_out"][0]["error"]
            assert str(ports[0]) not in answer.text and "127.0.0.1" not in answer.text

            stop(engines[1])  # nothing serves the default model now: 503
            await until(lambda: all(u.error is not None for u in service.pool.upstream_statuses()))
            none = await client.get("/health")
            assert none.status_code == 503 and none.json()["state"] != "ready"
            assert [e["engine"] for e in none.json()["engines_out"]] == ["upstream 1", "upstream 2"]
    finally:
        for engine in engines:
            if engine.poll() is None:
                stop(engine)


@pytest.fixture
async def keyed_lan_service(running_service: ServiceFactory) -> StudioService:
    return await running_service(host="0.0.0.0", api_key=KEY)


def non_loopback_address() -> str:
    found = [a for a in lan_addresses() if not a.startswith("127.") and ":" not in a]
    if not found:
        pytest.skip("this machine has no IPv4 address besides loopback")
    return found[0]


async def test_keyless_health_off_this_machine_says_the_state_only_and_errors_are_scrubbed(
        keyed_lan_service: StudioService, tiny_model: Path, tmp_path: Path) -> None:
    service = keyed_lan_service
    worker = f"127.0.0.1:{pick_free_port()}"  # an RPC worker nobody runs: its load fails
    spread = tmp_path / "private-models" / "spread.gguf"
    spread.parent.mkdir()
    spread.symlink_to(tiny_model)
    await service.start_pool(PoolConfig(models=(
        ModelEntry.for_file(str(tiny_model), settings=SMALL, preload=True),
        ModelEntry.for_file(str(spread), name="spread",
                            settings=LoadSettings(parallel="1", ctx_size=2048, rpc=(worker,)),
                            preload=False))))
    with pytest.raises(LoadError):
        await service.load_model("spread")
    await until(lambda: service.pool.status("spread").error is not None)
    assert worker in str(service.pool.status("spread").error)  # what the window shows its owner

    lan = f"http://{non_loopback_address()}:{service.gateway_port}"
    async with httpx.AsyncClient(base_url=lan, timeout=30, trust_env=False) as stranger:
        keyless = await stranger.get("/health")
        assert keyless.status_code == 200
        assert keyless.json() == {"state": "ready"}  # no models, counts, errors or engines
        wrong = await stranger.get("/health", headers={"Authorization": "Bearer sk-wrong-key-0000"})
        assert wrong.json() == {"state": "ready"}
        keyed = await stranger.get("/health", headers={"Authorization": f"Bearer {KEY}"})
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{service.gateway_port}",
                                 timeout=30) as here:
        local = await here.get("/health")  # a probe on this machine reads it all
    for answer in (keyed, local):
        health = answer.json()
        assert answer.status_code == 200 and health["state"] == "ready"
        assert [m["id"] for m in health["models"]] == ["tiny", "spread"]
        assert [(e["engine"], e["model"]) for e in health["engines_out"]] == [("this machine", "spread")]
        failed = next(m for m in health["models"] if m["id"] == "spread")
        assert failed["state"] == "failed" and failed["error"]
        for private in (worker, str(spread), str(tmp_path), str(tiny_model.parent), "private-models"):
            assert private not in answer.text, private


@pytest.mark.parametrize("raw, shown", [
    ("RPC worker 192.168.1.7:50052 does not answer", "RPC worker <address> does not answer"),
    ("failed to open GGUF file '/home/ann/models/secret.gguf'", "failed to open GGUF file '<path>'"),
    ("could not reach http://ann:pw@gpu-box.lan:8080/v1", "could not reach <address>"),
    ("worker gpu-box.lan:50052 refused", "worker <address> refused"),
    ("at [fe80::1]:50052 and fd00::2", "at <address> and <address>"),
    (r"C:\Users\ann\model.gguf is missing", "<path> is missing"),
    ("The upstream does not answer.", "The upstream does not answer."),
    ("Out of memory at 12:30: 3.5 GiB more", "Out of memory at 12:30: 3.5 GiB more"),
])
def test_errors_lose_their_addresses_and_paths(raw: str, shown: str) -> None:
    assert scrubbed(raw) == shown
