"""One AdmissionQueue: bounded FIFO, no leaked places, O(1) leaving, Retry-After,
and admission by free slots and free KV tokens."""

from __future__ import annotations

import asyncio
import random

import pytest

from backend.llama.kv_capacity import KvCapacity, TokenNeed
from backend.llama.load import Serving
from backend.admission.engine_queue import AdmissionQueue
from backend.admission.admission_ticket import Ticket, TicketState, WaitReason
from backend.admission.flow import Flow
from backend.admission.admission_registry import AdmissionRegistry
from backend.errors import ContextLengthExceeded, ModelNotReady, QueueFull, QueueTimeout
from tests.backend.admission_helpers import OLD, FakeClock, kv_queue_of, queue_of, started
from tests.not_none import not_none


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
    assert all(not_none(error.retry_after) >= 1 for error in refusals)
    assert all(error.code == "server_is_overloaded" for error in refusals)
    assert queue.waiting == 3 and queue.active == 1


def test_unbounded_line_when_max_waiting_is_zero():
    queue = queue_of(capacity=1, max_waiting=0)
    for _ in range(1000):
        queue.request()
    assert queue.waiting == 999


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
        AdmissionQueue(Serving(OLD, 0))
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


@pytest.mark.timeout(30)
def test_cancelling_the_middle_of_a_long_line_is_fast_and_keeps_order():
    queue = queue_of(capacity=1)
    running = queue.request()
    tickets = [queue.request() for _ in range(100_000)]

    for ticket in tickets[25_000:75_000]:
        ticket.release()

    assert queue.waiting == 50_000
    survivors = tickets[:25_000] + tickets[75_000:]
    assert list(queue.line) == survivors
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
    queue = registry.activate(Serving(OLD, 1))
    queue.request()
    registry.retire_current()
    with pytest.raises(ModelNotReady) as caught:
        queue.request()
    assert not_none(caught.value.retry_after) >= 1


# --- KV tokens ---------------------------------------------------------------------


def test_unified_cache_admits_while_the_needs_fit_and_then_holds_a_free_slot_back():
    queue = kv_queue_of(4, KvCapacity.shared(10_000))
    first, second = queue.request(need=4_000), queue.request(need=4_000)
    third = queue.request(need=4_000)

    assert first.admitted and second.admitted
    assert third.state is TicketState.WAITING  # a slot is free, the tokens are not
    assert queue.active == 2 and queue.waiting == 1
    assert queue.reserved_tokens == 8_000 and queue.kv_capacity == 10_000


def test_release_returns_the_tokens_and_admits_the_head_that_now_fits():
    queue = kv_queue_of(4, KvCapacity.shared(10_000))
    first = queue.request(need=TokenNeed(prompt=5_000, output=1_000))
    waiting = queue.request(need=TokenNeed(prompt=3_000, output=2_000))
    assert not waiting.admitted

    first.release()

    assert waiting.admitted
    assert queue.reserved_tokens == 5_000 and queue.active == 1
    waiting.release()
    assert queue.reserved_tokens == 0 and queue.idle


def test_mixed_sizes_are_admitted_in_arrival_order():
    queue = kv_queue_of(4, KvCapacity.shared(8_000))
    order: list[int] = []
    needs = [3_000, 6_000, 1_000, 2_000, 500]
    tickets = [queue.request(need=n) for n in needs]

    def admitted_now() -> None:
        for index, ticket in enumerate(tickets):
            if ticket.admitted and index not in order:
                order.append(index)

    admitted_now()
    assert order == [0]  # 6,000 does not fit beside 3,000; nobody passes it
    tickets[0].release()
    admitted_now()
    assert order == [0, 1, 2]  # 6,000 + 1,000 fit; 2,000 more would not
    tickets[2].release()
    admitted_now()
    assert order == [0, 1, 2, 3]  # 6,000 + 2,000 = 8,000 fits exactly
    assert tickets[4].position == 0 and queue.reserved_tokens == 8_000
    tickets[1].release()
    admitted_now()
    assert order == [0, 1, 2, 3, 4]


def test_a_big_head_blocks_smaller_requests_behind_it_and_is_not_starved():
    """The documented rule: no request passes the head, however small."""
    queue = kv_queue_of(8, KvCapacity.shared(10_000))
    running = [queue.request(need=2_000) for _ in range(3)]  # 6,000 held
    big = queue.request(need=9_000)
    small = [queue.request(need=500) for _ in range(4)]  # each would fit beside 6,000

    assert not big.admitted and not any(t.admitted for t in small)
    assert queue.waiting == 5

    # Short turns keep finishing; nobody new is let in ahead of the big head.
    running[0].release()
    running[1].release()
    assert not big.admitted and queue.active == 1 and queue.reserved_tokens == 2_000
    running[2].release()

    assert big.admitted
    assert [t.admitted for t in small] == [True, True, False, False]  # 9,000 + 2 x 500
    assert queue.reserved_tokens == 10_000


def test_cancelling_a_blocked_head_lets_the_next_in_line_start():
    queue = kv_queue_of(4, KvCapacity.shared(10_000))
    queue.request(need=6_000)
    big = queue.request(need=9_000)
    small = queue.request(need=1_000)

    big.release()

    assert small.admitted and queue.waiting == 0 and queue.reserved_tokens == 7_000


def test_a_need_that_can_never_fit_is_refused_at_once_with_the_numbers():
    queue = kv_queue_of(4, KvCapacity.shared(32_768, per_request=16_384))
    queue.request(need=1_000)

    with pytest.raises(ContextLengthExceeded) as refused:
        queue.request(need=TokenNeed(prompt=15_000, output=4_096))

    error = refused.value
    assert error.status == 400 and error.type == "invalid_request_error"
    assert error.code == "context_length_exceeded"
    assert "15,000 prompt tokens" in str(error) and "4,096 tokens of output" in str(error)
    assert "16,384" in str(error) and "19,096" in str(error)
    assert queue.waiting == 0 and queue.active == 1 and queue.reserved_tokens == 1_000


def test_a_need_of_exactly_the_limit_is_admitted():
    queue = kv_queue_of(1, KvCapacity.shared(4_096))
    assert queue.request(need=TokenNeed(prompt=4_000, output=96)).admitted


def test_split_cache_runs_every_slot_when_each_need_fits_a_slot_share():
    kv = KvCapacity.split(16_384, slots=4)
    queue = kv_queue_of(4, kv)
    assert kv.per_request == 4_096 and not kv.unified

    four = [queue.request(need=4_000) for _ in range(4)]
    fifth = queue.request(need=100)

    assert all(t.admitted for t in four)  # 16,000 of 16,384: each has its own share
    assert not fifth.admitted  # waits for a slot, as before
    with pytest.raises(ContextLengthExceeded):
        queue.request(need=5_000)  # fits the pool, never one slot


def test_unified_cache_lets_one_request_use_more_than_a_slot_share():
    queue = kv_queue_of(4, KvCapacity.shared(16_384))
    long_prompt = queue.request(need=12_000)
    other = queue.request(need=5_000)

    assert long_prompt.admitted and not other.admitted
    long_prompt.release()
    assert other.admitted


def test_short_requests_run_as_many_at_once_as_there_are_slots():
    queue = kv_queue_of(4, KvCapacity.shared(16_384))
    tickets = [queue.request(need=TokenNeed(prompt=300, output=2_048)) for _ in range(4)]
    assert all(t.admitted for t in tickets) and queue.active == 4


def test_unknown_need_is_admitted_by_slots_alone():
    queue = kv_queue_of(3, KvCapacity.shared(1_000))
    queue.request(need=1_000)  # the whole pool

    unknown, zero = queue.request(), queue.request(need=0)

    assert unknown.admitted and zero.admitted
    assert queue.reserved_tokens == 1_000
    assert queue.request(need=None).state is TicketState.WAITING  # slots are full


def test_a_queue_without_kv_capacity_counts_tokens_but_admits_by_slots():
    queue = queue_of(capacity=2)
    first, second = queue.request(need=50_000), queue.request(need=50_000)
    assert first.admitted and second.admitted
    assert queue.reserved_tokens == 100_000 and queue.kv_capacity == 0


def test_kv_waiters_count_against_the_line_bound():
    queue = kv_queue_of(4, KvCapacity.shared(1_000), max_waiting=1)
    queue.request(need=900)
    queue.request(need=900)
    with pytest.raises(QueueFull):
        queue.request(need=10)
    assert queue.waiting == 1 and queue.active == 1


async def test_a_kv_waiter_times_out_like_a_slot_waiter():
    queue = kv_queue_of(4, KvCapacity.shared(1_000))
    queue.request(need=900)
    waiting = queue.request(need=900)

    with pytest.raises(QueueTimeout):
        await waiting.wait(0.01)

    assert queue.waiting == 0 and queue.reserved_tokens == 900


async def test_a_smaller_cache_refuses_the_waiters_that_no_longer_fit():
    queue = kv_queue_of(2, KvCapacity.shared(8_000))
    queue.request(need=7_000)
    too_big = queue.request(need=6_000)
    fits = queue.request(need=1_000)
    task = await started(too_big)

    queue.set_capacity(2, kv=KvCapacity.shared(4_000))

    with pytest.raises(ContextLengthExceeded):
        await task
    assert too_big.state is TicketState.REFUSED
    assert fits.position == 0  # 7,000 still held on a 4,000 pool: running goes on
    assert queue.capacity == 2 and not_none(queue.kv).total == 4_000


def test_set_capacity_without_kv_keeps_the_cache():
    kv = KvCapacity.shared(8_000)
    queue = kv_queue_of(2, kv)
    queue.set_capacity(3)
    assert queue.kv is kv


def test_disabled_admission_ignores_tokens_too_but_still_counts_them():
    queue = AdmissionQueue(Serving(OLD, 1, kv=KvCapacity.shared(1_000)), enabled=False)
    tickets = [queue.request(need=900) for _ in range(3)]
    assert all(t.admitted for t in tickets) and queue.reserved_tokens == 2_700


def test_kv_capacity_rejects_impossible_sizes():
    with pytest.raises(ValueError):
        KvCapacity(0, 0, unified=True)
    with pytest.raises(ValueError):
        KvCapacity.shared(4_096, per_request=8_192)
    with pytest.raises(ValueError):
        kv_queue_of(1, KvCapacity.shared(10)).request(need=-1)


def test_random_traffic_keeps_the_token_books_straight_and_the_order_fifo():
    """Seeded random requests, releases and cancellations on a unified cache."""
    rng = random.Random(9)
    kv = KvCapacity.shared(16_384, per_request=12_000)
    queue = kv_queue_of(4, kv)
    live: list[Ticket] = []
    admitted_order: list[Ticket] = []
    arrival: dict[Ticket, int] = {}
    for step in range(5_000):
        action = rng.random()
        if action < 0.5:
            need = TokenNeed(rng.randrange(1, 11_000), rng.randrange(0, 2_000))
            try:
                ticket = queue.request(need=need)
            except ContextLengthExceeded:
                assert need.total > kv.per_request
                continue
            assert need.total <= kv.per_request
            arrival[ticket] = step
            live.append(ticket)
        elif live:
            ticket = live.pop(rng.randrange(len(live)))
            ticket.release()  # a finished request, or a waiter that gave up
        for ticket in live:
            if ticket.admitted and ticket not in admitted_order:
                admitted_order.append(ticket)
        running = [t for t in live if t.admitted]
        assert queue.reserved_tokens == sum(t.tokens for t in running)
        assert queue.reserved_tokens <= kv.total and queue.active == len(running) <= 4
        waiting = [t for t in live if t.state is TicketState.WAITING]
        assert queue.waiting == len(waiting)
        if waiting:  # the head waits only because it does not fit now, or because a
            # long prompt is computed beside running streams (the prefill budget)
            head = min(waiting, key=arrival.__getitem__)
            assert (queue.active == 4 or queue.reserved_tokens + head.tokens > kv.total
                    or head.wait_reason == "prefill_budget")
    steps = [arrival[t] for t in admitted_order]
    assert steps == sorted(steps)  # admitted in arrival order, never passed


def test_a_waiter_is_told_why_it_waited_and_whose_share_went_first():
    queue = queue_of(capacity=1)
    line = queue.line
    flood, colleague = Flow("flood"), Flow("colleague")
    running = line.request(flow=flood)
    second = line.request(flow=flood)
    theirs = line.request(flow=colleague)
    assert running.wait_reason is None
    assert second.wait_reason == theirs.wait_reason == WaitReason.SLOTS_FULL
    running.release()  # the colleague's fair share goes first, though it came later
    assert theirs.admitted and not second.admitted
    theirs.release()
    assert second.admitted
    assert (second.wait_reason, second.waited_behind) == (WaitReason.FAIR_SHARE, "colleague")
    assert (theirs.wait_reason, theirs.waited_behind) == (WaitReason.SLOTS_FULL, None)


def test_a_waiter_held_by_its_keys_concurrency_or_the_cache_says_so():
    queue = kv_queue_of(3, KvCapacity(total=1000, per_request=1000, unified=True))
    line = queue.line
    limited = Flow("limited", max_concurrent=1)
    line.request(flow=limited)
    assert line.request(flow=limited).wait_reason == WaitReason.KEY_CONCURRENCY
    big = Flow("big")
    line.request(TokenNeed(900, 0), flow=big)
    # A slot is free, the cache is not.
    assert line.request(TokenNeed(900, 0), flow=big).wait_reason == WaitReason.KV_FULL


def test_a_keys_request_behind_its_own_waiting_one_waits_for_its_key_not_the_slots():
    queue = queue_of(capacity=1)
    line = queue.line
    running = line.request(flow=Flow("busy"))
    limited = Flow("limited", max_concurrent=1)
    first, second = line.request(flow=limited), line.request(flow=limited)
    assert first.wait_reason == WaitReason.SLOTS_FULL
    # However many slots free up, it runs only once the key's first one ended.
    assert second.wait_reason == WaitReason.KEY_CONCURRENCY
    running.release()
    assert first.admitted and not second.admitted
    first.release()
    assert second.admitted and second.wait_reason == WaitReason.KEY_CONCURRENCY


def test_an_engine_not_measured_after_its_load_is_timed_by_its_answers_prefills():
    # An attached llama-server: no speed measured here; placement bounds a session's wait
    # for it by how long computing the session's prompt elsewhere would take.
    queue = AdmissionQueue(Serving("http://elsewhere:8080", slots=2))
    assert queue.prefill_seconds(2000) is None
    queue.observe_prefill(40, 9.0)  # a short prefill is mostly the request's overhead
    assert queue.prefill_seconds(2000) is None
    queue.observe_prefill(1000, 5.0)
    assert queue.prefill_seconds(2000) == pytest.approx(10.0)
    queue.observe_prefill(500, 5.0)  # slower now (a busier machine): it moves that way
    assert 10.0 < not_none(queue.prefill_seconds(2000)) < 20.0
