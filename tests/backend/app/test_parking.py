"""Parked prefixes through the port, on the real engine: an agent's next turn after its
model was unloaded for idleness, or after the app restarted, computes almost nothing of
its prompt; a parked file that cannot be restored costs a plain prefill, nothing more."""

from __future__ import annotations

import asyncio
import os
import signal
import stat
import time
from pathlib import Path

import httpx

from backend.app.parking import ParkingSteward
from backend.app.pool_config import ModelEntry, PoolConfig
from backend.app.pool_status import Residency
from backend.app.service import PARKED_SLOTS_DIR, StudioService
from backend.llama.load import LoadSettings
from backend.llama.slot_parking import INDEX_NAME
from backend.settings import Settings
from tests.backend.service_harness import ServiceFactory

SETTINGS = LoadSettings(parallel="2", ctx_size=4096)
#: An agent's fixed head: about 1,500 tokens of instructions.
HEAD = " ".join(f"Rule {n}: read the file before editing it, and keep edit {n} small."
                for n in range(80))


async def test_the_first_turn_after_an_idle_unload_computes_little_of_its_prompt(
        running_service: ServiceFactory, tiny_model):
    service = await running_service()
    await service.start_pool(PoolConfig(models=(
        ModelEntry.for_file(str(tiny_model), settings=SETTINGS, idle_ttl=1.0),)))
    async with port(service) as client:
        first = await turn(client, "idle-1", 1)
        await until(lambda: service.pool.status("tiny").residency is Residency.EVICTED)
        second = await turn(client, "idle-1", 2)
    print(f"idle-TTL unload: turn 2 computed {second.computed} of {second.prompt} prompt tokens")
    assert first.computed == first.prompt  # the first turn: nothing to reuse
    assert second.computed <= 0.15 * second.prompt
    assert service.parking.counts["restored"] == 1


async def test_the_first_turn_after_the_app_restarts_computes_little_of_its_prompt(
        tmp_path, llama_server_binary, tiny_model):
    config = PoolConfig(models=(ModelEntry.for_file(str(tiny_model), settings=SETTINGS),))
    settings = Settings(port=0, llama_server=str(llama_server_binary), load_timeout=60)
    before = StudioService(settings, log_dir=tmp_path / "logs")
    try:
        await before.start_gateway()
        await before.start_pool(config)
        async with port(before) as client:
            await turn(client, "restart-1", 1)
    finally:
        await before.close()  # `serve` stopping: its sessions are parked
    after = StudioService(settings, log_dir=tmp_path / "logs")
    try:
        await after.start_gateway()
        await after.start_pool(config)
        async with port(after) as client:
            second = await turn(client, "restart-1", 2)
    finally:
        await after.close()
    print(f"serve restart: turn 2 computed {second.computed} of {second.prompt} prompt tokens")
    assert second.computed <= 0.15 * second.prompt
    slots = after.engine.data_dir / PARKED_SLOTS_DIR
    assert stat.S_IMODE(slots.stat().st_mode) == 0o700
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in slots.iterdir())


async def test_a_parked_file_that_cannot_be_restored_costs_a_plain_prefill(
        running_service: ServiceFactory, tiny_model):
    service = await running_service()
    await service.start_pool(PoolConfig(models=(
        ModelEntry.for_file(str(tiny_model), settings=SETTINGS, idle_ttl=1.0),)))
    async with port(service) as client:
        await turn(client, "broken-1", 1)
        await until(lambda: service.pool.status("tiny").residency is Residency.EVICTED)
        for parked in parked_files(service.parking):
            parked.write_bytes(parked.read_bytes()[: parked.stat().st_size // 3])
        second = await turn(client, "broken-1", 2)
        third = await turn(client, "broken-1", 3)
    assert second.computed == second.prompt  # served, with its whole prompt computed
    assert service.pool.status("tiny").residency is Residency.READY
    assert service.pool.snapshot("tiny").restarts == 0  # the engine never read the file
    assert third.computed <= 0.15 * third.prompt  # and the session is warm again


async def test_an_engine_that_does_not_answer_its_save_stops_within_the_bound(
        running_service: ServiceFactory, tiny_model):
    service = await running_service(stop_timeout=1.0)
    service.parking.time_limit = 1.0
    await service.start_pool(PoolConfig(models=(
        ModelEntry.for_file(str(tiny_model), settings=SETTINGS),)))
    async with port(service) as client:
        await turn(client, "hung-1", 1)
    pid = service.pool.snapshot("tiny").pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)  # hung: it takes the save request and never answers
    started = time.monotonic()
    await service.unload_model("tiny")
    took = time.monotonic() - started
    # The save's bound, then SIGTERM's wait, then SIGKILL: not the save's own timeout.
    assert took < 1.0 + 1.0 + 3.0, took
    assert service.parking.counts["park_failed"] == 1
    assert service.pool.status("tiny").residency is Residency.UNLOADED


# --- helpers -----------------------------------------------------------------------------


class Figures:
    def __init__(self, timings: dict[str, int]) -> None:
        self.computed = timings["prompt_n"]
        self.prompt = timings["prompt_n"] + timings["cache_n"]


def port(service: StudioService) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=f"http://127.0.0.1:{service.gateway_port}", timeout=120)


async def turn(client: httpx.AsyncClient, session: str, n: int) -> Figures:
    """Turn `n` of an agent's session: its head, the turns before, one new line."""
    messages = [{"role": "system", "content": HEAD}]
    for earlier in range(1, n):
        messages += [{"role": "user", "content": f"Step {earlier}: edit the next file."},
                     {"role": "assistant", "content": f"Done with step {earlier}."}]
    messages.append({"role": "user", "content": f"Step {n}: edit the next file."})
    answer = await client.post("/v1/chat/completions", json={
        "model": "tiny", "messages": messages, "max_tokens": 2, "temperature": 0,
        "prompt_cache_key": session})
    assert answer.status_code == 200, answer.text
    return Figures(answer.json()["timings"])


def parked_files(steward: ParkingSteward) -> list[Path]:
    return [p for p in steward.lot.directory.iterdir() if p.name != INDEX_NAME]


async def until(predicate, timeout: float = 60.0) -> None:
    """Poll the running system (residency has no event here)."""
    async def poll() -> None:
        while not predicate():
            await asyncio.sleep(0.02)
    await asyncio.wait_for(poll(), timeout)
