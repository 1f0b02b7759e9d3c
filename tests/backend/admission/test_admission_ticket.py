"""One Ticket's life: waiting, leaving the line, cancellation at any point, release
(idempotent), and a wait that times out or races its own admission."""

from __future__ import annotations

import asyncio

import pytest

from backend.admission.admission_ticket import TicketState
from backend.errors import QueueFull, QueueTimeout
from tests.backend.admission_helpers import queue_of, started
from tests.not_none import not_none


def test_leaving_the_line_frees_the_place_for_another_request():
    queue = queue_of(capacity=1, max_waiting=1)
    queue.request()
    waiting = queue.request()
    with pytest.raises(QueueFull):
        queue.request()

    waiting.release()

    assert waiting.state is TicketState.RELEASED
    assert queue.waiting == 0
    assert queue.request().state is TicketState.WAITING


async def test_cancelled_waiter_leaves_the_line_at_once():
    queue = queue_of(capacity=1, max_waiting=1)
    running = queue.request()
    waiting = queue.request()
    task = await started(waiting)

    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    assert waiting.state is TicketState.RELEASED
    assert queue.waiting == 0
    newcomer = queue.request()
    running.release()
    assert newcomer.admitted


async def test_cancellation_after_promotion_before_the_task_resumed_frees_the_slot():
    queue = queue_of(capacity=1)
    running = queue.request()
    promoted = queue.request()
    task = await started(promoted)

    running.release()
    assert promoted.admitted  # granted, but its task has not run since
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    assert promoted.state is TicketState.RELEASED
    assert queue.active == 0
    assert queue.request().admitted


async def test_cancellation_after_promotion_hands_the_slot_to_the_next_waiter():
    queue = queue_of(capacity=1)
    running = queue.request()
    promoted, behind = queue.request(), queue.request()
    task = await started(promoted)

    running.release()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    assert behind.admitted
    await behind.wait()
    assert queue.active == 1 and queue.waiting == 0


def test_release_is_idempotent():
    queue = queue_of(capacity=1)
    first = queue.request()
    second, third = queue.request(), queue.request()

    first.release()
    first.release()

    assert second.admitted
    assert third.state is TicketState.WAITING
    assert queue.active == 1 and queue.waiting == 1


def test_releasing_a_waiting_ticket_twice_leaves_the_line_once():
    queue = queue_of(capacity=1)
    queue.request()
    leaving, staying = queue.request(), queue.request()
    leaving.release()
    leaving.release()
    assert queue.waiting == 1 and staying.position == 0


async def test_wait_after_admission_returns_immediately():
    queue = queue_of(capacity=2)
    ticket = queue.request()
    assert ticket.admitted
    await ticket.wait(0.001)
    await ticket.wait()
    assert ticket.admitted and queue.active == 1


async def test_wait_on_a_ticket_released_before_admission_raises():
    queue = queue_of(capacity=1)
    queue.request()
    gone = queue.request()
    gone.release()
    with pytest.raises(RuntimeError):
        await gone.wait()


async def test_a_waiter_whose_ticket_is_released_elsewhere_wakes_up():
    queue = queue_of(capacity=1)
    queue.request()
    ticket = queue.request()
    task = await started(ticket)

    ticket.release()

    with pytest.raises(RuntimeError):
        await task
    assert queue.waiting == 0


async def test_wait_timeout_raises_queue_timeout_and_frees_the_place():
    queue = queue_of(capacity=1, max_waiting=1)
    running = queue.request()
    ticket = queue.request()

    with pytest.raises(QueueTimeout) as caught:
        await ticket.wait(timeout=0.01)

    assert not_none(caught.value.retry_after) >= 1
    assert ticket.state is TicketState.RELEASED
    assert queue.waiting == 0
    newcomer = queue.request()
    running.release()
    assert newcomer.admitted and queue.active == 1


async def test_an_admission_that_races_the_timeout_wins(monkeypatch):
    loop = asyncio.get_running_loop()
    queue = queue_of(capacity=1)
    running = queue.request()
    ticket = queue.request()
    task = await started(ticket, timeout=30)

    real_time = loop.time
    monkeypatch.setattr(loop, "time", lambda: real_time() + 60)  # deadline passed
    while not task.cancelling():  # the timer has fired; the task has not resumed
        await asyncio.sleep(0)
    running.release()

    await task
    assert ticket.admitted and queue.active == 1


async def test_zero_timeout_means_no_timeout():
    queue = queue_of(capacity=1)
    running = queue.request()
    ticket = queue.request()
    task = await started(ticket, timeout=0)
    running.release()
    await task
    assert ticket.admitted
