"""A line whose placement keeps prefixes (the default), without I/O: a session's turns
go back to where its prefix is, a turn waits for its engine within the fairness bound,
and a warm agent's share is charged the tokens the engine's cache lacked."""

from __future__ import annotations

from backend.admission.engine_queue import AdmissionQueue
from backend.admission.line import MAX_PASSES, Line
from backend.admission.admission_ticket import Ticket, WaitReason
from backend.admission.flow import Flow
from backend.admission.hint import Hint
from backend.admission.placement import HOME_WAIT, NEW_SESSION_WAIT, KeepPrefixes
from backend.admission.seat import Seat
from backend.llama.kv_capacity import KvCapacity, TokenNeed
from backend.llama.load import Serving
from tests.backend.admission_helpers import NEW, NEWER, OLD, FakeClock, told_served
from tests.not_none import not_none


def line_of(clock: FakeClock) -> tuple[Line, KeepPrefixes]:
    policy = KeepPrefixes(clock=clock)
    return Line("m", clock=clock, placement=policy), policy


def engine(line: Line, url: str, slots: int, *, pin_any_slot: bool = True) -> AdmissionQueue:
    kv = KvCapacity.split(4096 * slots, slots)
    return AdmissionQueue(Serving(url, slots, kv=kv, pin_any_slot=pin_any_slot), line=line)


def turn(line: Line, session: str, flow: str = "alice", need: int = 1000) -> Ticket:
    return line.request(TokenNeed(need, 0), flow=Flow(flow),
                        hint=Hint(f"{flow}\n{session}", flow=flow))


def answered(policy: KeepPrefixes, ticket: Ticket, prompt: int, cached: int = 0) -> None:
    """The relay's part: the ticket is released, then its settlement tells the session
    book where the turn's prefix went."""
    hint = ticket.hint
    ticket.release()
    told_served(policy.sessions, hint.session, hint.flow, hint.prefix, ticket.seat,
                "this machine", prompt, cached)


def test_the_default_placement_keeps_prefixes():
    assert isinstance(Line("m").placement, KeepPrefixes)


def test_each_agent_comes_back_to_its_own_slot_on_an_engine_with_more_agents_than_slots():
    clock = FakeClock()
    line, policy = line_of(clock)
    only = engine(line, OLD, 2)
    first = {name: turn(line, name) for name in ("a", "b")}
    # As llama-server picks idle slots by LRU: never used ones first, the highest id first.
    assert [not_none(t.seat).slot for t in first.values()] == [1, 0]
    for name, ticket in first.items():
        answered(policy, ticket, 900)
    again = turn(line, "a")
    assert not_none(again.seat) == Seat(only, 1, pinned=True, cached=900)
    third = turn(line, "c")  # the slot released longest ago is b's: pinned, b to the RAM cache
    assert not_none(third.seat) == Seat(only, 0, pinned=True)
    answered(policy, again, 1000, 900)
    answered(policy, third, 900)
    back = turn(line, "b")  # its slot was taken: the least recently used one, a's
    assert not_none(back.seat).slot == 1 and not_none(back.seat).pinned
    assert not_none(turn(line, "c").seat) == Seat(only, 0, pinned=True, cached=900)


def test_a_turn_waits_for_its_engine_passed_at_most_max_passes_times_then_home_wait_ends_it():
    clock = FakeClock()
    line, policy = line_of(clock)
    near, home = engine(line, OLD, 1), engine(line, NEW, 1)
    first = turn(line, "s")
    assert not_none(first.seat).engine is near  # both free: the first joined
    answered(policy, first, 900)
    answered(policy, turn(line, "z", flow="erin"), 900)  # a new session: where none lives
    near_holder = turn(line, "x", flow="carol")  # keeps `near` busy for a while
    assert not_none(near_holder.seat).engine is near
    busy = turn(line, "y", flow="dave")
    assert not_none(busy.seat).engine is home

    waiting = turn(line, "s")  # its engine (`near`) is full, `home` is too
    admitted = []
    for i in range(MAX_PASSES + 1):
        busy.release()  # `home` frees a slot: others go there, passing the session
        busy = turn(line, f"o{i}", flow=f"other{i}")
        admitted.append(busy.admitted)
    assert admitted == [True] * MAX_PASSES + [False]
    assert not waiting.admitted  # a barrier now: nothing passes it
    last = busy

    clock.now += HOME_WAIT  # waited long enough for its engine: anywhere
    line.admit_waiting()
    assert waiting.admitted and not_none(waiting.seat).engine is home
    near_holder.release()  # its own engine frees: the one that could not pass goes there,
    # a new session, once it waited NEW_SESSION_WAIT for `home`, where fewer live
    assert not last.admitted
    clock.now += NEW_SESSION_WAIT
    line.admit_waiting()
    assert last.admitted and not_none(last.seat).engine is near


def test_a_warm_agent_is_charged_the_tokens_the_cache_lacked_a_cold_one_all():
    clock = FakeClock()
    line, policy = line_of(clock)
    engine(line, NEWER, 1)
    warm_first = turn(line, "w", flow="warm")
    answered(policy, warm_first, 900)
    holder = turn(line, "h", flow="holder")  # the slot is taken: everyone waits
    waiting = [turn(line, "w", flow="warm") for _ in range(12)]
    waiting += [turn(line, f"c{i}", flow="cold") for i in range(12)]
    holder.release()
    order = []
    for _ in range(11):
        admitted = next(t for t in waiting if t.admitted)
        order.append(admitted.flow.key)
        waiting.remove(admitted)
        answered(policy, admitted, 900 if admitted.flow.key == "warm" else 1000)
    # The warm agent's 1,000-token turns cost its share 100 (its cache held 900), the cold
    # one's 1,000: about ten warm turns to one cold, and the cold one is served all the same.
    assert order.count("cold") in (1, 2) and order.count("warm") >= 9


LONG_TURN = 3_000  # prompt tokens: long for the prefill budget unless mostly cached


def test_a_warm_long_turn_goes_back_to_its_engine_though_the_other_runs_fewer_streams():
    clock = FakeClock()
    line, policy = line_of(clock)
    home, other = engine(line, OLD, 2), engine(line, NEW, 2)
    first = turn(line, "a", need=LONG_TURN - 400)
    assert not_none(first.seat).engine is home  # both free: the first joined
    answered(policy, first, LONG_TURN - 400)
    answered(policy, turn(line, "b", flow="bob"), 900)  # a new session: where none lives
    stream = turn(line, "c", flow="carol", need=100)  # a stream on its engine, none on the other
    assert not_none(stream.seat).engine is home

    again = turn(line, "a", need=LONG_TURN)  # long, but 2,600 of it are in home's cache
    assert again.admitted and not_none(again.seat).engine is home
    assert not_none(again.seat).cached == LONG_TURN - 400


def test_the_prefill_budget_counts_only_the_new_tokens_of_a_warm_sessions_turn():
    clock = FakeClock()
    line, policy = line_of(clock)
    engine(line, OLD, 4)
    first = turn(line, "a", need=LONG_TURN - 400)
    answered(policy, first, LONG_TURN - 400)
    stream = turn(line, "s", flow="bob", need=100)
    cold = turn(line, "c", flow="carol", need=LONG_TURN)  # computed beside the stream
    assert stream.admitted and cold.admitted

    warm = turn(line, "a", need=LONG_TURN)  # 400 new tokens: no long prefill
    other_cold = turn(line, "d", flow="dave", need=LONG_TURN)
    assert warm.admitted
    assert not other_cold.admitted  # a second cold one waits for the first's prefill


def test_a_turn_waiting_for_its_sessions_engine_says_so():
    clock = FakeClock()
    line, policy = line_of(clock)
    home, other = engine(line, OLD, 1), engine(line, NEW, 1)
    answered(policy, turn(line, "s"), 900)  # its prefix lives on `home`
    answered(policy, turn(line, "z", flow="erin"), 900)  # a new session: where none lives
    holder = turn(line, "x", flow="carol", need=100)
    assert not_none(holder.seat).engine is home  # as many sessions on each: the first joined

    waiting = turn(line, "s")  # `other` is free, but its prefix is on `home`
    assert not waiting.admitted and waiting.wait_reason == WaitReason.SESSION_ENGINE
    assert turn(line, "y", flow="dave", need=100).engine is other  # others are not held back
    holder.release()
    assert waiting.admitted and not_none(waiting.seat).engine is home


def test_a_turn_whose_engine_is_full_does_not_fit_now_though_another_engine_is_free():
    """The gateway admits a long prompt on its bound, counted while it runs, only when it
    would run at once: a warm turn waits for its session's engine, so it does not (the
    probe once read as a request that had waited its home wait already)."""
    clock = FakeClock()
    line, policy = line_of(clock)
    home, other = engine(line, OLD, 1), engine(line, NEW, 1)
    answered(policy, turn(line, "s"), 900)
    answered(policy, turn(line, "z", flow="erin"), 900)
    holder = turn(line, "x", flow="carol", need=100)
    assert not_none(holder.seat).engine is home
    hint = Hint("alice\ns", flow="alice")
    assert not line.fits_now(TokenNeed(1000, 0), hint)
    assert line.fits_now(TokenNeed(1000, 0), Hint("alice\nnew", flow="alice"))  # a new one
    holder.release()
    assert line.fits_now(TokenNeed(1000, 0), hint)


def test_a_turn_waiting_for_its_engine_holds_back_none_of_its_own_keys_turns_for_the_other():
    # One key's agents (or every agent of a port without keys: one flow) on two engines:
    # the turn waiting for its session's engine is its flow's head, and the next turn,
    # whose prefix is on the engine with a free slot, went nowhere until the first's
    # engine freed (bench/sessions.py's pool: a slot idle while two turns waited).
    clock = FakeClock()
    line, policy = line_of(clock)
    home, other = engine(line, OLD, 1), engine(line, NEW, 1)
    answered(policy, turn(line, "s"), 900)  # its prefix lives on `home`
    answered(policy, turn(line, "t"), 900)  # where fewer sessions live: `other`
    holder = turn(line, "u")
    assert not_none(holder.seat).engine is home

    waiting = turn(line, "s")  # `home` is full, `other` free: it waits for `home`
    assert not waiting.admitted and waiting.wait_reason == WaitReason.SESSION_ENGINE
    behind = turn(line, "t")  # the same key's next turn, its prefix on `other`
    assert behind.admitted and not_none(behind.seat).engine is other
    holder.release()
    assert waiting.admitted and not_none(waiting.seat).engine is home


def test_a_turn_waiting_for_its_engine_is_passed_by_its_own_key_at_most_max_passes_times():
    clock = FakeClock()
    line, policy = line_of(clock)
    home, other = engine(line, OLD, 1), engine(line, NEW, 1)
    answered(policy, turn(line, "s"), 900)
    answered(policy, turn(line, "t"), 900)
    holder = turn(line, "u")
    waiting = turn(line, "s")
    admitted = []
    for _ in range(MAX_PASSES + 1):
        ticket = turn(line, "t")  # each goes to `other`, passing the waiting turn
        admitted.append(ticket.admitted)
        if ticket.admitted:
            answered(policy, ticket, 900)
    assert admitted == [True] * MAX_PASSES + [False]  # then a barrier, as for other keys
    assert not waiting.admitted
    holder.release()
    assert waiting.admitted and not_none(waiting.seat).engine is home


def test_agents_arriving_together_on_two_engines_live_three_and_three_not_four_and_two():
    # bench/sessions.py's pool: 6 agents of one key, 2 engines of 2 slots.  Each new
    # session took the first free slot: the two that waited both went to the engine
    # that freed first, 4 agents queued for its 2 slots for their whole conversations.
    clock = FakeClock()
    line, policy = line_of(clock)
    one, two = engine(line, OLD, 2), engine(line, NEW, 2)
    first = [turn(line, f"s{i}") for i in range(6)]
    assert [not_none(t.seat).engine for t in first[:4]] == [one, two, one, two]
    assert not first[4].admitted and not first[5].admitted

    answered(policy, first[0], 900)  # `one` frees a slot: s4 goes there (2 and 2 before it)
    assert first[4].admitted and not_none(first[4].seat).engine is one
    answered(policy, first[2], 900)  # `one` again: 3 live there now, 2 on `two`
    assert not first[5].admitted
    answered(policy, first[1], 900)
    assert first[5].admitted and not_none(first[5].seat).engine is two
    for ticket in (first[3], first[4], first[5]):
        answered(policy, ticket, 900)
    assert [policy.sessions.homed(e.key) for e in (one, two)] == [3, 3]


def test_a_new_session_waits_for_the_emptier_engine_at_most_new_session_wait_seconds():
    clock = FakeClock()
    line, policy = line_of(clock)
    one, two = engine(line, OLD, 1), engine(line, NEW, 1)
    answered(policy, turn(line, "a"), 900)
    answered(policy, turn(line, "b"), 900)
    answered(policy, turn(line, "c"), 900)  # 2 live on `one`, 1 on `two`
    holder = turn(line, "b")
    assert not_none(holder.seat).engine is two

    new = turn(line, "d")  # `one` is free, but more live there: it waits for `two`
    assert not new.admitted and new.wait_reason == WaitReason.SESSION_ENGINE
    clock.now += NEW_SESSION_WAIT
    line.admit_waiting()
    assert new.admitted and not_none(new.seat).engine is one
    holder.release()


def test_a_sessions_request_while_another_of_its_turns_runs_takes_any_free_slot():
    """Its running turn's slot holds nothing for it until that turn ends: it waits for
    no engine (four identical chats are one session by their digest; with the wait,
    one of them waited for another's whole answer on an engine beside a free one)."""
    clock = FakeClock()
    line, policy = line_of(clock)
    home, other = engine(line, OLD, 1), engine(line, NEW, 1)
    answered(policy, turn(line, "s"), 900)  # it lives on `home`
    answered(policy, turn(line, "z", flow="erin"), 900)  # another on `other`
    running = turn(line, "s")
    assert not_none(running.seat).engine is home
    beside = turn(line, "s")  # `home` is full with its own turn: `other` at once
    assert beside.admitted and not_none(beside.seat).engine is other
    running.release()
    beside.release()
    # Once none of its turns runs, it waits for its engine again.
    holder = turn(line, "x", flow="carol")  # a new one: as many live on each, the first
    assert not_none(holder.seat).engine is home
    waiting = turn(line, "s")
    assert not waiting.admitted and waiting.wait_reason == WaitReason.SESSION_ENGINE
    holder.release()
    assert waiting.admitted and not_none(waiting.seat).engine is home


def test_identical_chats_arriving_together_spread_over_the_free_slots_of_two_engines():
    clock = FakeClock()
    line, _ = line_of(clock)
    one, two = engine(line, OLD, 2), engine(line, NEW, 2)
    chats = [turn(line, "#same-digest") for _ in range(4)]
    assert all(chat.admitted for chat in chats)
    assert sorted(not_none(c.seat).engine.key for c in chats) == sorted([one.key, one.key,
                                                                         two.key, two.key])


def test_a_new_sessions_long_first_prompt_waits_for_the_engine_where_fewer_sessions_live():
    # The prefill budget sends a long cold prompt among the engines it admits; a new
    # session still waits its new_wait for the engine where fewer sessions live (measured
    # on two attached llama-servers: the fifth and sixth agents' first prompts, long and
    # cold, both went to the engine a slot freed on, 4 sessions on its 2 slots).
    clock = FakeClock()
    line, policy = line_of(clock)
    fewer, more = engine(line, OLD, 2), engine(line, NEW, 2)
    for name, where in (("s0", fewer), ("s1", fewer), ("s2", more), ("s3", more), ("s4", more)):
        told_served(policy.sessions, f"alice\n{name}", "alice", (), Seat(where, 0), "here", 1_600, 0)
    running = [turn(line, "s0"), turn(line, "s1")]
    assert all(t.engine is fewer for t in running)  # `fewer` is full now
    late = turn(line, "s5", need=3_500)  # long: over LONG_PREFILL_TOKENS, cold everywhere
    assert not late.admitted  # `more` has room, but more sessions live there
    clock.now += NEW_SESSION_WAIT
    line.admit_waiting()
    assert late.admitted and late.engine is more


def attached(line: Line, url: str, slots: int) -> AdmissionQueue:
    """A plain llama-server at its default slot similarity, seen to use its RAM cache."""
    kv = KvCapacity.split(4096 * slots, slots)
    return AdmissionQueue(Serving(url, slots, kv=kv, finds_prefix_in_ram=True), line=line)


def claude_turn(line: Line, session: str, flow: str = "alice") -> Ticket:
    """A `/v1/messages` turn: llama-server drops its `id_slot`."""
    return line.request(TokenNeed(1000, 0), flow=Flow(flow),
                        hint=Hint(f"{flow}\n{session}", flow=flow, pinnable=False))


def test_a_turn_the_engine_cannot_pin_waits_for_its_engines_turns_and_is_not_starved():
    clock = FakeClock()
    line, policy = line_of(clock)
    attached(line, OLD, 12)
    pinned = turn(line, "a")
    assert pinned.admitted
    claude = claude_turn(line, "c")
    assert not claude.admitted and claude.wait_reason == WaitReason.SLOT_SEATING
    pinned.seated()  # its slot took it: it runs there, and may end any moment
    assert not claude.admitted
    # Its own flow's later turns do not pass it (they would run there when it goes).
    behind = turn(line, "b")
    assert not behind.admitted
    # Other flows' turns pass it a bounded number of times (the line's MAX_PASSES, after
    # their fair share put them first), then wait behind it.
    passers = [turn(line, f"p{n}", flow="erin") for n in range(8)]
    went = [t for t in passers if t.admitted]
    held = [t for t in passers if not t.admitted]
    assert len(went) <= MAX_PASSES + 1 and held and passers[:len(went)] == went
    for ticket in [pinned, *went]:
        assert not claude.admitted
        ticket.release()  # answered
    assert claude.admitted
    # While it is on its way, nothing goes to that engine; once a slot took it, in order.
    assert not behind.admitted and not any(t.admitted for t in held)
    claude.seated()
    assert behind.admitted and all(t.admitted for t in held)


def test_turns_wait_for_a_turn_the_engine_cannot_pin_only_until_a_slot_takes_it_or_it_ends():
    clock = FakeClock()
    line, policy = line_of(clock)
    attached(line, OLD, 2)
    claude = claude_turn(line, "c")
    assert claude.admitted
    pinned = turn(line, "a")
    assert not pinned.admitted and pinned.wait_reason == WaitReason.SLOT_SEATING
    claude.release()  # a whole answer (not streamed): its headers came with it
    assert pinned.admitted
