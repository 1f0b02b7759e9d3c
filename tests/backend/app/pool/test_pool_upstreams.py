"""The pool's engines elsewhere, on the admission alone (no gateway, no pool): an upstream
that answers joins its model's line with its slots and cache, one that stops answering
leaves it while its waiters keep their place, and it comes back when it answers again; a
GGUF Studio port's models each become an engine of their own, labelled "upstream N"."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import httpx
import pytest

from backend.app.pool.pool_config import UpstreamEntry
from backend.app.pool.pool_upstreams import Upstreams
from backend.llama.kv_capacity import KvCapacity, KvLayout
from backend.llama.load import Snapshot
from backend.llama.supervisor import pick_free_port
from backend.admission.admission_registry import AdmissionRegistry
from backend.admission.admission_ticket import TicketState
from tests.backend.app.pool.test_pool import studio_health, studio_model
from tests.backend.llama.test_remote_engine import _until_healthy, start_llama_server, stop
from tests.fake_upstream import FakeUpstream


class Pool:
    """What the pool gives `Upstreams`: its names, and an ear for what it is told."""

    def __init__(self) -> None:
        self.registry = AdmissionRegistry()
        self.told: list[tuple[str, Snapshot]] = []
        self.upstreams = Upstreams(self.registry, names=lambda: self.upstreams.names(),
                                   default_changed=lambda: None, changed=lambda: None,
                                   told=lambda model, snapshot: self.told.append((model, snapshot)))

    def labels(self, model: str) -> list[str]:
        line = self.registry.find_line(model)
        return [] if line is None else [queue.label for queue in line.engines]


@pytest.fixture
async def pool() -> AsyncIterator[Pool]:
    pool = Pool()
    yield pool
    await pool.upstreams.close()


async def until(predicate: Callable[[], bool], timeout: float = 60.0) -> None:
    """Poll: a RemoteEngine's health checks have no event to wait on here."""
    async def poll() -> None:
        while not predicate():
            await asyncio.sleep(0.02)
    await asyncio.wait_for(poll(), timeout)


async def healthy(port: int) -> None:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as probe:
        await _until_healthy(probe)


async def test_a_llama_server_that_answers_joins_with_its_slots_and_cache(
        pool: Pool, llama_server_binary, tiny_model) -> None:
    port = pick_free_port()
    engine = start_llama_server(llama_server_binary, tiny_model, port, parallel=2, ctx=2048)
    try:
        await healthy(port)
        await pool.upstreams.add(UpstreamEntry(f"http://127.0.0.1:{port}",
                                               kv_layout=KvLayout.SPLIT))
        line = pool.registry.line("elsewhere")
        await until(lambda: bool(line.engines))
        (queue,) = line.engines
        assert (queue.capacity, queue.kv) == (2, KvCapacity(2048, 1024, unified=False))
        assert queue.label == "upstream 1"
        assert pool.upstreams.names() == ["elsewhere"]
        assert "elsewhere" in [model for model, _snapshot in pool.told]
        # It takes two requests at once, the third waits.
        first, second, third = line.request(), line.request(), line.request()
        assert [t.state for t in (first, second, third)] == [
            TicketState.ADMITTED, TicketState.ADMITTED, TicketState.WAITING]
        for ticket in (first, second):
            ticket.release()
        await third.wait(timeout=5)
        third.release()
    finally:
        stop(engine)


async def test_an_upstream_that_stops_answering_leaves_its_waiters_wait_and_it_comes_back(
        pool: Pool, llama_server_binary, tiny_model) -> None:
    port = pick_free_port()
    engine = start_llama_server(llama_server_binary, tiny_model, port, parallel=1)
    try:
        await healthy(port)
        await pool.upstreams.add(UpstreamEntry(f"http://127.0.0.1:{port}"))
        line = pool.registry.line("elsewhere")
        await until(lambda: bool(line.engines))
        running = line.request()
        waiter = line.request()
        assert (running.state, waiter.state) == (TicketState.ADMITTED, TicketState.WAITING)

        stop(engine)
        await until(lambda: not line.engines)
        assert waiter.state is TicketState.WAITING and line.waiting == 1
        running.release()  # what ran on it ends; nobody is admitted on an engine gone
        assert waiter.state is TicketState.WAITING
        assert pool.upstreams.statuses()[0].error == "The upstream does not answer."

        engine = start_llama_server(llama_server_binary, tiny_model, port, parallel=1)
        await waiter.wait(timeout=60)  # served by the engine back, in its place
        assert pool.labels("elsewhere") == ["upstream 1"]
        assert waiter.engine is not None and waiter.engine.label == "upstream 1"
        waiter.release()
    finally:
        if engine.poll() is None:
            stop(engine)


async def test_each_model_of_a_gguf_studio_port_is_an_engine_labelled_by_its_upstream(
        pool: Pool) -> None:
    """Fake upstreams: a GGUF Studio port's /health with its models' own slots and caches
    (no second port to run here)."""
    async with FakeUpstream(model="plain") as plain, FakeUpstream() as studio:
        studio.studio_health = studio_health(studio_model("a", "ready", 2),
                                             studio_model("b", "ready", 1))
        await pool.upstreams.add(UpstreamEntry(plain.base_url))
        await pool.upstreams.add(UpstreamEntry(studio.base_url))
        # The plain one joins once it answered what it keeps (`prefix_probe`): either first.
        await until(lambda: pool.labels("a") == ["upstream 2"] == pool.labels("b")
                    and pool.labels("plain") == ["upstream 1"])
        (a,) = pool.registry.line("a").engines
        (b,) = pool.registry.line("b").engines
        assert (a.capacity, a.kv) == (2, KvCapacity(2048, 1024, unified=False))
        assert (b.capacity, b.kv) == (1, KvCapacity(1024, 1024, unified=False))
        assert sorted(pool.upstreams.names()) == ["a", "b", "plain"]
        assert pool.upstreams.must_name("a") and not pool.upstreams.must_name("plain")

        # A model that stops being ready there leaves; its waiter keeps its place.
        busy = pool.registry.line("b").request()
        waiter = pool.registry.line("b").request()
        studio.studio_health = studio_health(studio_model("a", "ready", 2),
                                             studio_model("b", "unloading"))
        await until(lambda: not pool.registry.line("b").engines)
        assert pool.labels("a") == ["upstream 2"]
        busy.release()
        assert waiter.state is TicketState.WAITING
        studio.studio_health = studio_health(studio_model("a", "ready", 2),
                                             studio_model("b", "ready", 1))
        await waiter.wait(timeout=30)
        waiter.release()


async def test_an_upstream_removed_retires_its_engines_and_its_number_is_reused(
        pool: Pool) -> None:
    """Fake upstreams: only the numbering and the admission are under test."""
    async with FakeUpstream(model="one") as first, FakeUpstream(model="two") as second, \
            FakeUpstream(model="three") as third:
        await pool.upstreams.add(UpstreamEntry(first.base_url))
        await pool.upstreams.add(UpstreamEntry(second.base_url))
        await until(lambda: pool.labels("one") == ["upstream 1"]
                    and pool.labels("two") == ["upstream 2"])
        waiter = pool.registry.line("one").request()  # admitted: two slots, none taken
        queued = [pool.registry.line("one").request() for _ in range(2)]
        assert queued[-1].state is TicketState.WAITING

        await pool.upstreams.remove(first.base_url)
        assert pool.labels("one") == [] and pool.upstreams.names() == ["two"]
        assert queued[-1].state is TicketState.WAITING  # keeps its place for another engine
        assert pool.labels("two") == ["upstream 2"]  # whoever leaves meanwhile

        await pool.upstreams.add(UpstreamEntry(third.base_url))
        await until(lambda: pool.labels("three") == ["upstream 1"])
        for ticket in (waiter, *queued):
            ticket.release()
