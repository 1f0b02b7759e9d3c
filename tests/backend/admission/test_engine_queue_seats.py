"""Seats: an engine's slot ids 0..slots-1, handed out with each admission and given back
with each release; capacity growth adds ids, a shrink stops reissuing the ids above it."""

from __future__ import annotations

from backend.llama.load import Serving
from backend.admission.engine_queue import AdmissionQueue
from backend.admission.line import Line
from backend.admission.admission_ticket import Ticket
from backend.admission.seat import Seat
from tests.backend.admission_helpers import NEW, OLD, queue_of
from tests.not_none import not_none


def slot_of(ticket: Ticket) -> int | None:
    return not_none(ticket.seat).slot


def test_each_admission_holds_the_lowest_free_slot_id_and_a_release_returns_it():
    queue = queue_of(capacity=3)
    tickets = [queue.request() for _ in range(3)]
    assert [slot_of(t) for t in tickets] == [0, 1, 2]
    assert all(not_none(t.seat).engine is queue and not not_none(t.seat).pinned for t in tickets)

    tickets[1].release()
    again = queue.request()
    assert slot_of(again) == 1
    tickets[0].release()
    tickets[2].release()
    assert [slot_of(queue.request()) for _ in range(2)] == [0, 2]


def test_a_waiter_takes_the_slot_id_the_release_before_it_gave_back():
    queue = queue_of(capacity=2)
    first, second = queue.request(), queue.request()
    waiter = queue.request()
    assert waiter.seat is None
    second.release()
    assert waiter.admitted and slot_of(waiter) == 1
    assert slot_of(first) == 0


def test_a_shrink_stops_reissuing_the_ids_above_it_while_their_requests_finish():
    queue = queue_of(capacity=4)
    running = [queue.request() for _ in range(4)]
    queue.set_capacity(2)
    waiter = queue.request()

    running[3].release()
    running[0].release()
    assert not waiter.admitted  # 2 still run on 2 slots
    running[2].release()
    assert waiter.admitted and slot_of(waiter) == 0
    newcomer = queue.request()
    assert not newcomer.admitted  # slots 0 and 1 are held
    running[1].release()
    assert newcomer.admitted and slot_of(newcomer) == 1
    waiter.release()
    newcomer.release()
    assert [slot_of(queue.request()) for _ in range(2)] == [0, 1]
    assert queue.lowest_free_slot() is None


def test_growth_adds_ids_and_admits_waiters_on_them():
    queue = queue_of(capacity=1)
    held = queue.request()
    waiters = [queue.request() for _ in range(2)]
    queue.set_capacity(3)
    assert [slot_of(t) for t in waiters] == [1, 2]
    held.release()
    assert slot_of(queue.request()) == 0


def test_with_admission_off_requests_beyond_the_slots_hold_no_slot_id():
    queue = queue_of(capacity=1, enabled=False)
    first, beyond = queue.request(), queue.request()
    assert (slot_of(first), slot_of(beyond)) == (0, None)
    beyond.release()
    first.release()
    assert slot_of(queue.request()) == 0


def test_a_requeued_ticket_gives_its_slot_id_back():
    line: Line[AdmissionQueue] = Line("m")
    old = AdmissionQueue(Serving(OLD, 1), line=line)
    new = AdmissionQueue(Serving(NEW, 2), line=line)
    ticket = line.request()
    assert not_none(ticket.seat).engine is new and slot_of(ticket) == 0
    new_other = line.request()  # new: 1 free beside old's 1: the first joined wins the tie
    assert not_none(new_other.seat).engine is old
    assert ticket.requeue()  # the refusing engine's slot takes no one now; old is full
    assert not ticket.admitted and new.lowest_free_slot() == 0
    line.admit_waiting()
    assert ticket.admitted and not_none(ticket.seat) == Seat(new, 0)


def test_the_least_recent_free_seat_follows_releases_and_slots_the_steward_used():
    queue = queue_of(capacity=3)
    tickets = [queue.request() for _ in range(3)]
    for ticket in tickets:  # released in order: slot 0 longest ago
        ticket.release()
    assert queue.least_recent_free_seat().slot == 0
    queue.touch(0)  # the session steward's request used slot 0 (llama-server's LRU too)
    assert queue.least_recent_free_seat().slot == 1
    assert queue.slot_used(0)
