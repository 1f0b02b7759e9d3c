"""Admission: bounded FIFO per backend, carry-over between loads, no leaked places."""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict

import pytest

from backend.admission import AdmissionQueue, AdmissionRegistry, Ticket, TicketState
from backend.errors import LoadReplaced, ModelNotReady, QueueFull, QueueTimeout

OLD = "http://127.0.0.1:41001"
NEW = "http://127.0.0.1:41002"
NEWER = "http://127.0.0.1:41003"


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def started(ticket: Ticket, timeout: float | None = None) -> asyncio.Task[None]:
    """A task awaiting `ticket`, already suspended inside wait().

    One turn of the loop runs a new task up to its first await; this is ordering,
    not a timed sleep.
    """
    task = asyncio.create_task(ticket.wait(timeout))
    await asyncio.sleep(0)
    assert not task.done()
    return task


def queue_of(capacity: int = 1, max_waiting: int = 0, **kwargs) -> AdmissionQueue:
    return AdmissionQueue(OLD, capacity, max_waiting=max_waiting, **kwargs)


# --- one queue -----------------------------------------------------------------------


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


# --- the registry --------------------------------------------------------------------


def test_activate_makes_the_queue_current_with_its_capacity_and_line_bound():
    registry = AdmissionRegistry(max_waiting_for=lambda slots: 10 * slots)
    queue = registry.activate(OLD, 3)
    assert registry.current is queue
    assert registry.queue_for(OLD) is queue
    assert queue.key == OLD and queue.capacity == 3 and queue.max_waiting == 30
    assert registry.queues == [queue]


def test_default_line_bound_is_at_least_64_and_16_per_slot():
    registry = AdmissionRegistry()
    assert registry.activate(OLD, 1).max_waiting == 64
    assert registry.activate(NEW, 8).max_waiting == 128


def test_activating_a_new_backend_prunes_idle_earlier_queues():
    registry = AdmissionRegistry()
    old = registry.activate(OLD, 2)
    old.request().release()

    new = registry.activate(NEW, 2)

    assert registry.queues == [new]
    assert registry.queue_for(OLD) is None
    assert registry.current is new


def test_activating_the_same_backend_again_reuses_its_queue():
    registry = AdmissionRegistry()
    queue = registry.activate(OLD, 1)
    running = queue.request()
    assert registry.activate(OLD, 2) is queue
    assert queue.capacity == 2 and not queue.retired
    assert running.admitted and queue.active == 1


def test_busy_earlier_queue_survives_until_drained_then_is_pruned():
    registry = AdmissionRegistry()
    old = registry.activate(OLD, 2)
    first, second = old.request(), old.request()

    new = registry.activate(NEW, 2)

    assert registry.queues == [old, new]  # current last
    assert old.retired and not new.retired
    assert first.base_url == OLD  # a running request stays on its backend
    assert registry.total_active == 2
    first.release()
    assert registry.queue_for(OLD) is old
    second.release()
    assert registry.queue_for(OLD) is None
    assert registry.queues == [new]


def test_retired_queue_admits_no_one_even_when_slots_free_up():
    registry = AdmissionRegistry()
    old = registry.activate(OLD, 1)
    running = old.request()
    waiting = old.request()
    registry.retire_current()

    running.release()

    assert registry.current is None
    assert waiting.state is TicketState.WAITING and waiting.queue is old
    assert registry.queue_for(OLD) is old  # kept: someone still waits in it


async def test_waiters_of_a_retired_queue_move_to_the_new_queue_in_order():
    registry = AdmissionRegistry()
    old = registry.activate(OLD, 1)
    running = old.request()
    carried = [old.request() for _ in range(3)]
    tasks = [await started(t) for t in carried]
    registry.retire_current()

    new = registry.activate(NEW, 2)
    newcomer = new.request()

    assert [t.queue for t in carried] == [new, new, new]
    assert [t.admitted for t in carried] == [True, True, False]
    assert newcomer.position == 1  # behind the carried one still waiting
    await asyncio.gather(*tasks[:2])
    assert [t.base_url for t in carried[:2]] == [NEW, NEW]

    # the old load still runs its own request, and is pruned when it ends
    assert running.base_url == OLD and registry.queue_for(OLD) is old
    running.release()
    assert registry.queue_for(OLD) is None
    assert not carried[2].admitted  # the old queue's slot is no use to them

    carried[0].release()
    await tasks[2]
    assert carried[2].base_url == NEW
    assert newcomer.position == 0


def test_waiters_carried_without_retire_current_first():
    registry = AdmissionRegistry()
    old = registry.activate(OLD, 1)
    old.request()
    waiting = old.request()
    new = registry.activate(NEW, 1)
    assert waiting.admitted and waiting.base_url == NEW
    assert new.active == 1


def test_waiters_carried_across_successive_reloads_keep_their_order():
    registry = AdmissionRegistry()
    first = registry.activate(OLD, 1)
    running = first.request()
    w1, w2, w3 = first.request(), first.request(), first.request()
    registry.retire_current()

    second = registry.activate(NEW, 1)
    w4 = second.request()
    assert w1.admitted and w1.base_url == NEW
    assert list(second._line) == [w2, w3, w4]
    registry.retire_current()

    third = registry.activate(NEWER, 1)
    assert w2.admitted and w2.base_url == NEWER
    assert list(third._line) == [w3, w4]
    assert w1.base_url == NEW and running.base_url == OLD  # bound for good
    assert [q.key for q in registry.queues] == [OLD, NEW, NEWER]


def test_carried_waiters_may_exceed_the_new_line_bound():
    registry = AdmissionRegistry(max_waiting_for=lambda slots: 2 * slots)
    old = registry.activate(OLD, 2)
    old.request(), old.request()
    waiters = [old.request() for _ in range(4)]
    registry.retire_current()

    new = registry.activate(NEW, 1)

    assert waiters[0].admitted
    assert new.waiting == 3 and new.max_waiting == 2  # accepted earlier: kept
    with pytest.raises(QueueFull):
        new.request()


async def test_refuse_waiting_refuses_waiters_with_the_given_error():
    registry = AdmissionRegistry()
    old = registry.activate(OLD, 1)
    running = old.request()
    waiters = [old.request() for _ in range(3)]
    tasks = [await started(t) for t in waiters]
    registry.retire_current()
    error = LoadReplaced("The model was unloaded.", retry_after=5)

    assert registry.refuse_waiting(error) == 3

    for task in tasks:
        with pytest.raises(LoadReplaced) as caught:
            await task
        assert caught.value is error
    assert all(t.state is TicketState.REFUSED and t.error is error for t in waiters)
    assert running.admitted  # running requests are not touched
    assert registry.total_waiting == 0

    # a refused ticket is never admitted later, by release or by a new load
    running.release()
    new = registry.activate(NEW, 4)
    assert new.waiting == 0 and new.active == 0
    assert all(t.state is TicketState.REFUSED for t in waiters)
    waiters[0].release()
    assert waiters[0].state is TicketState.REFUSED
    with pytest.raises(LoadReplaced):
        await waiters[0].wait()
    assert registry.queues == [new]


def test_refuse_waiting_leaves_the_current_queue_alone():
    registry = AdmissionRegistry()
    queue = registry.activate(OLD, 1)
    queue.request()
    waiting = queue.request()
    assert registry.refuse_waiting(ModelNotReady("x")) == 0
    assert waiting.state is TicketState.WAITING


def test_refuse_waiting_prunes_queues_left_idle():
    registry = AdmissionRegistry()
    old = registry.activate(OLD, 1)
    running = old.request()
    old.request()
    registry.retire_current()
    running.release()
    assert registry.queue_for(OLD) is old
    registry.refuse_waiting(ModelNotReady("x"))
    assert registry.queues == []


def test_retire_current_prunes_an_idle_queue_at_once():
    registry = AdmissionRegistry()
    registry.activate(OLD, 1)
    registry.retire_current()
    assert registry.current is None and registry.queues == []
    registry.retire_current()  # nothing current: nothing to do


def test_registry_set_capacity_updates_the_current_queue_and_its_bound():
    registry = AdmissionRegistry(max_waiting_for=lambda slots: 5 * slots)
    queue = registry.activate(OLD, 1)
    queue.request()
    waiting = queue.request()
    registry.set_capacity(2)
    assert waiting.admitted
    assert queue.capacity == 2 and queue.max_waiting == 10
    registry.retire_current()
    registry.set_capacity(7)  # no current load: ignored
    assert queue.capacity == 2


def test_disabling_admission_in_the_registry_bypasses_the_limit():
    registry = AdmissionRegistry(enabled=False)
    queue = registry.activate(OLD, 1)
    tickets = [queue.request() for _ in range(200)]
    assert all(t.admitted for t in tickets)
    assert registry.total_active == 200 and registry.total_waiting == 0


def test_disabling_admission_at_run_time_admits_everyone_waiting():
    registry = AdmissionRegistry()
    queue = registry.activate(OLD, 1)
    queue.request()
    waiting = [queue.request() for _ in range(3)]
    registry.enabled = False
    assert all(t.admitted for t in waiting)
    assert queue.active == 4


def test_totals_sum_every_live_queue():
    registry = AdmissionRegistry()
    old = registry.activate(OLD, 1)
    old.request()
    old.request()
    new = registry.activate(NEW, 1)
    new.request()
    assert registry.total_active == 2  # one on each backend
    assert registry.total_waiting == 1
    assert old.active == 1 and new.active == 1 and new.waiting == 1


def test_listeners_hear_every_change_of_counts():
    registry = AdmissionRegistry()
    seen: list[tuple[int, int]] = []
    registry.add_listener(lambda: seen.append((registry.total_active,
                                               registry.total_waiting)))
    queue = registry.activate(OLD, 1)
    first = queue.request()
    second = queue.request()
    first.release()
    second.release()
    assert seen == [(0, 0), (1, 0), (1, 1), (1, 0), (0, 0)]


def test_listeners_hear_one_consistent_state_per_activate():
    registry = AdmissionRegistry()
    old = registry.activate(OLD, 1)
    old.request()
    for _ in range(3):
        old.request()
    seen: list[tuple[int, int]] = []
    registry.add_listener(lambda: seen.append((registry.total_active,
                                               registry.total_waiting)))
    registry.activate(NEW, 2)
    assert seen == [(3, 1)]


def test_a_failing_listener_does_not_break_admission(caplog):
    registry = AdmissionRegistry()
    heard = []

    def broken() -> None:
        raise RuntimeError("listener bug")

    registry.add_listener(broken)
    registry.add_listener(lambda: heard.append(True))
    with caplog.at_level(logging.ERROR, logger="backend.admission"):
        queue = registry.activate(OLD, 1)
        ticket = queue.request()
        ticket.release()
    assert ticket.state is TicketState.RELEASED and queue.idle
    assert heard
    assert "listener" in caplog.text

    registry.remove_listener(broken)
    registry.remove_listener(broken)  # unknown listeners are ignored
