"""One AdmissionQueue: bounded FIFO, no leaked places, O(1) leaving, Retry-After."""

from __future__ import annotations

import asyncio
from collections import OrderedDict

import pytest

from backend.admission import AdmissionQueue, AdmissionRegistry, Ticket, TicketState
from backend.errors import ModelNotReady, QueueFull, QueueTimeout
from tests.backend.admission_helpers import OLD, FakeClock, queue_of, started


async def test_waiters_are_admitted_in_arrival_order_at_capacity_one():
    queue = queue_of(capacity=1)
    first = queue.request()
    waiters = [queue.request() for _ in range(5)]
    admitted: list[int] = []

    async def serve(index: int, ticket: Ticket) -> None:
        await ticket.wait()
        admitted.append(index)
        assert queue.active == 1
        ticket.release()

    tasks = [asyncio.create_task(serve(i, t)) for i, t in enumerate(waiters)]
    assert first.admitted and queue.active == 1 and queue.waiting == 5
    assert [t.position for t in waiters] == [0, 1, 2, 3, 4]
    first.release()
    await asyncio.gather(*tasks)

    assert admitted == [0, 1, 2, 3, 4]
    assert queue.idle


async def test_request_that_finds_the_line_full_is_refused_at_once_with_retry_after():
    queue = queue_of(capacity=1, max_waiting=3)
    queue.request()
    accepted, refusals = [], []
    for _ in range(8):
        try:
            accepted.append(queue.request())
        except QueueFull as error:
            refusals.append(error)

    assert len(accepted) == 3
    assert len(refusals) == 5
    assert all(error.retry_after >= 1 for error in refusals)
    assert all(error.code == "server_is_overloaded" for error in refusals)
    assert queue.waiting == 3 and queue.active == 1


def test_unbounded_line_when_max_waiting_is_zero():
    queue = queue_of(capacity=1, max_waiting=0)
    for _ in range(1000):
        queue.request()
    assert queue.waiting == 999


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

    assert caught.value.retry_after >= 1
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


def test_capacity_growth_admits_waiters_in_order():
    queue = queue_of(capacity=1)
    queue.request()
    waiters = [queue.request() for _ in range(4)]

    queue.set_capacity(3)

    assert [t.admitted for t in waiters] == [True, True, False, False]
    assert queue.active == 3 and queue.waiting == 2
    assert waiters[2].position == 0


def test_capacity_shrink_lets_running_requests_finish():
    queue = queue_of(capacity=3)
    running = [queue.request() for _ in range(3)]
    waiting = queue.request()

    queue.set_capacity(1)
    assert all(t.admitted for t in running) and queue.active == 3

    running[0].release()
    running[1].release()
    assert not waiting.admitted
    running[2].release()
    assert waiting.admitted and queue.active == 1


def test_capacity_must_be_at_least_one_slot():
    with pytest.raises(ValueError):
        AdmissionQueue(OLD, 0)
    with pytest.raises(ValueError):
        queue_of().set_capacity(0)


def test_retry_after_grows_with_position():
    queue = queue_of(capacity=2)
    estimates = [queue.retry_after(position) for position in range(0, 40, 4)]
    assert estimates == sorted(estimates)
    assert estimates[-1] > estimates[0]
    assert min(estimates) >= 1
    # before any sample the service time is 1 s: place 9 of 2 slots -> 5 s
    assert queue.retry_after(9) == 5


def test_retry_after_uses_observed_service_time():
    clock = FakeClock()
    queue = queue_of(capacity=2, clock=clock)
    for _ in range(3):
        ticket = queue.request()
        clock.now += 10.0
        ticket.release()

    assert queue.service_time == pytest.approx(10.0)
    assert queue.retry_after(0) == 5  # (0+1)/2 * 10
    assert queue.retry_after(3) == 20  # (3+1)/2 * 10

    ticket = queue.request()
    clock.now += 60.0
    ticket.release()
    assert 10.0 < queue.service_time < 60.0  # moves towards recent durations
    assert queue.retry_after(3) > 20


def test_retry_after_is_whole_seconds_and_at_least_one():
    clock = FakeClock()
    queue = queue_of(capacity=4, clock=clock)
    ticket = queue.request()
    clock.now += 0.01
    ticket.release()
    assert queue.retry_after(0) == 1
    assert queue.retry_after(500) == float(int(queue.retry_after(500)))


def test_queue_full_estimate_is_for_the_back_of_the_line():
    queue = queue_of(capacity=1, max_waiting=4)
    queue.request()
    for _ in range(4):
        queue.request()
    with pytest.raises(QueueFull) as caught:
        queue.request()
    assert caught.value.retry_after == queue.retry_after(4) == 5


def test_admission_times_come_from_the_injected_clock():
    clock = FakeClock()
    queue = queue_of(capacity=1, clock=clock)
    queue.request().release()
    first = queue.request()
    clock.now += 3
    second = queue.request()
    clock.now += 4
    first.release()
    assert second.enqueued_at == 1003.0
    assert second.admitted_at == 1007.0


def test_waiting_line_is_an_ordered_set_so_cancel_is_constant_time():
    queue = queue_of(capacity=1)
    assert type(queue._line) is OrderedDict


@pytest.mark.timeout(30)
def test_cancelling_the_middle_of_a_long_line_is_fast_and_keeps_order():
    queue = queue_of(capacity=1)
    running = queue.request()
    tickets = [queue.request() for _ in range(100_000)]
    assert type(queue._line) is OrderedDict

    for ticket in tickets[25_000:75_000]:
        ticket.release()

    assert queue.waiting == 50_000
    survivors = tickets[:25_000] + tickets[75_000:]
    assert list(queue._line) == survivors
    running.release()
    for ticket in survivors:
        assert ticket.admitted
        ticket.release()
    assert queue.idle


def test_disabled_admission_admits_everyone_at_once_and_still_counts():
    queue = queue_of(capacity=1, max_waiting=1, enabled=False)
    tickets = [queue.request() for _ in range(10)]
    assert all(t.admitted for t in tickets)
    assert queue.active == 10 and queue.waiting == 0


def test_retired_queue_refuses_newcomers_as_not_ready():
    registry = AdmissionRegistry()
    queue = registry.activate(OLD, 1)
    queue.request()
    registry.retire_current()
    with pytest.raises(ModelNotReady) as caught:
        queue.request()
    assert caught.value.retry_after >= 1
