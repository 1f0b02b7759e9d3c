"""`serve --upstream URL`: the port in front of a llama-server that runs elsewhere."""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

import httpx
import pytest

from backend.errors import SettingsError
from backend.llama.kv_capacity import KvCapacity
from backend.app.service import StudioService
from backend.settings import Settings
from backend.llama.load import Snapshot, State
from backend.llama.supervisor import pick_free_port
from backend.llama.remote_engine import normalise_base_url


def start_llama_server(binary: Path, model: Path, port: int, parallel: int,
                       extra: tuple[str, ...] = ()) -> subprocess.Popen:
    return subprocess.Popen(
        [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
         "-np", str(parallel), "-c", "2048", "--alias", "elsewhere", "--no-webui", *extra],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


@pytest.fixture
async def attached(tmp_path, llama_server_binary, tiny_model):
    port = pick_free_port()
    engine = start_llama_server(llama_server_binary, tiny_model, port, parallel=3)
    service = StudioService(Settings(port=0), log_dir=tmp_path / "logs")
    snapshots: list[Snapshot] = []
    changed = asyncio.Event()

    def on_snapshot(s: Snapshot) -> None:
        snapshots.append(s)
        changed.set()

    async def until(predicate) -> Snapshot:
        async def wait():
            while not (snapshots and predicate(snapshots[-1])):
                changed.clear()
                await changed.wait()
            return snapshots[-1]
        return await asyncio.wait_for(wait(), 60)

    service.add_listener(on_snapshot)
    await service.start_gateway()
    await service.attach_upstream(f"http://127.0.0.1:{port}/v1/")
    try:
        yield service, until, port, engine
    finally:
        await service.close()
        engine.kill()
        engine.wait()


async def test_attached_engine_is_served_with_its_slots_after_it_turns_healthy(attached):
    service, until, port, _engine = attached
    ready = await until(lambda s: s.state is State.READY)
    assert ready.serving.slots == 3
    # -np 3 -c 2048: 768 tokens per slot; /props cannot say whether the cache is shared,
    # so the port assumes one pool of one slot's context (never more than the engine has).
    assert ready.serving.kv == KvCapacity(768, 768, unified=True)
    assert service.registry.kv_capacity == 768
    assert ready.model_id == "elsewhere"
    assert service.registry.current.capacity == 3
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{service.gateway_port}") as client:
        answer = await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}, timeout=60)
    assert answer.status_code == 200
    assert answer.json()["choices"][0]["finish_reason"] == "length"


async def test_an_attached_engine_that_goes_away_and_comes_back_is_followed(
        attached, llama_server_binary, tiny_model):
    service, until, port, engine = attached
    await until(lambda s: s.state is State.READY)
    engine.kill()
    engine.wait()
    gone = await until(lambda s: s.state is not State.READY)
    assert gone.restarting and gone.serving is None
    assert service.registry.current is None
    again = start_llama_server(llama_server_binary, tiny_model, port, parallel=2)
    try:
        back = await until(lambda s: s.state is State.READY)
        assert back.serving.slots == 2  # slots read again
        assert back.serving.kv == KvCapacity(1024, 1024, unified=True)  # and the cache
        assert service.registry.current.capacity == 2
    finally:
        again.kill()
        again.wait()


async def test_an_attached_engine_that_requires_a_key_is_served_with_it(
        tmp_path, llama_server_binary, tiny_model):
    port = pick_free_port()
    key_file = tmp_path / "upstream.key"
    key_file.write_text("upstream-secret\n")
    engine = start_llama_server(llama_server_binary, tiny_model, port, parallel=2,
                                extra=("--api-key-file", str(key_file)))
    service = StudioService(Settings(port=0), log_dir=tmp_path / "logs")
    ready = asyncio.Event()
    service.add_listener(lambda s: ready.set() if s.state is State.READY else None)
    try:
        await service.start_gateway()
        await service.attach_upstream(f"http://127.0.0.1:{port}", api_key="upstream-secret")
        await asyncio.wait_for(ready.wait(), 60)
        assert service.snapshot().serving.slots == 2  # /props needs the key
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{service.gateway_port}") as client:
            answer = await client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}, timeout=60)
        assert answer.status_code == 200, answer.text
    finally:
        await service.close()
        engine.kill()
        engine.wait()


@pytest.mark.parametrize("given, expected", [
    ("http://10.0.0.5:8080", "http://10.0.0.5:8080"),
    ("http://10.0.0.5:8080/", "http://10.0.0.5:8080"),
    ("http://10.0.0.5:8080/v1", "http://10.0.0.5:8080"),
    (" https://gpu-box/llama/v1/ ", "https://gpu-box/llama"),
])
def test_upstream_urls_are_normalised_to_the_servers_root(given, expected):
    assert normalise_base_url(given) == expected


@pytest.mark.parametrize("bad", ["10.0.0.5:8080", "ftp://host", "http://"])
def test_an_unusable_upstream_url_is_refused_clearly(bad):
    with pytest.raises(SettingsError, match="http"):
        normalise_base_url(bad)
