"""Optimistic admission: a request admitted on its prompt's byte bound while nobody
waits, then settled to its counted need, which gives the excess back to the line."""

from __future__ import annotations

import asyncio

from backend.llama.kv_capacity import KvCapacity, TokenNeed
from backend.llama.load import Serving
from backend.admission.admission_ticket import TicketState
from backend.admission.admission_registry import AdmissionRegistry
from tests.backend.admission_helpers import NEW, OLD, kv_queue_of, started
from tests.not_none import not_none


async def test_settling_gives_the_excess_back_and_admits_waiters_in_order():
    queue = kv_queue_of(slots=4, kv=KvCapacity.shared(10_000))
    bound = queue.request(TokenNeed(6_000, 2_000))  # the byte bound, not yet counted
    first = queue.request(TokenNeed(2_500, 500))    # 8,000 + 3,000 > 10,000: waits
    second = queue.request(TokenNeed(1_500, 500))   # behind the first, never passes it
    tasks = [await started(first), await started(second)]
    assert bound.admitted and queue.reserved_tokens == 8_000 and queue.waiting == 2

    returned = bound.settle(TokenNeed(1_500, 2_000))

    await asyncio.gather(*tasks)
    assert returned == 4_500
    assert first.admitted and second.admitted
    assert first.admitted_at is not None and second.admitted_at is not None
    assert queue.reserved_tokens == 3_500 + 3_000 + 2_000
    assert bound.need == TokenNeed(1_500, 2_000)


async def test_a_settle_that_frees_too_little_for_the_head_admits_no_one_behind_it():
    queue = kv_queue_of(slots=4, kv=KvCapacity.shared(10_000))
    bound = queue.request(TokenNeed(7_000, 1_000))
    head = queue.request(TokenNeed(4_000, 1_000))
    small = queue.request(TokenNeed(100, 100))
    bound.settle(TokenNeed(5_000, 1_000))  # 6,000 + 5,000 > 10,000: the head still waits
    assert queue.reserved_tokens == 6_000
    assert head.state is TicketState.WAITING and small.state is TicketState.WAITING
    for ticket in (head, small):
        ticket.release()


def test_settling_again_or_after_release_changes_nothing():
    queue = kv_queue_of(slots=2, kv=KvCapacity.shared(8_000))
    ticket = queue.request(TokenNeed(5_000, 1_000))
    assert ticket.settle(TokenNeed(2_000, 1_000)) == 3_000
    assert ticket.settle(TokenNeed(2_000, 1_000)) == 0
    assert queue.reserved_tokens == 3_000

    ticket.release()
    assert ticket.settle(TokenNeed(100, 100)) == 0
    assert queue.reserved_tokens == 0 and queue.idle


def test_a_count_above_the_bound_keeps_the_reservation():
    # The bound is an upper bound of the count: a larger "count" can only be a fault of
    # the bound, and growing behind the admission's back could overcommit the pool.
    queue = kv_queue_of(slots=2, kv=KvCapacity.shared(8_000))
    ticket = queue.request(TokenNeed(3_000, 1_000))
    assert ticket.settle(TokenNeed(7_000, 1_000)) == 0
    assert ticket.need == TokenNeed(3_000, 1_000) and queue.reserved_tokens == 4_000
    ticket.release()


def test_a_bound_fits_now_only_when_nobody_waits_and_the_tokens_are_free():
    queue = kv_queue_of(slots=2, kv=KvCapacity.shared(8_000, per_request=6_000))
    assert queue.fits_now(TokenNeed(5_000, 1_000))
    assert not queue.fits_now(TokenNeed(6_000, 1_000))  # above one request's limit
    running = queue.request(TokenNeed(3_000, 0))
    assert not queue.fits_now(TokenNeed(5_000, 1_000))  # 3,000 + 6,000 > 8,000
    assert queue.fits_now(TokenNeed(4_000, 1_000))
    waiter = queue.request(TokenNeed(6_000, 0))
    assert not queue.fits_now(TokenNeed(10, 10))  # someone waits: no one passes them
    waiter.release()
    running.release()


def test_a_retired_load_admits_no_bound_and_its_tickets_still_settle():
    registry = AdmissionRegistry()
    old = registry.activate(Serving(OLD, 2, kv=KvCapacity.shared(8_000)))
    ticket = old.request(TokenNeed(5_000, 1_000))
    registry.activate(Serving(NEW, 2, kv=KvCapacity.shared(8_000)))  # the engine restarted
    assert old.retired and not old.fits_now(TokenNeed(10, 10))

    # It still runs on the old engine: what it holds there shrinks with the count.
    assert ticket.settle(TokenNeed(1_000, 1_000)) == 4_000
    assert old.reserved_tokens == 2_000 and not_none(registry.current).reserved_tokens == 0
    ticket.release()
    assert registry.queues == [registry.current]


async def test_a_ticket_sent_back_in_line_waits_with_its_settled_need():
    queue = kv_queue_of(slots=2, kv=KvCapacity.shared(8_000))
    other = queue.request(TokenNeed(2_000, 0))
    ticket = queue.request(TokenNeed(6_000, 0))
    assert ticket.requeue()  # the connection was refused: back in line, nothing held
    assert queue.reserved_tokens == 2_000 and queue.waiting == 1
    waiting = await started(ticket)  # a requeue admits no one by itself

    ticket.settle(TokenNeed(3_000, 0))  # the settle tries the head: admitted, smaller
    await waiting
    assert ticket.admitted and queue.reserved_tokens == 5_000
    other.release()
    ticket.release()
    assert queue.reserved_tokens == 0
