"""Which slot of a chosen engine a session's turn takes, without I/O: pinned to the slot
its prefix is in, else where llama-server would put it; on an attached llama-server at its
defaults, a returning session on a vacated slot and a new one where no session lives."""

from __future__ import annotations

from backend.admission.hint import Hint
from backend.admission.placement import KeepPrefixes
from backend.admission.seat import Seat
from backend.admission.session_book import Sessions
from backend.llama.kv_capacity import KvCapacity, TokenNeed
from tests.backend.admission.test_placement import SPLIT, Clock, Engine, Wanting, served


def test_a_sessions_turn_is_pinned_to_the_slot_its_last_turn_left_its_prefix_in():
    engine = Engine("e", [0, 1], kv=SPLIT)
    policy = KeepPrefixes(Sessions(), clock=Clock())
    first = policy.place(Wanting(hint=Hint("f\na", flow="f")), [engine])
    # As llama-server picks (LRU, highest id), pinned: a slot never used is pinned, so two
    # first turns at once cannot swap slots there.
    assert first == Seat(engine, 1, pinned=True)
    served(policy, "f\na", first, 900)
    engine.released.append(1)
    again = policy.place(Wanting(TokenNeed(1_000, 100), Hint("f\na", flow="f")), [engine])
    assert again == Seat(engine, 1, pinned=True, cached=900)


def test_a_slot_another_session_took_is_not_pinned_the_engine_finds_the_prefix_itself():
    engine = Engine("e", [0, 1], kv=SPLIT)
    policy = KeepPrefixes(Sessions(), clock=Clock())
    served(policy, "f\na", Seat(engine, 1), 900)
    served(policy, "f\nb", Seat(engine, 1), 800)  # b's turn went to slot 1 after a's
    engine.released[:] = [0, 1]
    seat = policy.place(Wanting(hint=Hint("f\na", flow="f")), [engine])
    # Unpinned, on the slot llama-server's LRU takes (it loads a's prefix from its RAM
    # cache): charged as cached all the same, the prefix is on this engine.
    assert seat == Seat(engine, 0, pinned=False, cached=900)


def test_on_a_split_cache_every_seat_is_pinned_an_empty_one_too():
    engine = Engine("e", [0, 1, 2], kv=SPLIT, pin_any_slot=True, released=[2, 0])
    policy = KeepPrefixes(Sessions(), clock=Clock())
    # Slot 1 was never used: pinned all the same, so the table names the slot it ran on.
    assert policy.place(Wanting(hint=Hint("f\na", flow="f")), [engine]) == Seat(engine, 1, pinned=True)
    engine.free = [0, 2]  # slot 1 runs: the one released longest ago, pinned
    assert policy.place(Wanting(hint=Hint("f\na", flow="f")), [engine]) == Seat(engine, 2, pinned=True)
    served(policy, "f\nb", Seat(engine, 0, pinned=True), 600)
    seat = policy.place(Wanting(hint=Hint("f\nb", flow="f")), [engine])
    assert seat == Seat(engine, 0, pinned=True, cached=600)  # its own slot, not the LRU one


def test_on_an_attached_engine_at_its_defaults_a_returning_session_gets_a_vacated_slot():
    # A plain llama-server seen to bring prompts back from its RAM cache: at its default
    # similarity a pinned turn would reuse another session's prompt in place.
    engine = Engine("e", [0, 1], kv=SPLIT, finds_prefix_in_ram=True)
    policy = KeepPrefixes(Sessions(), clock=Clock())
    served(policy, "f\na", Seat(engine, 1, pinned=True), 900)
    served(policy, "f\nb", Seat(engine, 1, pinned=True), 800)  # b took a's slot
    engine.released[:] = [0, 1]
    seat = policy.place(Wanting(hint=Hint("f\na", flow="f")), [engine])
    assert seat == Seat(engine, 0, pinned=True, cached=900, vacate=True)
    # In its own slot, still free and held: pinned there, nothing to vacate.
    seat = policy.place(Wanting(hint=Hint("f\nb", flow="f")), [engine])
    assert seat == Seat(engine, 1, pinned=True, cached=800)
    # A turn the engine cannot pin: the least recently used slot, every idle one vacated.
    seat = policy.place(Wanting(hint=Hint("f\na", flow="f", pinnable=False)), [engine])
    assert seat == Seat(engine, 0, pinned=True, cached=900, vacate=True)


def test_on_an_attached_engine_at_its_defaults_a_new_session_takes_a_slot_no_session_holds():
    engine = Engine("e", [0, 1, 2], kv=SPLIT, finds_prefix_in_ram=True, released=[0, 1])
    policy = KeepPrefixes(Sessions(), clock=Clock())
    # Never used first, not vacated (its empty slot skips the RAM cache: it computes its
    # head, and takes no other session's RAM entry).
    assert policy.place(Wanting(hint=Hint("f\nn", flow="f")), [engine]) == Seat(engine, 2, pinned=True)
    served(policy, "f\na", Seat(engine, 0, pinned=True), 900)
    engine.free = [0, 1]
    # Slot 1 held a prompt no session holds now: there, before a's slot.
    assert policy.place(Wanting(hint=Hint("f\nn", flow="f")), [engine]) == Seat(engine, 1, pinned=True)
    served(policy, "f\nb", Seat(engine, 1, pinned=True), 800)
    # Every free slot holds a session: the least recently used one, not vacated.
    assert policy.place(Wanting(hint=Hint("f\nn", flow="f")), [engine]) == Seat(engine, 0, pinned=True)


def test_a_turn_the_engine_cannot_pin_is_seated_where_the_engines_lru_puts_it():
    engine = Engine("e", [0, 1, 2], kv=SPLIT, pin_any_slot=True, released=[2, 0, 1])
    policy = KeepPrefixes(Sessions(), clock=Clock())
    served(policy, "f\nclaude", Seat(engine, 0, pinned=True), 600)
    messages = Hint("f\nclaude", flow="f", pinnable=False)  # `/v1/messages`
    # Its prefix is in slot 0, but the engine (slot similarity 1) takes its least recently
    # used idle slot for a request without `id_slot`: slot 2.  Not pinned, and still
    # charged as cached (the steward moves the prefix to the RAM cache it loads from).
    assert policy.place(Wanting(hint=messages), [engine]) == Seat(engine, 2, cached=600)
    # A new session too, where a chat turn would have pinned the LRU slot.
    new = Hint("f\nanother", flow="f", pinnable=False)
    assert policy.place(Wanting(hint=new), [engine]) == Seat(engine, 2)
    # An engine started with llama-server's own similarity finds the prefix in its slot
    # by itself: there the session's slot is the seat, as for any turn.
    own = Engine("o", [0, 1, 2], kv=SPLIT, released=[2, 0, 1])
    served(policy, "f\nclaude", Seat(own, 0, pinned=True), 600)
    assert policy.place(Wanting(hint=messages), [own]) == Seat(own, 0, pinned=True, cached=600)


def test_nothing_is_pinned_on_a_unified_cache_or_an_unknown_one():
    for kv in (KvCapacity.shared(8_192), None):
        engine = Engine("e", [0, 1], kv=kv)
        policy = KeepPrefixes(Sessions(), clock=Clock())
        served(policy, "f\na", Seat(engine, 1), 900)
        seat = policy.place(Wanting(hint=Hint("f\na", flow="f")), [engine])
        assert seat is not None and not seat.pinned and seat.slot == 0
