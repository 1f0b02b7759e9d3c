"""Placement through a real service in front of real llama-servers: swapping the line's
policy changes which engine and which slot run a request, and a pinned seat's slot id
reaches the engine as `id_slot`; the hash ring, named in the settings, sends each session
to its engine on the ring; any policy hears a turn's life."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

from backend.app.service import StudioService
from backend.llama.kv_capacity import KvLayout
from backend.llama.supervisor import pick_free_port
from backend.admission.hash_ring import HashRing
from backend.admission.placement import KeepPrefixes, MostFreeSlots, Placeable, Placement
from backend.admission.seat import Seat, SeatEngine
from backend.admission.session_book import Session
from tests.backend.llama.test_remote_engine import _until_healthy, start_llama_server, stop
from tests.backend.service_harness import ServiceFactory

E = TypeVar("E", bound=SeatEngine)
MODEL = "elsewhere"  # the alias `start_llama_server` gives


class LastEngine(Placement):
    def place(self, ticket: Placeable, engines: Sequence[E]) -> Seat[E] | None:
        last = engines[-1]
        return last.lowest_free_seat() if last.has_room(ticket.need) else None


class SessionOnSlotZero(Placement):
    """A session named "agent-1" (in its caller's flow) runs on slot 0, pinned."""

    def place(self, ticket: Placeable, engines: Sequence[E]) -> Seat[E] | None:
        engine = engines[0]
        if (ticket.hint.session or "").endswith("\nagent-1"):
            return Seat(engine, 0, pinned=True) if engine.slot_free(0) else None
        return engine.lowest_free_seat() if engine.has_room(ticket.need) else None


@pytest.fixture
async def service(running_service: ServiceFactory) -> StudioService:
    return await running_service(queue_timeout=60)


async def engines_serving(service: StudioService, binary: Path, model: Path,
                          n: int) -> tuple[list[Any], list[int]]:
    ports = [pick_free_port() for _ in range(n)]
    processes = [start_llama_server(binary, model, port, parallel=2, ctx=2048) for port in ports]
    for port in ports:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as probe:
            await _until_healthy(probe)
        # One at a time: the line's engines keep the order they joined.
        await service.attach_upstream(f"http://127.0.0.1:{port}", kv_layout=KvLayout.SPLIT)
        await until_engines(service, len(processes[:ports.index(port) + 1]))
        _PROBED[port] = await _last_tasks(port)
    return processes, ports


#: Each engine's last task per slot once it joined: the port asks a joining llama-server
#: what it keeps of a prompt (`backend.llama.prefix_probe`), on its last slot.
_PROBED: dict[int, dict[int, int]] = {}


async def _last_tasks(port: int) -> dict[int, int]:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as engine:
        slots = (await engine.get("/slots")).json()
    return {slot["id"]: slot.get("id_task", -1) for slot in slots}


async def until_engines(service: StudioService, n: int, timeout: float = 60) -> None:
    import asyncio
    async with asyncio.timeout(timeout):
        while len(service.registry.line(MODEL).engines) < n:
            await asyncio.sleep(0.02)


async def slots_that_ran(port: int) -> list[int]:
    """The slot ids of the engine at `port` that have run a task since it joined."""
    probed = _PROBED.get(port, {})
    return [slot for slot, task in (await _last_tasks(port)).items()
            if task >= 0 and task != probed.get(slot, -1)]


async def ask(service: StudioService, **extra: Any) -> None:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{service.gateway_port}",
                                 timeout=60) as client:
        answer = await client.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "Hello"}],
            "max_tokens": 4, **extra.pop("body", {})}, **extra)
    assert answer.status_code == 200, answer.text


async def test_the_policy_always_the_last_engine_sends_requests_to_the_second_llama_server(
        service: StudioService, llama_server_binary: Path, tiny_model: Path) -> None:
    processes, ports = await engines_serving(service, llama_server_binary, tiny_model, 2)
    try:
        await ask(service)  # the default: the first engine (both have every slot free)
        first = await slots_that_ran(ports[0])
        assert len(first) == 1 and await slots_that_ran(ports[1]) == []

        service.registry.line(MODEL).placement = LastEngine()
        for _ in range(3):
            await ask(service)
        assert await slots_that_ran(ports[0]) == first  # nothing more ran there
        assert await slots_that_ran(ports[1]) != []
    finally:
        for process in processes:
            stop(process)


async def test_a_pinned_seat_reaches_the_engine_as_id_slot(
        service: StudioService, llama_server_binary: Path, tiny_model: Path) -> None:
    processes, (port,) = await engines_serving(service, llama_server_binary, tiny_model, 1)
    try:
        service.registry.line(MODEL).placement = SessionOnSlotZero()
        # The session header (then the body's key) names the session; the port's choice
        # of slot 0 reaches llama-server, whose own choice among idle slots is slot 1.
        await ask(service, headers={"x-session-id": "agent-1"})
        assert await slots_that_ran(port) == [0]
        await ask(service, body={"prompt_cache_key": "agent-1",
                                 "messages": [{"role": "user", "content": "Other words"}]})
        assert await slots_that_ran(port) == [0]
    finally:
        for process in processes:
            stop(process)


async def session_turn(service: StudioService, session: str) -> None:
    await ask(service, headers={"x-session-id": session},
              body={"messages": [{"role": "user", "content": f"Hello from {session}"}]})


async def test_the_hash_ring_sends_each_session_to_its_engine_on_the_ring_whatever_the_load(
        running_service: ServiceFactory, llama_server_binary: Path, tiny_model: Path) -> None:
    service = await running_service(queue_timeout=60, placement="hash-ring")
    processes, ports = await engines_serving(service, llama_server_binary, tiny_model, 2)
    try:
        line = service.registry.line(MODEL)
        ring = line.placement
        assert isinstance(ring, HashRing)
        first, second = line.engines
        assert first.label != second.label  # the records name each
        await session_turn(service, "probe")
        flow = service.registry.sessions.snapshot()[0].flow  # whose sessions they are
        names = [f"agent-{n}" for n in range(40)]
        on_second = [n for n in names if ring.engine_of(f"{flow}\n{n}", [first, second]) is second]
        on_first = [n for n in names if n not in on_second]
        assert len(on_second) >= 4 and on_first
        # Three new sessions that fall to the second engine all go there, though the
        # first holds fewer sessions (where the default would send a new one).
        for name in on_second[:3]:
            await session_turn(service, name)
        await session_turn(service, on_first[0])
        for name in (*on_second[:3], on_first[0]):  # and their next turns stay
            await session_turn(service, name)
        ran = {(r.session, r.engine) for r in service.requests.records() if r.session != "probe"}
        assert ran == {*((n, second.label) for n in on_second[:3]), (on_first[0], first.label)}
        assert all(r.status == 200 for r in service.requests.records())
        # The engines themselves say so: both ran tasks.
        assert await slots_that_ran(ports[0]) and await slots_that_ran(ports[1])
        places = {s.key.split("\n")[1]: s.engine for s in service.registry.sessions.snapshot()}
        assert places[on_second[0]] == second.key and places[on_first[0]] == first.key

        # The default policy, swapped in, sends the next new session to the engine where
        # the fewest live: the first.
        service.registry.line(MODEL).placement = KeepPrefixes(service.registry.sessions)
        await session_turn(service, on_second[3])
        assert service.requests.records()[-1].engine == first.label
    finally:
        for process in processes:
            stop(process)


class Listening(MostFreeSlots):
    """The rule before sessions, hearing each ticket's life (no KeepPrefixes)."""

    def __init__(self) -> None:
        self.heard: list[tuple[str, ...]] = []

    def admitted(self, ticket: Placeable, seat: Seat[Any]) -> None:
        self.heard.append(("admitted", str(ticket.hint.session), seat.engine.key))

    def ended(self, ticket: Placeable) -> None:
        self.heard.append(("ended", str(ticket.hint.session)))

    def learned(self, ticket: Placeable, session: Session | None) -> None:
        self.heard.append(("learned", str(ticket.hint.session), str(session and session.engine)))


async def test_any_policy_hears_a_turns_admission_its_end_and_where_the_book_put_its_prefix(
        service: StudioService, llama_server_binary: Path, tiny_model: Path) -> None:
    processes, (port,) = await engines_serving(service, llama_server_binary, tiny_model, 1)
    try:
        line = service.registry.line(MODEL)
        policy = line.placement = Listening()
        await session_turn(service, "agent-1")
        (engine,) = line.engines
        (place,) = service.registry.sessions.snapshot()
        assert policy.heard == [("admitted", place.key, engine.key), ("ended", place.key),
                                ("learned", place.key, engine.key)]
        assert place.engine == engine.key and place.prompt_tokens > 0
    finally:
        for process in processes:
            stop(process)
