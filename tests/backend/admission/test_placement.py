"""The default placement and a request's hint, without I/O: engines here are plain values."""

from __future__ import annotations

from dataclasses import dataclass, field

from backend.admission.hint import NO_HINT, Hint, request_hint
from backend.admission.placement import (HOME_WAIT, HOME_WAIT_LIMIT, NEW_SESSION_WAIT, KeepPrefixes,
                                         MostFreeSlots)
from backend.admission.seat import Seat
from backend.admission.session_book import Sessions
from backend.llama.kv_capacity import KvCapacity, TokenNeed
from tests.backend.admission_helpers import told_served
from tests.not_none import not_none


@dataclass(eq=False)
class Engine:
    """An engine as placement reads it: its free slot ids, the most one request may hold,
    its cache's layout, and the order its slots were last released in (oldest first)."""

    name: str
    free: list[int]
    room: int = 10_000
    kv: KvCapacity | None = None
    released: list[int] = field(default_factory=list)
    pin_any_slot: bool = False
    finds_prefix_in_ram: bool = False
    seconds_per_token: float | None = None  #: its measured prefill speed (None: not measured)
    seats: dict[int | None, Seat[Engine]] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return self.name

    @property
    def free_slots(self) -> int:
        return len(self.free)

    def has_room(self, need: TokenNeed | None) -> bool:
        return bool(self.free) and (need is None or need.total <= self.room)

    def lowest_free_slot(self) -> int | None:
        return min(self.free) if self.free else None

    def lowest_free_seat(self) -> Seat[Engine]:
        slot = self.lowest_free_slot()
        return self.seats.setdefault(slot, Seat(self, slot))

    def least_recent_free_seat(self) -> Seat[Engine]:
        never = [slot for slot in self.free if slot not in self.released]
        slot = max(never) if never else min(self.free, key=self.released.index)
        return self.seats.setdefault(slot, Seat(self, slot))

    def slot_free(self, slot: int) -> bool:
        return slot in self.free

    def slot_used(self, slot: int) -> bool:
        return slot in self.released

    def free_slot_ids(self) -> list[int]:
        return sorted(self.free)

    def prefill_seconds(self, tokens: int) -> float | None:
        return None if self.seconds_per_token is None else tokens * self.seconds_per_token


@dataclass(frozen=True)
class Wanting:
    need: TokenNeed | None = None
    hint: Hint = NO_HINT
    enqueued_at: float = 0.0


def test_the_default_takes_the_engine_with_the_most_free_slots_and_its_lowest_free_id():
    a, b, c = Engine("a", [3]), Engine("b", [2, 1]), Engine("c", [0, 3])
    seat = MostFreeSlots().place(Wanting(), [a, b, c])
    assert seat == Seat(b, 1) and not seat.pinned  # b and c tie: the first joined


def test_the_default_skips_an_engine_the_need_does_not_fit_and_places_none_when_none_fits():
    small, big = Engine("small", [0, 1, 2], room=1_000), Engine("big", [5], room=8_000)
    need = TokenNeed(3_000, 500)
    assert MostFreeSlots().place(Wanting(need), [small, big]) == Seat(big, 5)
    assert MostFreeSlots().place(Wanting(TokenNeed(9_000, 0)), [small, big]) is None
    assert MostFreeSlots().place(Wanting(), [Engine("full", [])]) is None
    assert MostFreeSlots().place(Wanting(need), [small]) is None


def test_the_default_with_one_engine_places_on_its_lowest_free_slot():
    only = Engine("only", [2, 1])
    assert MostFreeSlots().place(Wanting(), [only]) == Seat(only, 1)


def chat(*contents: str, **fields: object) -> dict[str, object]:
    return {"messages": [{"role": "user", "content": c} for c in contents], **fields}


# --- keeping prefixes --------------------------------------------------------------------

SPLIT = KvCapacity.split(8_192, 2)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def served(policy: KeepPrefixes, session: str, seat: Seat[Engine] | None, prompt: int,
           cached: int = 0, prefix: tuple[int, ...] = ()) -> None:
    told_served(policy.sessions, session, session.split("\n")[0], prefix, seat, "this machine",
                prompt, cached)


def test_a_session_goes_back_to_the_engine_holding_its_prefix():
    a, b = Engine("a", [0, 1], kv=SPLIT), Engine("b", [0, 1], kv=SPLIT)
    policy = KeepPrefixes(Sessions(), clock=Clock())
    served(policy, "f\ns", Seat(b, 0), 500)
    a.free = [0, 1]
    b.free = [1]  # b has fewer free slots: today's rule would take a
    assert policy.place(Wanting(hint=Hint("f\ns", flow="f")), [a, b]) == Seat(b, 1, cached=500)
    assert policy.place(Wanting(hint=Hint("f\nnew", flow="f")), [a, b]) == Seat(a, 1, pinned=True)


def test_a_new_session_sharing_its_flows_prefix_goes_to_that_engine_never_to_another_flows():
    a, b = Engine("a", [0, 1], kv=SPLIT), Engine("b", [1], kv=SPLIT)
    policy = KeepPrefixes(Sessions(), clock=Clock())
    mine = request_hint("key alice", [], chat("a long shared head " * 100, "first"))
    served(policy, "key carol\nher", Seat(a, 0), 700)  # one session lives on each engine
    served(policy, "key alice\nold", Seat(b, 0), 700, prefix=mine.prefix)
    same_head = request_hint("key alice", [], chat("a long shared head " * 100, "second"))
    assert policy.place(Wanting(hint=same_head), [a, b]) == Seat(b, 1, pinned=True)  # a fresh slot
    theirs = request_hint("key bob", [], chat("a long shared head " * 100, "second"))
    assert policy.place(Wanting(hint=theirs), [a, b]) == Seat(a, 1, pinned=True)  # today's rule
    b.free = []  # a shared head is no reason to wait: a new session goes where there is room
    assert policy.place(Wanting(hint=same_head, enqueued_at=1e9), [a, b]) == Seat(a, 1, pinned=True)


def test_a_turn_waits_for_its_engine_at_most_home_wait_seconds():
    clock = Clock()
    a, b = Engine("a", [0, 1], kv=SPLIT), Engine("b", [], kv=SPLIT)
    policy = KeepPrefixes(Sessions(), clock=clock)
    served(policy, "f\ns", Seat(b, 0), 500)
    ticket = Wanting(hint=Hint("f\ns", flow="f"), enqueued_at=clock.now)
    assert policy.place(ticket, [a, b]) is None  # b frees a slot soon
    clock.now += HOME_WAIT
    assert policy.place(ticket, [a, b]) == Seat(a, 1, pinned=True)  # waited long enough: anywhere
    assert policy.place(Wanting(hint=Hint("f\ns", flow="f"), enqueued_at=clock.now), [b]) is None


def test_a_turn_waits_for_its_engine_as_long_as_computing_its_prefix_elsewhere_would_take():
    clock = Clock()
    # A real model on a CPU: the other engine would compute the 3,000-token prefix in 30 s.
    a = Engine("a", [0, 1], kv=SPLIT, seconds_per_token=0.01)
    b = Engine("b", [], kv=SPLIT, seconds_per_token=0.01)
    policy = KeepPrefixes(Sessions(), clock=clock)
    served(policy, "f\ns", Seat(b, 0), 3_000)
    ticket = Wanting(hint=Hint("f\ns", flow="f"), enqueued_at=clock.now)
    clock.now += HOME_WAIT
    assert policy.place(ticket, [a, b]) is None
    assert policy.waits_for_home(ticket, [a, b])  # the line says why it waits
    clock.now += 30.0 - HOME_WAIT
    assert policy.place(ticket, [a, b]) == Seat(a, 1, pinned=True)
    # Not measured there (an engine elsewhere): the home engine's speed stands in for it.
    a.seconds_per_token = None
    assert policy.place(Wanting(hint=ticket.hint, enqueued_at=clock.now - HOME_WAIT),
                        [a, b]) is None
    # A fast engine recomputes it within home_wait; a slow one is waited for at most the limit.
    a.seconds_per_token = 0.0001
    assert policy.place(Wanting(hint=ticket.hint, enqueued_at=clock.now - HOME_WAIT),
                        [a, b]) == Seat(a, 1, pinned=True)
    a.seconds_per_token = 1.0
    assert policy.place(Wanting(hint=ticket.hint, enqueued_at=clock.now - HOME_WAIT_LIMIT + 1),
                        [a, b]) is None
    assert policy.place(Wanting(hint=ticket.hint, enqueued_at=clock.now - HOME_WAIT_LIMIT),
                        [a, b]) == Seat(a, 1, pinned=True)


def test_a_turn_on_an_engine_that_went_away_is_placed_as_any_other():
    a = Engine("a", [0, 1], kv=SPLIT)
    policy = KeepPrefixes(Sessions(), clock=Clock())
    served(policy, "f\ns", Seat(Engine("gone", [0], kv=SPLIT), 0), 500)
    assert policy.place(Wanting(hint=Hint("f\ns", flow="f")), [a]) == Seat(a, 1, pinned=True)
    assert policy.place(Wanting(TokenNeed(20_000, 0), Hint("f\ns", flow="f")), [a]) is None


def test_the_table_tells_the_prefill_budget_what_an_engine_holds_of_a_sessions_turn():
    home, other = Engine("home", [0, 1], kv=SPLIT), Engine("other", [0, 1], kv=SPLIT)
    policy = KeepPrefixes(Sessions(), clock=Clock())
    served(policy, "f\na", Seat(home, 1, pinned=True), 2_900, prefix=(1, 2))
    policy.sessions.vacate("home", 1)  # its slot given away: the engine's RAM cache keeps it

    # Its next turn on the engine holding its prefix: only what it adds is uncached.
    assert policy.cached_tokens(Hint("f\na", (1, 2), "f"), home) == 2_900
    assert policy.cached_tokens(Hint("f\na", (1, 2), "f"), other) == 0
    assert policy.cached_tokens(Hint("f\na", (1, 9), "f"), home) == 0  # another beginning
    assert policy.cached_tokens(Hint("f\nb", (1, 2), "f"), home) == 0  # another session
    assert policy.cached_tokens(Hint(None, (1, 2), "f"), home) == 0
    policy.sessions.forget_engine("home")  # unloaded: it holds nothing now
    assert policy.cached_tokens(Hint("f\na", (1, 2), "f"), home) == 0


def test_a_new_session_goes_where_the_fewest_sessions_live_before_its_flows_shared_head():
    a, b = Engine("a", [0, 1], kv=SPLIT), Engine("b", [0, 1], kv=SPLIT)
    policy = KeepPrefixes(Sessions(), clock=Clock())
    head = "You are a coding agent. Tools: ... " * 100  # every agent's first blocks
    for name in ("s0", "s1"):
        hint = request_hint("f", [(b"x-session-id", name.encode())], chat(head, name))
        served(policy, hint.session or "", Seat(b, 0), 1_300, prefix=hint.prefix)
    served(policy, "f\ns2", Seat(a, 1), 1_300)
    # Its flow's head lives on b, but two sessions do and one on a: a, where it is not
    # queued behind the others' turns for the rest of its conversation.
    third = request_hint("f", [(b"x-session-id", b"s3")], chat(head, "s3"))
    assert third.prefix and policy.place(Wanting(hint=third), [a, b]) == Seat(a, 1, pinned=True)
    served(policy, "f\ns3", Seat(a, 1), 1_300, prefix=third.prefix)
    fourth = request_hint("f", [(b"x-session-id", b"s4")], chat(head, "s4"))
    seat = policy.place(Wanting(hint=fourth), [a, b])
    assert seat is not None and seat.engine is a  # 2 and 2: where the head was seen last
    a.free = []  # no room where the fewest live: where there is room, without waiting
    assert policy.place(Wanting(hint=fourth), [a, b]) == Seat(b, 1, pinned=True)
    assert policy.sessions.homed("a") == policy.sessions.homed("b") == 2


def test_a_new_session_that_waited_for_any_slot_still_waits_for_the_engine_where_fewer_live():
    # Six agents on two engines of two slots: the fifth and sixth arrive while every slot
    # runs; when one frees, each waits a little for the engine where fewer live.
    clock = Clock()
    a, b = Engine("a", [], kv=SPLIT), Engine("b", [0], kv=SPLIT)
    policy = KeepPrefixes(Sessions(), clock=clock)
    for name, engine in (("s0", a), ("s1", a), ("s2", b), ("s3", b), ("s4", b)):
        served(policy, f"f\n{name}", Seat(engine, 0), 1_300)
    late = Wanting(hint=Hint("f\ns5", flow="f"), enqueued_at=clock.now - 120)
    assert policy.place(late, [a, b]) is None  # b has room, but 3 live there and 2 on a
    clock.now += NEW_SESSION_WAIT - 0.1
    assert policy.place(late, [a, b]) is None
    clock.now += 0.2  # waited its new_wait since b had room: there
    assert policy.place(late, [a, b]) == Seat(b, 0, pinned=True)


def test_on_an_attached_engine_a_turn_it_cannot_pin_goes_only_to_an_engine_running_nothing():
    # The races on a plain llama-server: a turn the engine cannot pin takes the idle slot
    # the engine finds most similar, else its least recently used one, and the steward
    # empties only the slots free in these books.  A pinned turn admitted here is idle
    # there until its request arrives; a turn that just ended there is idle before the
    # port hears it.  Either would take the unpinned turn.
    engine = Engine("e", [0, 1, 2], kv=SPLIT, finds_prefix_in_ram=True, released=[0, 1, 2])
    policy = KeepPrefixes(Sessions(), clock=Clock())
    served(policy, "f\na", Seat(engine, 0, pinned=True), 900)
    served(policy, "f\nb", Seat(engine, 1, pinned=True), 800)
    pinned = Wanting(hint=Hint("f\na", flow="f"))
    seat = not_none(policy.place(pinned, [engine]))
    assert seat == Seat(engine, 0, pinned=True, cached=900)
    policy.admitted(pinned, seat)
    engine.free.remove(0)
    claude = Wanting(hint=Hint("f\nclaude", flow="f", pinnable=False))
    assert policy.place(claude, [engine]) is None
    assert policy.waits_for_seating(claude, [engine])
    # Pinned turns go meanwhile: each has its slot named.
    other = Wanting(hint=Hint("f\nb", flow="f"))
    seat = not_none(policy.place(other, [engine]))
    policy.admitted(other, seat)
    engine.free.remove(1)
    policy.seated(pinned)  # its slot took it there: it runs, and may end any moment
    assert policy.place(claude, [engine]) is None
    policy.slot_freed(pinned)
    engine.free.append(0)
    assert policy.place(claude, [engine]) is None  # b's still runs
    policy.ended(other)  # answered, or failed: gone all the same
    engine.free.append(1)
    seat = not_none(policy.place(claude, [engine]))
    assert seat.vacate and seat.pinned
    policy.admitted(claude, seat)
    engine.free.remove(not_none(seat.slot))
    # While it is on its way, no turn goes to that engine, pinned or not; other engines
    # are not held.
    again = Wanting(hint=Hint("f\nb", flow="f"), enqueued_at=1.0)
    assert policy.place(again, [engine]) is None and policy.waits_for_seating(again, [engine])
    elsewhere = Engine("o", [0], kv=SPLIT)
    assert policy.place(Wanting(hint=Hint("g\nz", flow="g")), [elsewhere]) is not None
    policy.seated(claude)
    assert policy.place(again, [engine]) is not None
    # A second unpinned turn waits for the first to end, seated or not.
    second = Wanting(hint=Hint("f\nclaude2", flow="f", pinnable=False))
    assert policy.place(second, [engine]) is None
    policy.ended(claude)
    engine.free.append(not_none(seat.slot))
    assert policy.place(second, [engine]) is not None


def test_turns_on_an_engine_that_pins_every_slot_itself_never_wait_for_seating():
    # An engine GGUF Studio started (slot similarity 1) or one not seen to use its RAM
    # cache: nothing to steer by vacating, nothing held.
    for engine in (Engine("s", [0, 1], kv=SPLIT, pin_any_slot=True, finds_prefix_in_ram=True),
                   Engine("p", [0, 1], kv=SPLIT)):
        policy = KeepPrefixes(Sessions(), clock=Clock())
        first = Wanting(hint=Hint("f\na", flow="f"))
        policy.admitted(first, not_none(policy.place(first, [engine])))
        engine.free.pop()
        claude = Wanting(hint=Hint("f\nclaude", flow="f", pinnable=False))
        assert policy.place(claude, [engine]) is not None


def test_on_an_attached_engine_a_slot_seated_for_another_session_holds_no_prefix_from_then():
    # The book learns where a turn left its prefix once its answer is recorded, after
    # its slot is free again: a turn of the slot's former session admitted at that
    # moment must not be sent there as if its prefix were still in it.
    engine = Engine("e", [0, 1], kv=SPLIT, finds_prefix_in_ram=True, released=[0, 1])
    policy = KeepPrefixes(Sessions(), clock=Clock())
    served(policy, "f\na", Seat(engine, 0, pinned=True), 900)
    served(policy, "f\nb", Seat(engine, 1, pinned=True), 800)
    engine.free = [0]
    newcomer = Wanting(hint=Hint("f\nn", flow="f"))
    seat = not_none(policy.place(newcomer, [engine]))
    assert seat.slot == 0
    policy.admitted(newcomer, seat)
    policy.ended(newcomer)  # answered; the book has not heard where yet
    back = not_none(policy.place(Wanting(hint=Hint("f\na", flow="f")), [engine]))
    assert back == Seat(engine, 0, pinned=True, cached=900, vacate=True)
