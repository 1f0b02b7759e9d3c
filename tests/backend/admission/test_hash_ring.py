"""The consistent-hash ring, without I/O: each session's turns go to the engine its name
falls to, whatever the load; an engine that joins takes only the sessions of its arcs;
a turn waits for its own engine, and its line says so; on that engine it takes the slot
the session book names."""

from __future__ import annotations

import pytest

from backend.admission.admission_registry import AdmissionRegistry, placement_named
from backend.admission.admission_ticket import Ticket, WaitReason
from backend.admission.engine_queue import AdmissionQueue
from backend.admission.flow import Flow
from backend.admission.hint import Hint
from backend.admission.line import Line
from backend.admission.hash_ring import HashRing
from backend.admission.placement import KeepPrefixes
from backend.admission.seat import Seat
from backend.admission.session_book import Sessions
from backend.llama.kv_capacity import KvCapacity, TokenNeed
from backend.llama.load import Serving
from backend.settings import PLACEMENTS
from tests.backend.admission.test_placement import SPLIT, Engine, Wanting
from tests.backend.admission_helpers import NEW, OLD, FakeClock, told_served
from tests.not_none import not_none

SESSIONS = [f"alice\nagent-{n}" for n in range(300)]


def turn(session: str, need: TokenNeed | None = None) -> Wanting:
    return Wanting(need, Hint(session, (hash(session),), "alice"))


def test_each_sessions_turns_go_to_one_engine_and_the_sessions_spread_over_the_engines():
    ring = HashRing()
    a, b = Engine("a", [0, 1]), Engine("b", [0, 1])
    homes = {s: not_none(ring.place(turn(s), [a, b])).engine for s in SESSIONS}
    for session in SESSIONS[:50]:  # again, and in another order of the engines
        assert not_none(ring.place(turn(session), [b, a])).engine is homes[session]
    on_a = sum(engine is a for engine in homes.values())
    assert 0.3 * len(SESSIONS) < on_a < 0.7 * len(SESSIONS)


def test_an_engine_that_joins_takes_only_the_sessions_of_its_arcs():
    ring = HashRing()
    a, b, c = Engine("a", [0]), Engine("b", [0]), Engine("c", [0])
    before = {s: ring.engine_of(s, [a, b]) for s in SESSIONS}
    after = {s: ring.engine_of(s, [a, b, c]) for s in SESSIONS}
    moved = [s for s in SESSIONS if after[s] is not before[s]]
    assert all(after[s] is c for s in moved)  # none moves between a and b
    assert 0.15 * len(SESSIONS) < len(moved) < 0.5 * len(SESSIONS)
    # When it goes again, they come back where they were.
    assert {s: ring.engine_of(s, [a, b]) for s in SESSIONS} == before


def test_a_turn_waits_for_its_own_engine_while_the_other_has_room():
    ring = HashRing()
    a, b = Engine("a", [0, 1]), Engine("b", [0, 1])
    session = next(s for s in SESSIONS if ring.engine_of(s, [a, b]) is a)
    a.free.clear()
    assert ring.place(turn(session), [a, b]) is None
    assert ring.home_while_waiting(turn(session), [a, b]) is a
    assert ring.waits_for_home(turn(session), [a, b])
    b.free.clear()  # nobody has room: it waits, for no engine in particular
    assert ring.home_while_waiting(turn(session), [a, b]) is None
    # A request with no session: the engine with the most free slots.
    a.free[:], b.free[:] = [0], [0, 1]
    assert ring.place(Wanting(), [a, b]) == Seat(b, 0)


def test_on_its_engine_a_turn_takes_the_slot_the_session_book_names():
    sessions = Sessions()
    ring = HashRing(sessions)
    a = Engine("a", [0, 1, 2], kv=SPLIT, released=[0, 1, 2], pin_any_slot=True)
    b = Engine("b", [0, 1, 2], kv=SPLIT, released=[0, 1, 2], pin_any_slot=True)
    session = next(s for s in SESSIONS if ring.engine_of(s, [a, b]) is a)
    told_served(sessions, session, "alice", (hash(session),), Seat(a, 2, pinned=True),
                "this machine", 3_000)
    need = TokenNeed(3_200, 100)
    assert ring.place(turn(session, need), [a, b]) == Seat(a, 2, pinned=True, cached=3_000)
    assert ring.cached_tokens(turn(session).hint, a) == 3_000
    assert ring.cached_tokens(turn(session).hint, b) == 0


def test_the_line_says_a_turn_waits_for_its_engine_and_admits_it_there_when_it_frees():
    clock = FakeClock()
    ring = HashRing()
    line: Line[AdmissionQueue] = Line("m", clock=clock, placement=ring)
    engines = [AdmissionQueue(Serving(url, 1, kv=KvCapacity.split(4096, 1)), line=line)
               for url in (OLD, NEW)]
    home = ring.engine_of(SESSIONS[0], engines)
    other = next(s for s in SESSIONS if ring.engine_of(s, engines) is not home)
    mate = next(s for s in SESSIONS[1:] if ring.engine_of(s, engines) is home)

    def ask(session: str) -> Ticket:
        return line.request(TokenNeed(100, 10), flow=Flow("alice"),
                            hint=Hint(session, (hash(session),), "alice"))

    first = ask(SESSIONS[0])
    second = ask(mate)  # its engine is busy; the other engine is free
    assert not second.admitted and second.wait_reason == WaitReason.SESSION_ENGINE
    third = ask(other)  # the same key's next turn, for the free engine, passes it
    assert third.admitted and not_none(third.seat).engine is not home
    first.release()
    assert second.admitted and not_none(second.seat).engine is home


@pytest.mark.parametrize("name", PLACEMENTS)
def test_every_placement_an_operator_may_name_is_a_policy_of_that_name(name: str):
    policy = placement_named(name, Sessions())
    assert policy.name == name
    with pytest.raises(ValueError):
        placement_named("round-robin", Sessions())


def test_the_registry_makes_each_lines_policy_as_it_is_named_and_again_when_that_changes():
    named = {"coder": "hash-ring"}
    registry = AdmissionRegistry(placement_of=lambda model: named.get(model, "keep-prefixes"))
    ring, keeper = registry.line("coder").placement, registry.line("chat").placement
    assert isinstance(ring, HashRing) and isinstance(keeper, KeepPrefixes)
    assert ring.sessions is keeper.sessions is registry.sessions  # one book
    named["coder"] = "keep-prefixes"
    registry.refresh_placements()
    assert isinstance(registry.line("coder").placement, KeepPrefixes)
