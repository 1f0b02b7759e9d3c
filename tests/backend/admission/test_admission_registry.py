"""The AdmissionRegistry: one queue per load, pruning, carry-over between loads."""

from __future__ import annotations

import asyncio
import logging

import pytest

from backend.llama.kv_capacity import KvCapacity, TokenNeed
from backend.llama.load import Serving
from backend.admission.admission_ticket import TicketState
from backend.admission.admission_registry import AdmissionRegistry
from backend.errors import ContextLengthExceeded, LoadReplaced, ModelNotReady, QueueFull
from tests.backend.admission_helpers import NEW, NEWER, OLD, started


def test_activate_makes_the_queue_current_with_its_capacity_and_line_bound():
    registry = AdmissionRegistry(max_waiting_for=lambda slots: 10 * slots)
    queue = registry.activate(Serving(OLD, 3))
    assert registry.current is queue
    assert registry.queue_for(OLD) is queue
    assert queue.key == OLD and queue.capacity == 3 and queue.max_waiting == 30
    assert registry.queues == [queue]


def test_default_line_bound_is_at_least_64_and_16_per_slot():
    registry = AdmissionRegistry()
    assert registry.activate(Serving(OLD, 1)).max_waiting == 64
    assert registry.activate(Serving(NEW, 8)).max_waiting == 128


def test_activating_a_new_backend_prunes_idle_earlier_queues():
    registry = AdmissionRegistry()
    old = registry.activate(Serving(OLD, 2))
    old.request().release()

    new = registry.activate(Serving(NEW, 2))

    assert registry.queues == [new]
    assert registry.queue_for(OLD) is None
    assert registry.current is new


def test_activating_the_same_backend_again_reuses_its_queue():
    registry = AdmissionRegistry()
    queue = registry.activate(Serving(OLD, 1))
    running = queue.request()
    assert registry.activate(Serving(OLD, 2)) is queue
    assert queue.capacity == 2 and not queue.retired
    assert running.admitted and queue.active == 1


def test_busy_earlier_queue_survives_until_drained_then_is_pruned():
    registry = AdmissionRegistry()
    old = registry.activate(Serving(OLD, 2))
    first, second = old.request(), old.request()

    new = registry.activate(Serving(NEW, 2))

    assert registry.queues == [old, new]  # current last
    assert old.retired and not new.retired
    assert first.serving.base_url == OLD  # a running request stays on its backend
    assert registry.total_active == 2
    first.release()
    assert registry.queue_for(OLD) is old
    second.release()
    assert registry.queue_for(OLD) is None
    assert registry.queues == [new]


def test_retired_queue_admits_no_one_even_when_slots_free_up():
    registry = AdmissionRegistry()
    old = registry.activate(Serving(OLD, 1))
    running = old.request()
    waiting = old.request()
    registry.retire_current()

    running.release()

    assert registry.current is None
    assert waiting.state is TicketState.WAITING and waiting.line is old.line
    assert registry.queue_for(OLD) is None  # nothing runs on it: its waiter waits in the line


async def test_waiters_of_a_retired_queue_move_to_the_new_queue_in_order():
    registry = AdmissionRegistry()
    old = registry.activate(Serving(OLD, 1))
    running = old.request()
    carried = [old.request() for _ in range(3)]
    tasks = [await started(t) for t in carried]
    registry.retire_current()

    new = registry.activate(Serving(NEW, 2))
    newcomer = new.request()

    assert [t.line for t in carried] == [new.line] * 3
    assert [t.admitted for t in carried] == [True, True, False]
    assert [t.engine for t in carried[:2]] == [new, new]
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
    old = registry.activate(Serving(OLD, 1))
    old.request()
    waiting = old.request()
    new = registry.activate(Serving(NEW, 1))
    assert waiting.admitted and waiting.base_url == NEW
    assert new.active == 1


def test_waiters_carried_across_successive_reloads_keep_their_order():
    registry = AdmissionRegistry()
    first = registry.activate(Serving(OLD, 1))
    running = first.request()
    w1, w2, w3 = first.request(), first.request(), first.request()
    registry.retire_current()

    second = registry.activate(Serving(NEW, 1))
    w4 = second.request()
    assert w1.admitted and w1.base_url == NEW
    assert list(second.line) == [w2, w3, w4]
    registry.retire_current()

    third = registry.activate(Serving(NEWER, 1))
    assert w2.admitted and w2.base_url == NEWER
    assert list(third.line) == [w3, w4]
    assert w1.base_url == NEW and running.base_url == OLD  # bound for good
    assert [q.key for q in registry.queues] == [OLD, NEW, NEWER]


def test_carried_waiters_may_exceed_the_new_line_bound():
    registry = AdmissionRegistry(max_waiting_for=lambda slots: 2 * slots)
    old = registry.activate(Serving(OLD, 2))
    old.request(), old.request()
    waiters = [old.request() for _ in range(4)]
    registry.retire_current()

    new = registry.activate(Serving(NEW, 1))

    assert waiters[0].admitted
    assert new.waiting == 3 and new.max_waiting == 2  # accepted earlier: kept
    with pytest.raises(QueueFull):
        new.request()


async def test_refuse_waiting_refuses_waiters_with_the_given_error():
    registry = AdmissionRegistry()
    old = registry.activate(Serving(OLD, 1))
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
    new = registry.activate(Serving(NEW, 4))
    assert new.waiting == 0 and new.active == 0
    assert all(t.state is TicketState.REFUSED for t in waiters)
    waiters[0].release()
    assert waiters[0].state is TicketState.REFUSED
    with pytest.raises(LoadReplaced):
        await waiters[0].wait()
    assert registry.queues == [new]


def test_refuse_waiting_leaves_the_current_queue_alone():
    registry = AdmissionRegistry()
    queue = registry.activate(Serving(OLD, 1))
    queue.request()
    waiting = queue.request()
    assert registry.refuse_waiting(ModelNotReady("x")) == 0
    assert waiting.state is TicketState.WAITING


def test_refuse_waiting_prunes_queues_left_idle():
    registry = AdmissionRegistry()
    old = registry.activate(Serving(OLD, 1))
    running = old.request()
    old.request()
    registry.retire_current()
    running.release()
    assert registry.queue_for(OLD) is None  # nothing runs on it
    assert registry.refuse_waiting(ModelNotReady("x")) == 1
    assert registry.queues == [] and registry.lines == []


def test_retire_current_prunes_an_idle_queue_at_once():
    registry = AdmissionRegistry()
    registry.activate(Serving(OLD, 1))
    registry.retire_current()
    assert registry.current is None and registry.queues == []
    registry.retire_current()  # nothing current: nothing to do


def test_registry_set_capacity_updates_the_current_queue_and_its_bound():
    registry = AdmissionRegistry(max_waiting_for=lambda slots: 5 * slots)
    queue = registry.activate(Serving(OLD, 1))
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
    queue = registry.activate(Serving(OLD, 1))
    tickets = [queue.request() for _ in range(200)]
    assert all(t.admitted for t in tickets)
    assert registry.total_active == 200 and registry.total_waiting == 0


def test_disabling_admission_at_run_time_admits_everyone_waiting():
    registry = AdmissionRegistry()
    queue = registry.activate(Serving(OLD, 1))
    queue.request()
    waiting = [queue.request() for _ in range(3)]
    registry.enabled = False
    assert all(t.admitted for t in waiting)
    assert queue.active == 4


def test_totals_sum_every_live_queue():
    registry = AdmissionRegistry()
    old = registry.activate(Serving(OLD, 1))
    old.request()
    old.request()
    new = registry.activate(Serving(NEW, 1))
    new.request()
    assert registry.total_active == 2  # one on each backend
    assert registry.total_waiting == 1
    assert old.active == 1 and new.active == 1 and new.waiting == 1


def test_listeners_hear_every_change_of_counts():
    registry = AdmissionRegistry()
    seen: list[tuple[int, int]] = []
    registry.add_listener(lambda: seen.append((registry.total_active,
                                               registry.total_waiting)))
    queue = registry.activate(Serving(OLD, 1))
    first = queue.request()
    second = queue.request()
    first.release()
    second.release()
    assert seen == [(0, 0), (1, 0), (1, 1), (1, 0), (0, 0)]


def test_listeners_hear_one_consistent_state_per_activate():
    registry = AdmissionRegistry()
    old = registry.activate(Serving(OLD, 1))
    old.request()
    for _ in range(3):
        old.request()
    seen: list[tuple[int, int]] = []
    registry.add_listener(lambda: seen.append((registry.total_active,
                                               registry.total_waiting)))
    registry.activate(Serving(NEW, 2))
    assert seen == [(3, 1)]


def test_a_failing_listener_does_not_break_admission(caplog):
    registry = AdmissionRegistry()
    heard = []

    def broken() -> None:
        raise RuntimeError("listener bug")

    registry.add_listener(broken)
    registry.add_listener(lambda: heard.append(True))
    with caplog.at_level(logging.ERROR, logger="backend.admission.admission_registry"):
        queue = registry.activate(Serving(OLD, 1))
        ticket = queue.request()
        ticket.release()
    assert ticket.state is TicketState.RELEASED and queue.idle
    assert heard
    assert "listener" in caplog.text

    registry.remove_listener(broken)
    registry.remove_listener(broken)  # unknown listeners are ignored


# --- KV tokens across loads --------------------------------------------------------


def test_activate_with_a_kv_capacity_exposes_capacity_and_reserved_tokens():
    registry = AdmissionRegistry()
    queue = registry.activate(Serving(OLD, 4, kv=KvCapacity.shared(32_768)))
    queue.request(need=TokenNeed(prompt=20_000, output=4_000))

    assert registry.kv_capacity == 32_768
    assert registry.total_reserved_tokens == 24_000
    registry.retire_current()
    assert registry.kv_capacity == 0  # no current load
    assert registry.total_reserved_tokens == 24_000  # still running on the old one


async def test_kv_waiters_carried_to_a_bigger_cache_are_admitted_in_order():
    registry = AdmissionRegistry()
    old = registry.activate(Serving(OLD, 4, kv=KvCapacity.shared(10_000)))
    running = old.request(need=8_000)
    carried = [old.request(need=n) for n in (6_000, 3_000, 9_000)]
    tasks = [await started(t) for t in carried]
    registry.retire_current()

    new = registry.activate(Serving(NEW, 4, kv=KvCapacity.shared(16_000)))

    assert [t.admitted for t in carried] == [True, True, False]  # 9,000 waits its turn
    assert new.reserved_tokens == 9_000 and old.reserved_tokens == 8_000
    await asyncio.gather(*tasks[:2])
    running.release()  # the old engine's tokens are no use on the new one
    assert not carried[2].admitted
    carried[0].release()
    await tasks[2]
    assert carried[2].base_url == NEW


async def test_carried_waiters_that_can_never_fit_the_new_load_are_refused():
    registry = AdmissionRegistry()
    old = registry.activate(Serving(OLD, 1, kv=KvCapacity.shared(32_768)))
    old.request(need=1_000)
    too_long = old.request(need=TokenNeed(prompt=9_000, output=1_000))
    fits = old.request(need=TokenNeed(prompt=3_000, output=1_000))
    task = await started(too_long)

    new = registry.activate(Serving(NEW, 4, kv=KvCapacity.split(16_384, slots=4)))

    with pytest.raises(ContextLengthExceeded) as refused:
        await task
    assert "9,000 prompt tokens" in str(refused.value) and "4,096" in str(refused.value)
    assert fits.admitted and fits.base_url == NEW
    assert new.waiting == 0


def test_reactivating_the_same_load_replaces_its_cache_and_rechecks_waiters():
    registry = AdmissionRegistry()
    queue = registry.activate(Serving(OLD, 2, kv=KvCapacity.shared(10_000)))
    queue.request(need=9_000)
    waiting = queue.request(need=5_000)

    assert registry.activate(Serving(OLD, 2, kv=KvCapacity.shared(20_000))) is queue
    assert waiting.admitted and queue.reserved_tokens == 14_000


def test_registry_set_capacity_rereads_the_cache_and_admits_kv_waiters():
    registry = AdmissionRegistry()
    queue = registry.activate(Serving(OLD, 4, kv=KvCapacity.shared(8_000)))
    queue.request(need=6_000)
    waiting = queue.request(need=4_000)

    registry.set_capacity(4, KvCapacity.shared(12_000))

    assert waiting.admitted and registry.kv_capacity == 12_000


def test_a_load_without_kv_capacity_admits_by_slots_as_before():
    registry = AdmissionRegistry()
    old = registry.activate(Serving(OLD, 2, kv=KvCapacity.shared(1_000)))
    registry.retire_current()
    new = registry.activate(Serving(NEW, 2))
    assert new.kv is None and registry.kv_capacity == 0
    assert new.request(need=50_000).admitted
    assert old.retired


async def test_a_requeued_ticket_stands_at_its_original_place_and_is_carried_to_the_next_load():
    registry = AdmissionRegistry()
    old = registry.activate(Serving(OLD, 2))
    first, second = old.request(), old.request()
    third, fourth = old.request(), old.request()
    await asyncio.gather(started(third), started(fourth))
    first.release()  # the engine died: a running one fails...
    assert third.admitted and old.waiting == 1
    # ...and the waiter promoted onto the dying load finds its connection refused.
    assert third.requeue()
    assert list(old.line) == [third, fourth]  # back in front of the later one
    assert old.active == 1 and third.state is TicketState.WAITING
    second.release()
    assert third.admitted and fourth.admitted  # the next release admits them, in order
    assert fourth.requeue() and third.requeue()
    assert list(old.line) == [third, fourth]
    assert old.active == 0  # a requeue promotes no one by itself

    registry.retire_current()
    waiting = await started(third)
    new = registry.activate(Serving(NEW, 2))
    await waiting
    assert third.admitted and fourth.admitted and third.engine is new
    assert registry.queues == [new]


def test_a_ticket_requeued_on_a_retired_load_after_the_next_became_current_joins_it():
    registry = AdmissionRegistry()
    old = registry.activate(Serving(OLD, 1))
    ticket = old.request()
    new = registry.activate(Serving(NEW, 1))  # the restart was faster than the refused connect
    assert ticket.requeue()
    assert ticket.admitted and ticket.engine is new
    assert registry.queues == [new]


def test_a_load_that_keeps_refusing_is_given_up_after_max_requeues():
    from backend.admission.admission_ticket import MAX_REQUEUES
    registry = AdmissionRegistry()
    queue = registry.activate(Serving(OLD, 1))
    ticket = queue.request()
    for _ in range(MAX_REQUEUES):
        assert ticket.requeue()
        queue.request().release()  # an arrival admits the head again
        assert ticket.admitted
    assert not ticket.requeue()
    assert not queue.request().admitted  # the failing ticket still holds its slot...
    ticket.release()
    assert queue.active == 1  # ...until released


async def test_a_slot_released_on_hold_admits_no_one_until_asked_again():
    registry = AdmissionRegistry()
    queue = registry.activate(Serving(OLD, 1))
    dropped = queue.request()
    waiter = queue.request()
    waiting = await started(waiter)
    dropped.release(hold=True)  # the engine cut this request off: likely a crash
    assert queue.active == 0 and not waiter.admitted
    queue.admit_waiting()  # later, and the load was not retired meanwhile
    await waiting
    assert waiter.admitted


async def test_a_request_served_by_a_load_keeps_its_model_busy_until_it_takes_its_ticket():
    # Between its model's load and its ticket the request is planned (the engine counts
    # its prompt); the pool evicted a model that looked idle then, and the request, left
    # with no engine, never got an answer (seen under load in test_pool_demand).
    registry = AdmissionRegistry()
    line = registry.line("m")
    served = line.when_served(size=100)
    gone = line.when_served(size=100)
    assert registry.busy("m") and line.waiting == 2
    gone.cancel()  # its client left while the model loaded
    await asyncio.sleep(0)  # done callbacks run on the loop's next turn
    assert line.waiting == 1

    queue = registry.activate(Serving(OLD, 1), model="m")
    await served
    await asyncio.sleep(0)
    assert registry.busy("m"), "served, not yet in line: the model must not look idle"

    line.stop_awaiting(served)
    ticket = line.request(TokenNeed(10, 10))
    assert ticket.admitted and registry.busy("m")
    ticket.release()
    assert not registry.busy("m") and line.waiting == 0 and queue.idle
