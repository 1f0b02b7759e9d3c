"""Requests waiting for their model's first engine, without I/O: their bytes count with
the line's waiters' until they take a ticket, leave or are refused; a revoked key's go
alone; an engine that comes serves them all."""

from __future__ import annotations

import asyncio

import pytest

from backend.admission.admission_registry import AdmissionRegistry
from backend.admission.load_wait import LoadWait
from backend.errors import KeyRevoked, ModelNotReady, QueueFull
from backend.llama.load import Serving
from tests.backend.admission_helpers import OLD


async def test_a_loading_models_requests_hold_their_bytes_against_the_waiters_bound():
    registry = AdmissionRegistry()
    line = registry.line("m")
    first = line.when_served(size=600, max_waiting_bytes=1000)
    with pytest.raises(QueueFull, match="the requests already waiting hold"):
        line.when_served(size=600, max_waiting_bytes=1000)
    with pytest.raises(QueueFull):
        line.check_wait(600, 1000)
    line.stop_awaiting(first)  # it gave up: its bytes are free
    second = line.when_served(size=600, max_waiting_bytes=1000)
    assert line.waiting == 1 and not second.done()
    registry.activate(Serving(OLD, 1), model="m")  # an engine serves the model now
    await asyncio.wait_for(second, 1)


async def test_a_revoked_keys_loading_requests_are_refused_and_no_one_elses():
    changes: list[int] = []
    wait = LoadWait(lambda: changes.append(len(wait)))
    alice, bob = wait.add("alice", 100), wait.add("bob", 200)
    assert (len(wait), wait.bytes, wait.flows()) == (2, 300, {"alice", "bob"})
    assert wait.refuse(KeyRevoked("gone"), "alice") == 1
    assert isinstance(alice.exception(), KeyRevoked) and not bob.done()
    assert (wait.bytes, wait.flows(), changes) == (200, {"bob"}, [1])
    assert wait.refuse(ModelNotReady("its load failed")) == 1
    assert (len(wait), wait.bytes) == (0, 0) and isinstance(bob.exception(), ModelNotReady)


async def test_an_engine_serves_every_waiting_request_which_holds_its_bytes_until_it_stops():
    wait = LoadWait(lambda: None)
    one, two = wait.add("alice", 100), wait.add("alice", 50)
    two.cancel()  # its client left while the model loaded
    await asyncio.sleep(0)  # done callbacks run on the loop's next turn
    assert (len(wait), wait.bytes) == (1, 100)
    wait.serve_all()
    await asyncio.wait_for(one, 1)
    assert wait.bytes == 100  # planned in between: the model is still busy with it
    wait.stop(one)  # it took its ticket
    assert (len(wait), wait.bytes) == (0, 0)
