"""Parked prefixes through the port, on the real engine: an agent's next turn after its
model was unloaded for idleness, or after the app restarted, computes almost nothing of
its prompt; a parked file that cannot be restored costs a plain prefill, nothing more.
Claude Code's turns (`/v1/messages`, which the engine cannot pin) find their prefix too."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import stat
import time
from pathlib import Path
from typing import Any, AsyncIterator

import httpx
import pytest

from backend.admission.session_book import SessionRequest, Sessions
from backend.app.pool.parking_steward import ParkingSteward
from backend.llama.api import engine_headers
from backend.llama.engine import Engine
from backend.llama.supervisor import Supervisor
from backend.app.pool.pool_config import ModelEntry, PoolConfig
from backend.app.pool.pool_status import Residency
from backend.app.service import PARKED_SLOTS_DIR, StudioService
from backend.keys.key_store import KeyStore
from backend.llama.load import LoadSettings
from backend.llama.slot_actions import SlotActionFailed, SlotClient
from backend.llama.slot_parking import INDEX_NAME, ParkingLot, ParkKey
from backend.settings import Settings
from tests.backend.service_harness import ServiceFactory
from tests.not_none import not_none

SETTINGS = LoadSettings(parallel="2", ctx_size=4096)
#: An agent's fixed head: about 1,500 tokens of instructions.
HEAD = " ".join(f"Rule {n}: read the file before editing it, and keep edit {n} small."
                for n in range(80))
#: A turn's tool output: about 250 tokens.
TOOL_OUTPUT = " ".join(f"test_{n} passed in 0.{n} seconds." for n in range(20))
#: A third of it: a short step, so that five turns of a session fit a slot.
STEP = TOOL_OUTPUT[: len(TOOL_OUTPUT) // 3]


async def test_the_first_turn_after_an_idle_unload_computes_little_of_its_prompt(
        studio: ServiceFactory, tiny_model):
    service = await serving_tiny(studio, tiny_model, idle_ttl=1.0)
    async with port(service) as client:
        first = await turn(client, "idle-1", 1)
        await unloaded_for_idleness(service)
        second = await turn(client, "idle-1", 2)
        third = await turn(client, "idle-1", 3)
    print(f"idle-TTL unload: turn 2 computed {second.computed} of {second.prompt} prompt tokens")
    assert first.computed == first.prompt  # the first turn: nothing to reuse
    assert second.computed <= 0.15 * second.prompt
    # Restored once: the next turn finds its prefix in its slot, not the older file.
    assert service.parking.counts["restored"] == 1
    assert third.computed <= second.computed


async def test_the_first_turn_after_the_app_restarts_computes_little_of_its_prompt(
        tmp_path, llama_server_binary, tiny_model, loose_umask):
    config = PoolConfig(models=(ModelEntry.for_file(str(tiny_model), settings=SETTINGS),))
    settings = Settings(port=0, llama_server=str(llama_server_binary), load_timeout=60)
    engine = Engine(data_dir=tmp_path / "data")
    before = StudioService(settings, engine=engine, log_dir=tmp_path / "logs")
    try:
        await before.start_gateway()
        await before.start_pool(config)
        async with port(before) as client:
            await turn(client, "restart-1", 1)
    finally:
        await before.close()  # `serve` stopping: its sessions are parked
    after = StudioService(settings, engine=engine, log_dir=tmp_path / "logs")
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


async def test_a_session_whose_slot_another_took_is_parked_from_the_ram_cache(
        studio: ServiceFactory, tiny_model):
    service = await serving_tiny(studio, tiny_model, idle_ttl=1.0)
    names = ("ram-a", "ram-b", "ram-c")
    # Half the usual head: three turns of tool output fit a slot's 2,048 tokens.
    heads = {name: f"You work for {name}. " + HEAD[: len(HEAD) // 2] for name in names}
    async with port(service) as client:
        for name in names:  # three sessions on two slots: one slot changes hands
            await turn(client, name, 1, head=heads[name], step=TOOL_OUTPUT)
        places = {s.key.split("\n")[-1]: s.slot for s in service.registry.sessions}
        assert sorted(places) == sorted(names) and list(places.values()).count(None) == 1
        await unloaded_for_idleness(service)
        # The agents come back together: the third restore goes into a slot whose
        # restored prefix has just served its turn.
        after = dict(zip(names, await asyncio.gather(*(
            turn(client, name, 2, head=heads[name], step=TOOL_OUTPUT) for name in names))))
        again = {name: await turn(client, name, 3, head=heads[name], step=TOOL_OUTPUT)
                 for name in names}
    print("after an idle unload, computed of prompt: "
          + ", ".join(f"{n} {f.computed}/{f.prompt}" for n, f in after.items())
          + "; the turn after: " + ", ".join(f"{n} {f.computed}/{f.prompt}"
                                            for n, f in again.items()))
    assert service.parking.counts["parked"] == 3
    assert service.parking.counts["recalled"] == 1  # from the RAM cache, not recomputed
    assert all(f.computed <= 0.25 * f.prompt for f in after.values())  # a fifth is new
    assert service.parking.counts["restored"] == 3
    # Each computes its step (and the answer before it), not the step before too.
    assert all(f.computed <= after[name].computed + 20 for name, f in again.items())


async def test_a_slot_that_cannot_be_vacated_costs_its_session_a_prefill_not_a_turn(
        studio: ServiceFactory, tiny_model, monkeypatch, caplog):
    vacated: list[int] = []

    async def refuse(self: SlotClient, slot: int) -> None:
        # An injected fault: the real engine answers a pinned one-token request.
        vacated.append(slot)
        raise SlotActionFailed("vacating a slot answered 503: no reason given")

    monkeypatch.setattr(SlotClient, "vacate", refuse)
    service = await serving_tiny(studio, tiny_model, idle_ttl=1.0)
    names = ("stuck-a", "stuck-b", "stuck-c")
    heads = {name: f"You work for {name}. " + HEAD[: len(HEAD) // 2] for name in names}
    async with port(service) as client:
        for name in names:
            await turn(client, name, 1, head=heads[name], step=TOOL_OUTPUT)
        await unloaded_for_idleness(service)
        after = dict(zip(names, await asyncio.gather(*(
            turn(client, name, 2, head=heads[name], step=TOOL_OUTPUT) for name in names))))
        again = {name: await turn(client, name, 3, head=heads[name], step=TOOL_OUTPUT)
                 for name in names}
    assert vacated, "no restore went into a slot another session held"
    assert "was not kept before a restore" in caplog.text
    # Every turn was served, and every restore took.  The session whose prefix was in
    # the slot computes its last turn's step again (two steps, not one), unless
    # llama-server had saved that slot to its RAM cache meanwhile (it saves every idle
    # slot when a task starts on another: half the runs here); never its whole prompt.
    assert service.parking.counts["restored"] == 3
    assert all(f.computed <= 0.25 * f.prompt for f in after.values())
    assert all(f.computed <= 2 * after[name].computed + 40 for name, f in again.items())
    assert all(f.computed <= 0.5 * f.prompt for f in again.values())


async def test_a_claude_code_session_computes_only_its_new_tokens(studio: ServiceFactory,
                                                                  tiny_model):
    # llama-server drops `id_slot` from `/v1/messages`: each turn goes to the engine's
    # least recently used slot, which alternates between the two here.
    service = await serving_tiny(studio, tiny_model)
    async with port(service) as client:
        figures = [await message_turn(client, "claude-1", n) for n in range(1, 6)]
    print(f"computed of prompt per turn: {figures}")
    for before, after in zip(figures, figures[1:]):
        assert after.computed <= after.prompt - before.prompt + 5, figures
    assert service.parking.counts["gathered"] >= 2


async def test_a_claude_code_turn_whose_prefix_could_not_be_gathered_is_served_all_the_same(
        studio: ServiceFactory, tiny_model, monkeypatch, caplog):
    """The move of a Claude Code session's prefix to the RAM cache fails (an injected
    fault: the real engine answers the pinned one-token request): each turn is served,
    the failure is logged, and a turn then recomputes more than its addition (the
    prefix stayed in a slot the engine does not look in)."""
    gathers: list[int] = []

    async def refuse(self: SlotClient, slot: int) -> None:
        gathers.append(slot)
        raise SlotActionFailed("vacating a slot answered 503: no reason given")

    monkeypatch.setattr(SlotClient, "vacate", refuse)
    service = await serving_tiny(studio, tiny_model)
    async with port(service) as client:
        figures = [await message_turn(client, "claude-1", n) for n in range(1, 5)]
    assert gathers, "no turn's prefix was to be moved"
    assert "was not moved to the RAM prompt cache" in caplog.text
    assert service.parking.counts["gathered"] == 0
    assert any(after.computed > after.prompt - before.prompt + 5
               for before, after in zip(figures, figures[1:])), figures


async def test_a_claude_code_sessions_turn_after_an_idle_unload_computes_little_of_its_prompt(
        studio: ServiceFactory, tiny_model):
    service = await serving_tiny(studio, tiny_model, idle_ttl=1.0)
    async with port(service) as client:
        await message_turn(client, "claude-idle", 1)
        await message_turn(client, "claude-idle", 2)
        await unloaded_for_idleness(service)
        after = [await message_turn(client, "claude-idle", n) for n in (3, 4)]
    print(f"after an idle unload, computed of prompt: {after}")
    assert service.parking.counts["restored"] == 1
    assert all(f.computed <= 0.15 * f.prompt for f in after), after


async def test_a_claude_code_session_whose_slot_another_took_is_parked_from_the_ram_cache(
        studio: ServiceFactory, tiny_model):
    service = await serving_tiny(studio, tiny_model, idle_ttl=1.0)
    heads = {name: f"You work for {name}. " + HEAD[: len(HEAD) // 3]
             for name in ("claude", "codex-a", "codex-b")}
    async with port(service) as client:
        first = await message_turn(client, "claude", 1, heads["claude"])
        for name in ("codex-a", "codex-b"):  # the second takes claude's slot
            await turn(client, name, 1, head=heads[name], step=STEP)
        places = {s.key.split("\n")[-1]: s.slot for s in service.registry.sessions}
        assert places["claude"] is None, places
        await unloaded_for_idleness(service)
        second = await message_turn(client, "claude", 2, heads["claude"])
    print(f"claude's turns, computed of prompt: {first}, then after an idle unload {second}")
    assert service.parking.counts["parked"] == 3
    assert service.parking.counts["recalled"] == 1
    assert second.computed <= second.prompt - first.prompt + 5


async def test_claude_code_and_codex_sessions_sharing_two_slots_compute_only_their_new_tokens(
        studio: ServiceFactory, tiny_model):
    service = await serving_tiny(studio, tiny_model)
    heads = {name: f"You work for {name}. " + HEAD[: len(HEAD) // 3]
             for name in ("claude", "codex-a", "codex-b")}

    async def take_turn(name: str, n: int) -> Figures:
        if name == "claude":
            return await message_turn(client, name, n, heads[name])
        return await turn(client, name, n, head=heads[name], step=STEP)

    async with port(service) as client:
        rounds = [{name: await take_turn(name, 1) for name in heads}]
        for n in (2, 3):  # one after another: each turn takes a slot from another session
            rounds.append({name: await take_turn(name, n) for name in heads})
        # All at once: one waits for a slot at the port.
        rounds.append(dict(zip(heads, await asyncio.gather(
            *(take_turn(name, 4) for name in heads)))))
    print("computed of prompt: " + "; ".join(
        ", ".join(f"{name} {f.computed}/{f.prompt}" for name, f in turns.items())
        for turns in rounds))
    for before, after in zip(rounds, rounds[1:]):
        for name, figures in after.items():
            # Its new step and the reply before it: about a tenth of its prompt.
            assert figures.computed <= figures.prompt - before[name].prompt + 5, rounds


async def test_a_parked_file_that_cannot_be_restored_costs_a_plain_prefill(
        studio: ServiceFactory, tiny_model):
    service = await serving_tiny(studio, tiny_model, idle_ttl=1.0)
    async with port(service) as client:
        await turn(client, "broken-1", 1)
        await unloaded_for_idleness(service)
        for parked in parked_files(service.parking):
            parked.write_bytes(parked.read_bytes()[: parked.stat().st_size // 3])
        second = await turn(client, "broken-1", 2)
        third = await turn(client, "broken-1", 3)
    assert second.computed == second.prompt  # served, with its whole prompt computed
    assert service.pool.status("tiny").residency is Residency.READY
    assert service.pool.snapshot("tiny").restarts == 0  # the engine never read the file
    assert third.computed <= 0.15 * third.prompt  # and the session is warm again


async def test_a_parked_prefix_the_turn_does_not_continue_is_not_restored(
        studio: ServiceFactory, tiny_model):
    service = await serving_tiny(studio, tiny_model, idle_ttl=1.0)
    async with port(service) as client:
        await turn(client, "rewritten-1", 1)
        await unloaded_for_idleness(service)
        parked = parked_files(service.parking)
        assert len(parked) == 1
        # The client rewrote its head (a timestamp at the start of the system prompt):
        # its turn does not continue the parked prompt, which is left where it is.
        second = await turn(client, "rewritten-1", 2, head="Today is Tuesday. " + HEAD)
        third = await turn(client, "rewritten-1", 3, head="Today is Tuesday. " + HEAD)
    assert second.computed >= 0.9 * second.prompt
    assert third.computed <= 0.15 * third.prompt  # the rewritten conversation is warm
    assert service.parking.counts == {"parked": 1, "recalled": 0, "restored": 0,
                                      "not_taken": 0, "park_failed": 0, "gathered": 0,
                                      "not_continued": 1, "not_parked": 0, "vacated": 0}
    assert parked_files(service.parking) == parked  # replaced when this one is parked


async def test_a_parked_prefix_is_restored_for_its_own_key_only(studio: ServiceFactory,
                                                                 tiny_model):
    service = await studio()
    _, alice = service.keys.add("alice")
    _, bob = service.keys.add("bob")
    await service.start_pool(PoolConfig(models=(
        ModelEntry.for_file(str(tiny_model), settings=SETTINGS, idle_ttl=1.0),)))
    async with port(service) as client:
        await turn(client, "shared-name", 1, key=alice)
        await unloaded_for_idleness(service)
        parked = parked_files(service.parking)
        # bob names the same session and sends the same conversation.
        await turn(client, "shared-name", 2, key=bob)
        bobs_counts = dict(service.parking.counts)
        await turn(client, "shared-name", 2, key=alice)
    assert len(parked) == 1 and parked_files(service.parking) == parked
    assert bobs_counts == {"parked": 1, "recalled": 0, "restored": 0, "not_taken": 0,
                           "park_failed": 0, "gathered": 0, "not_continued": 0,
                           "not_parked": 0, "vacated": 0}
    assert service.parking.counts["restored"] == 1  # alice's own turn got it


async def test_a_revoked_keys_parked_prefixes_and_sessions_go_with_it_and_no_one_elses(
        studio: ServiceFactory, tiny_model):
    service = await studio()
    _, alice = service.keys.add("alice")
    _, bob = service.keys.add("bob")
    await service.start_pool(PoolConfig(models=(
        ModelEntry.for_file(str(tiny_model), settings=SETTINGS, idle_ttl=1.0),)))
    async with port(service) as client:
        await turn(client, "alice-1", 1, key=alice)
        await turn(client, "bob-1", 1, key=bob)
        await unloaded_for_idleness(service)
        assert len(parked_files(service.parking)) == 2
        # `gguf-studio keys revoke alice`, from another process: the keys file changes.
        KeyStore(service.keys.path).revoke("alice")
        await until(lambda: len(parked_files(service.parking)) == 1)
        assert service.registry.sessions.flows() == ["bob"]
        await turn(client, "bob-1", 2, key=bob)
    assert service.parking.counts["restored"] == 1  # bob's prefix was left where it was


async def test_with_no_days_to_keep_them_nothing_is_parked(studio: ServiceFactory, tiny_model):
    service = await studio(parked_slots_days=0)
    await service.start_pool(PoolConfig(models=(
        ModelEntry.for_file(str(tiny_model), settings=SETTINGS, idle_ttl=1.0),)))
    async with port(service) as client:
        await turn(client, "kept-0-days", 1)
        await unloaded_for_idleness(service)
    assert parked_files(service.parking) == [] and service.parking.counts["parked"] == 0


async def test_an_isolated_model_parks_nothing(studio: ServiceFactory, tiny_model):
    service = await studio()
    await service.start_pool(PoolConfig(models=(ModelEntry.for_file(
        str(tiny_model), settings=SETTINGS, idle_ttl=1.0, isolated=True),)))
    async with port(service) as client:
        await turn(client, "isolated-1", 1)
        await unloaded_for_idleness(service)
        await turn(client, "isolated-1", 2)
    assert parked_files(service.parking) == []
    assert service.parking.counts["parked"] == 0


async def test_a_parking_directory_that_cannot_be_made_leaves_serving_alone(
        studio: ServiceFactory, tiny_model, tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / PARKED_SLOTS_DIR).write_text("a file where the directory would go")
    service = await serving_tiny(studio, tiny_model, idle_ttl=1.0)
    async with port(service) as client:
        await turn(client, "no-dir-1", 1)
        await unloaded_for_idleness(service)
        second = await turn(client, "no-dir-1", 2)
    assert second.computed == second.prompt  # served as without parking
    assert service.parking.counts["parked"] == 0


async def test_an_engine_that_does_not_answer_its_save_stops_within_the_bound(
        studio: ServiceFactory, tiny_model):
    service = await studio(stop_timeout=1.0)
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


async def test_with_the_session_table_the_sessions_in_slots_are_the_ones_parked(
        tmp_path, llama_server_binary, tiny_model):
    entry = ModelEntry.for_file(str(tiny_model), settings=SETTINGS)
    table = Sessions()
    steward = ParkingSteward(ParkingLot(tmp_path / "slots"), entry_of=lambda name: entry,
                             sessions=table)
    supervisor = Supervisor(llama_server_binary, tmp_path, load_timeout=120, stop_timeout=5,
                            slot_save_dir=steward.lot.open)
    try:
        engine = await supervisor.load(SETTINGS.to_spec(str(tiny_model)))
        assert engine.serving is not None
        async with httpx.AsyncClient(headers=engine_headers(engine.serving.api_key),
                                     timeout=120) as client:
            for slot in (0, 1):
                answer = await client.post(f"{engine.serving.base_url}/completion", json={
                    "prompt": HEAD, "n_predict": 1, "id_slot": slot})
                assert answer.status_code == 200, answer.text
        key = engine.serving.key
        # What its prompt was: a parked prefix is restored only into a turn continuing it.
        table.record("alice\na", flow="alice", engine=key, slot=0)
        table.remember(ParkKey(not_none(steward.identity("tiny", key)), "alice", "alice\na"),
                       SessionRequest("/v1/completions", json.dumps({"prompt": HEAD}).encode()))
        table.record("bob\nb", flow="bob", engine=key, slot=None)  # in no known slot
        table.record("carol\nc", flow="carol", engine="elsewhere", slot=1)
        assert await steward.park("tiny", engine.serving) == 1
    finally:
        await supervisor.unload()
    identity = steward.identity("tiny", "after a restart")
    assert identity is not None
    assert steward.lot.find(ParkKey(identity, "alice", "alice\na")) is not None
    assert steward.lot.find(ParkKey(identity, "bob", "bob\nb")) is None
    assert steward.lot.find(ParkKey(identity, "carol", "carol\nc")) is None


# --- helpers -----------------------------------------------------------------------------


@pytest.fixture
async def studio(tmp_path: Path, llama_server_binary: Path) -> AsyncIterator[ServiceFactory]:
    """`await studio(**settings)`: a service with its port open and a data dir (so a
    parking directory) of the test's own; closed when the test ends."""
    async with contextlib.AsyncExitStack() as stack:
        async def start(**settings: Any) -> StudioService:
            chosen: dict[str, Any] = {"port": 0, "llama_server": str(llama_server_binary),
                                      "load_timeout": 60, **settings}
            service = StudioService(Settings(**chosen), engine=Engine(data_dir=tmp_path / "data"),
                                    log_dir=tmp_path / "logs")
            stack.push_async_callback(service.close)
            await service.start_gateway()
            return service
        yield start


async def serving_tiny(studio: ServiceFactory, model: Path, *,
                       idle_ttl: float = 0.0) -> StudioService:
    """A service whose pool serves the tiny model on 2 slots (`SETTINGS`)."""
    service = await studio()
    await service.start_pool(PoolConfig(models=(
        ModelEntry.for_file(str(model), settings=SETTINGS, idle_ttl=idle_ttl),)))
    return service


async def unloaded_for_idleness(service: StudioService) -> None:
    await until(lambda: service.pool.status("tiny").residency is Residency.EVICTED)


class Figures:
    def __init__(self, timings: dict[str, int]) -> None:
        self.computed = timings["prompt_n"]
        self.prompt = timings["prompt_n"] + timings["cache_n"]

    def __repr__(self) -> str:
        return f"{self.computed}/{self.prompt}"


def port(service: StudioService) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=f"http://127.0.0.1:{service.gateway_port}", timeout=120)


async def turn(client: httpx.AsyncClient, session: str, n: int, head: str = HEAD,
               key: str | None = None, step: str = "edit the next file.") -> Figures:
    """Turn `n` of an agent's session: its head, the turns before, one new `step`.  With
    a named `key` the answer tells nothing of the cache: its figures are then zeros."""
    messages = [{"role": "system", "content": head}]
    for earlier in range(1, n):
        messages += [{"role": "user", "content": f"Step {earlier}: {step}"},
                     {"role": "assistant", "content": f"Done with step {earlier}."}]
    messages.append({"role": "user", "content": f"Step {n}: {step}"})
    answer = await client.post("/v1/chat/completions", json={
        "model": "tiny", "messages": messages, "max_tokens": 2, "temperature": 0,
        "prompt_cache_key": session}, headers={"authorization": f"Bearer {key}"} if key else {})
    assert answer.status_code == 200, answer.text
    return Figures(answer.json().get("timings", {"prompt_n": 0, "cache_n": 0}))


async def message_turn(client: httpx.AsyncClient, session: str, n: int,
                       head: str = HEAD[: len(HEAD) // 2]) -> Figures:
    """Turn `n` of a Claude Code session (`/v1/messages`), each step a third of a tool's
    output."""
    messages = []
    for earlier in range(1, n):
        messages += [{"role": "user", "content": f"Step {earlier}: {STEP}"},
                     {"role": "assistant", "content": f"Done with step {earlier}."}]
    messages.append({"role": "user", "content": f"Step {n}: {STEP}"})
    answer = await client.post("/v1/messages", json={
        "model": "tiny", "system": head, "messages": messages, "max_tokens": 2,
        "temperature": 0}, headers={"x-claude-code-session-id": session})
    assert answer.status_code == 200, answer.text
    usage = answer.json()["usage"]
    return Figures({"prompt_n": usage["input_tokens"],
                    "cache_n": usage.get("cache_read_input_tokens", 0)})


def parked_files(steward: ParkingSteward) -> list[Path]:
    return [p for p in steward.lot.directory.iterdir() if p.name != INDEX_NAME]


async def until(predicate, timeout: float = 60.0) -> None:
    """Poll the running system (residency has no event here)."""
    async def poll() -> None:
        while not predicate():
            await asyncio.sleep(0.02)
    await asyncio.wait_for(poll(), timeout)
