"""A caller's limits at the port, decided without a server: which flow a caller gets, which
models its key may use, its token reservations and how they settle, its refusals by reason,
and its running requests ended when the key is revoked.

Real parts: the KeyStore (in the per-test config dir), the RateLimiter and the UsageLedger,
both on one injected clock.  The only stand-in is `Running`, a tiny `Endable` (the protocol
flow_control defines for a request under way)."""

from __future__ import annotations

import pytest

from backend.errors import ModelNotAllowed, RateLimitExceeded, RequestError
from backend.keys.key_store import OWNER, KeyStore, Priority
from backend.admission.caller import ADDRESS_FLOW, Caller
from backend.admission.flow import Band, Flow
from backend.admission.flow_control import FlowControl, key_band, requested_band
from backend.admission.rate_limits import RateLimiter
from backend.keys.usage import UsageLedger
from tests.backend.admission.test_rate_limits import T0, Clock
from tests.not_none import not_none



class Running:
    """A request under way: remembers the error it was ended with."""

    def __init__(self, will_end: bool = True) -> None:
        self.will_end = will_end
        self.ended_with: RequestError | None = None

    def end(self, error: RequestError) -> bool:
        self.ended_with = error
        return self.will_end


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def store(clock: Clock) -> KeyStore:
    return KeyStore(wall_clock=clock)


@pytest.fixture
def ledger(clock: Clock) -> UsageLedger:
    return UsageLedger(clock=clock)


@pytest.fixture
def flows(clock: Clock, ledger: UsageLedger) -> FlowControl:
    return FlowControl(RateLimiter(clock), ledger)


def caller_of(store: KeyStore, name: str) -> Caller:
    """The caller the access guard makes for a request with the named key."""
    return Caller(name, not_none(store.get(name)))


def remaining(flows: FlowControl, caller: Caller) -> int:
    return int(flows.headers(caller)["x-ratelimit-remaining-tokens"])


# --- the flow a caller gets -----------------------------------------------------------------


def test_a_named_key_flows_with_its_weight_band_and_concurrency(
        store: KeyStore, flows: FlowControl) -> None:
    store.add("agent", weight=3.0, priority=Priority.BATCH, max_concurrent=2)
    flow = flows.flow_of(caller_of(store, "agent"))
    assert flow == Flow("agent", weight=3.0, band=Band.BATCH, max_concurrent=2)


def test_a_key_without_a_concurrency_limit_has_none(store: KeyStore,
                                                    flows: FlowControl) -> None:
    store.add("free", priority=Priority.INTERACTIVE)
    flow = flows.flow_of(caller_of(store, "free"))
    assert (flow.max_concurrent, flow.band) == (0, Band.INTERACTIVE)


def test_the_owner_and_an_address_get_a_plain_flow_of_their_own(flows: FlowControl) -> None:
    assert flows.flow_of(Caller(OWNER.name, OWNER)) == Flow(OWNER.name)
    address = ADDRESS_FLOW + "10.0.0.7"
    assert flows.flow_of(Caller(address)) == Flow(address)
    assert flows.flow_of(Caller(ADDRESS_FLOW + "10.0.0.8")).key != address


def test_an_edited_key_gets_its_new_limits_at_once(store: KeyStore,
                                                   flows: FlowControl) -> None:
    store.add("agent", max_concurrent=1)
    assert flows.flow_of(caller_of(store, "agent")).max_concurrent == 1
    store.edit("agent", max_concurrent=4, weight=2.0)
    flow = flows.flow_of(caller_of(store, "agent"))
    assert (flow.max_concurrent, flow.weight) == (4, 2.0)


def test_band_of_a_key_and_the_band_a_request_asks_for(store: KeyStore) -> None:
    record, _ = store.add("bulk", priority=Priority.BATCH)
    assert key_band(record) is Band.BATCH
    assert requested_band([(b"x-priority", b" Batch ")]) is Band.BATCH
    assert requested_band([(b"accept", b"*/*"), (b"x-priority", b"interactive")]) \
        is Band.INTERACTIVE
    assert requested_band([(b"x-priority", b"urgent")]) is None
    assert requested_band([]) is None


# --- models ------------------------------------------------------------------------------------


def test_a_key_may_use_its_listed_models_and_patterns(store: KeyStore,
                                                      flows: FlowControl) -> None:
    store.add("agent", models=("qwen*", "llama-3"))
    caller = caller_of(store, "agent")
    flows.check_model(caller, "qwen2.5-7b")
    flows.check_model(caller, "llama-3")
    with pytest.raises(ModelNotAllowed) as refused:
        flows.check_model(caller, "llama-3-70b")
    assert refused.value.status == 403
    assert "'llama-3-70b'" in str(refused.value)
    assert "qwen*, llama-3" in str(refused.value)


def test_the_owner_a_key_without_models_and_an_address_may_use_any(
        store: KeyStore, flows: FlowControl) -> None:
    store.add("any")
    for caller in (caller_of(store, "any"), Caller(OWNER.name, OWNER),
                   Caller(ADDRESS_FLOW + "10.0.0.7")):
        flows.check_model(caller, "whatever-model")


# --- tokens: reserve, settle -------------------------------------------------------------------


def test_a_short_answer_gives_back_its_unused_reservation_within_the_minute(
        store: KeyStore, flows: FlowControl) -> None:
    store.add("agent", tokens_per_minute=1000)
    caller = caller_of(store, "agent")
    reservation = flows.reserve(caller, 800)
    assert remaining(flows, caller) == 200
    with pytest.raises(RateLimitExceeded):
        flows.reserve(caller, 800)
    flows.answered(caller, reservation, (30, 20))  # it used 50 of its 800
    assert remaining(flows, caller) == 950
    assert flows.reserve(caller, 900) is not None  # no time passed


def test_a_cut_stream_is_booked_what_it_got(store: KeyStore, flows: FlowControl,
                                            ledger: UsageLedger) -> None:
    store.add("agent", tokens_per_day=10_000)
    caller = caller_of(store, "agent")
    reservation = flows.reserve(caller, 2_000)
    flows.answered(caller, reservation, (120, 35))  # the tokens it got before the cut
    assert remaining(flows, caller) == 10_000 - 155
    usage = ledger.usage("agent")
    assert (usage.requests, usage.prompt_tokens, usage.completion_tokens) == (1, 120, 35)


def test_an_answer_without_usage_stays_counted_in_full(store: KeyStore, flows: FlowControl,
                                                       ledger: UsageLedger) -> None:
    store.add("agent", tokens_per_minute=1000)
    caller = caller_of(store, "agent")
    flows.answered(caller, flows.reserve(caller, 700), None)
    assert remaining(flows, caller) == 300
    assert ledger.usage("agent").requests == 1


def test_a_minute_later_the_window_is_whole_again(store: KeyStore, flows: FlowControl,
                                                  clock: Clock) -> None:
    store.add("agent", tokens_per_minute=600)
    caller = caller_of(store, "agent")
    flows.answered(caller, flows.reserve(caller, 600), (400, 200))
    with pytest.raises(RateLimitExceeded):
        flows.reserve(caller, 10)
    clock.now += 60
    assert remaining(flows, caller) == 600


def test_callers_without_token_limits_reserve_nothing(store: KeyStore,
                                                      flows: FlowControl) -> None:
    store.add("unlimited")
    for caller in (caller_of(store, "unlimited"), Caller(OWNER.name, OWNER),
                   Caller(ADDRESS_FLOW + "10.0.0.7")):
        assert flows.reserve(caller, 10**9) is None
        assert flows.headers(caller) == {}
        flows.answered(caller, None, (5, 5))


def test_one_keys_tokens_do_not_count_against_another(store: KeyStore,
                                                      flows: FlowControl) -> None:
    store.add("a", tokens_per_minute=100)
    store.add("b", tokens_per_minute=100)
    flows.reserve(caller_of(store, "a"), 100)
    assert remaining(flows, caller_of(store, "b")) == 100


# --- usage: waits and refusals -----------------------------------------------------------------


def test_waits_and_answers_are_counted_per_key(store: KeyStore, flows: FlowControl,
                                               ledger: UsageLedger) -> None:
    store.add("agent")
    caller = caller_of(store, "agent")
    flows.admitted(caller, 1.5)
    flows.admitted(caller, 0.5)
    flows.answered(caller, None, (10, 4))
    flows.answered(Caller(ADDRESS_FLOW + "10.0.0.7"), None, (1, 1))
    usage = ledger.usage("agent")
    assert (usage.waits, usage.mean_wait, usage.total_tokens) == (2, 1.0, 14)
    assert ledger.usage("anonymous").requests == 1  # never by address


def test_refusals_are_counted_by_reason(store: KeyStore, flows: FlowControl,
                                        ledger: UsageLedger) -> None:
    store.add("agent", models=("qwen*",), tokens_per_minute=100)
    caller = caller_of(store, "agent")
    for _ in range(2):
        try:
            flows.reserve(caller, 500)
        except RateLimitExceeded as error:
            flows.refused(caller, error)
    try:
        flows.check_model(caller, "llama")
    except ModelNotAllowed as error:
        flows.refused(caller, error)
    assert ledger.usage("agent").refusals == {"tokens_per_minute": 2,
                                              "model_not_allowed": 1}


def test_a_refused_reservation_is_given_back_in_full(store: KeyStore, flows: FlowControl,
                                                     ledger: UsageLedger) -> None:
    store.add("agent", tokens_per_minute=1000)
    caller = caller_of(store, "agent")
    reservation = flows.reserve(caller, 900)
    flows.refused(caller, RequestError("the queue is full"), reservation)
    assert remaining(flows, caller) == 1000
    # Settling again (an answer racing the refusal) changes nothing.
    flows.answered(caller, reservation, (900, 900))
    assert remaining(flows, caller) == 1000
    assert sum(ledger.usage("agent").refusals.values()) == 1


# --- running requests, ended on revocation -----------------------------------------------------


def test_a_revoked_keys_running_requests_are_ended(store: KeyStore,
                                                   flows: FlowControl) -> None:
    store.add("agent")
    store.add("other")
    caller, other = caller_of(store, "agent"), caller_of(store, "other")
    first, second, bystander = Running(), Running(), Running()
    flows.started(caller, first)
    flows.started(caller, second)
    flows.started(other, bystander)
    assert flows.running_flows() == {"agent", "other"}
    error = not_none(store.revoke("agent").refusal(T0))
    assert flows.end_flow("agent", error) == 2
    assert first.ended_with is error and second.ended_with is error
    assert bystander.ended_with is None


def test_a_finished_request_is_not_ended_later(store: KeyStore, flows: FlowControl) -> None:
    store.add("agent")
    caller = caller_of(store, "agent")
    done, going = Running(), Running()
    flows.started(caller, done)
    flows.started(caller, going)
    flows.finished(caller, done)
    assert flows.end_flow("agent", RequestError("revoked")) == 1
    assert done.ended_with is None and going.ended_with is not None
    flows.finished(caller, going)
    assert flows.running_flows() == set()
    assert flows.end_flow("agent", RequestError("revoked")) == 0


def test_end_flow_counts_only_requests_that_will_end(store: KeyStore,
                                                     flows: FlowControl) -> None:
    store.add("agent")
    caller = caller_of(store, "agent")
    flows.started(caller, Running(will_end=False))  # already over: nothing to end
    flows.started(caller, Running())
    assert flows.end_flow("agent", RequestError("revoked")) == 1


def test_the_owners_and_addresses_requests_are_not_tracked(flows: FlowControl) -> None:
    owner, address = Caller(OWNER.name, OWNER), Caller(ADDRESS_FLOW + "10.0.0.7")
    for caller in (owner, address):
        flows.started(caller, Running())
        flows.finished(caller, Running())  # finishing what was never started is harmless
    assert flows.running_flows() == set()
    assert flows.end_flow(OWNER.name, RequestError("x")) == 0


# --- the pass the relay holds ------------------------------------------------------------------


def test_a_pass_is_refused_for_a_model_its_key_may_not_use(store: KeyStore,
                                                          flows: FlowControl) -> None:
    store.add("agent", models=("qwen*",))
    with pytest.raises(ModelNotAllowed):
        flows.enter(caller_of(store, "agent"), "llama")
    assert flows.enter(caller_of(store, "agent"), "qwen-7b").flow.key == "agent"


def test_a_pass_books_its_answer_once_however_its_ending_is_told(
        store: KeyStore, flows: FlowControl, ledger: UsageLedger) -> None:
    store.add("agent", tokens_per_minute=1000)
    passage = flows.enter(caller_of(store, "agent"), "m")
    passage.reserve(600)
    assert int(passage.headers()["x-ratelimit-remaining-tokens"]) == 400
    passage.admitted(0.25)
    passage.answered((100, 50))
    passage.answered((100, 50))          # told twice (a cut stream racing its end)
    passage.refused(RequestError("x"))   # or refused afterwards: nothing changes
    passage.left()
    assert remaining(flows, passage.caller) == 850
    usage = ledger.usage("agent")
    assert (usage.requests, usage.total_tokens, usage.waits, usage.refusals) == (1, 150, 1, {})


def test_a_pass_that_left_before_its_turn_gives_its_reservation_back_unbooked(
        store: KeyStore, flows: FlowControl, ledger: UsageLedger) -> None:
    store.add("agent", tokens_per_minute=1000)
    passage = flows.enter(caller_of(store, "agent"), "m")
    passage.reserve(900)
    passage.left()
    assert remaining(flows, passage.caller) == 1000
    assert ledger.usage("agent").requests == 0 and ledger.usage("agent").refusals == {}


def test_a_refused_pass_gives_its_reservation_back_and_counts_the_reason(
        store: KeyStore, flows: FlowControl, ledger: UsageLedger) -> None:
    store.add("agent", tokens_per_minute=1000)
    passage = flows.enter(caller_of(store, "agent"), "m")
    passage.reserve(900)
    passage.refused(RequestError("the queue is full"))
    assert remaining(flows, passage.caller) == 1000
    assert sum(ledger.usage("agent").refusals.values()) == 1


def test_a_running_pass_is_ended_with_its_revoked_key_until_it_closes(
        store: KeyStore, flows: FlowControl) -> None:
    store.add("agent")
    passage, request = flows.enter(caller_of(store, "agent"), "m"), Running()
    passage.start(request)
    assert flows.end_flow("agent", RequestError("revoked")) == 1
    passage.close()
    passage.close()  # closing twice is harmless
    assert flows.running_flows() == set()


def test_spent_windows_refuse_before_a_load_and_keep_nothing(store: KeyStore,
                                                            flows: FlowControl) -> None:
    store.add("agent", tokens_per_minute=100)
    caller = caller_of(store, "agent")
    flows.check_spent(caller)
    assert remaining(flows, caller) == 100
    flows.reserve(caller, 100)
    with pytest.raises(RateLimitExceeded):
        flows.check_spent(caller)
