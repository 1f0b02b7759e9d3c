"""The session table: where each session's prefix lives, bounded, one flow's own; and the
cache book: each session's last turns, judged against the conversation they continue."""

from __future__ import annotations

from typing import Any

import pytest

from backend.admission.cache_misses import Verdict
from backend.admission.hint import Hint
from backend.admission.placement import KeepPrefixes
from backend.admission.seat import Seat
from backend.admission.prompt import prompt_blocks
from backend.admission.session_book import SessionRequest, Sessions
from backend.llama.kv_capacity import KvCapacity, TokenNeed
from backend.llama.slot_parking import ParkKey
from tests.backend.admission import chat_bodies
from tests.backend.admission.chat_bodies import AGENT_NEXT, FIRST, SECOND, blocks_of
from tests.backend.admission_helpers import told_served
from tests.backend.admission.test_placement import Clock as PlacementClock, Engine, Wanting


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def test_a_served_turn_says_where_the_session_lives() -> None:
    table = Sessions(clock=Clock())
    assert table.where("a\ns1") is None
    table.record("a\ns1", flow="a", engine="e1", label="this machine", slot=1,
                 prompt_tokens=900, cached_tokens=600, prefix=(11, 12))
    session = table.where("a\ns1")
    assert session is not None
    assert (session.engine, session.label, session.slot) == ("e1", "this machine", 1)
    assert (session.prompt_tokens, session.cached_tokens, session.computed_tokens) == (900, 600, 300)
    assert session.turns == 1
    table.record("a\ns1", flow="a", engine="e1", slot=1, prompt_tokens=1000,
                 cached_tokens=900)
    assert table.where("a\ns1").turns == 2  # type: ignore[union-attr]
    assert table.holder("e1", 1).key == "a\ns1"  # type: ignore[union-attr]


def test_a_slot_holds_one_prompt_the_one_it_held_stays_on_the_engine() -> None:
    table = Sessions(clock=Clock())
    table.record("a\ns1", flow="a", engine="e1", slot=0, prompt_tokens=10)
    table.record("a\ns2", flow="a", engine="e1", slot=0, prompt_tokens=10)
    first = table.where("a\ns1")
    assert first is not None and first.engine == "e1" and first.slot is None
    assert table.holder("e1", 0).key == "a\ns2"  # type: ignore[union-attr]
    assert [s.key for s in table.resident("e1")] == ["a\ns1", "a\ns2"]
    assert table.vacate("e1", 0).key == "a\ns2"  # type: ignore[union-attr]
    assert table.holder("e1", 0) is None


def test_an_engine_that_goes_leaves_its_sessions_homeless() -> None:
    table = Sessions(clock=Clock())
    table.record("a\ns1", flow="a", engine="e1", slot=0)
    table.record("a\ns2", flow="a", engine="e2", slot=0)
    assert [s.key for s in table.forget_engine("e1")] == ["a\ns1"]
    gone = table.where("a\ns1")
    assert gone is not None and not gone.resident and gone.slot is None
    assert table.holder("e1", 0) is None
    assert table.holder("e2", 0).key == "a\ns2"  # type: ignore[union-attr]


def test_the_table_is_bounded_least_recently_served_first() -> None:
    table = Sessions(2, max_per_flow=2, clock=Clock())
    table.record("a\ns1", flow="a", engine="e", slot=0, prefix=(1,))
    table.record("a\ns2", flow="a", engine="e", slot=1)
    table.record("a\ns1", flow="a", engine="e", slot=0, prefix=(1,))
    table.record("a\ns3", flow="a", engine="e", slot=2)
    assert len(table) == 2 and "a\ns2" not in table
    assert [s.key for s in table.snapshot()] == ["a\ns3", "a\ns1"]
    assert table.holder("e", 1) is None
    with pytest.raises(ValueError):
        Sessions(0)


def test_a_key_making_a_session_per_request_never_pushes_out_anothers() -> None:
    table = Sessions(8, clock=Clock())  # a key may hold a quarter: 2 sessions
    table.record("alice\nagent", flow="alice", engine="e", slot=0, prefix=(1,))
    table.record("bob\nagent", flow="bob", engine="e", slot=1)
    for n in range(100):
        table.record(f"mallory\n{n}", flow="mallory", engine="e", prefix=(100 + n,))
    # Mallory keeps its own two newest; alice's and bob's sessions (and alice's prefix)
    # are where they were, and their next sessions find room.
    assert [s.key for s in table if s.flow == "mallory"] == ["mallory\n98", "mallory\n99"]
    assert table.holder("e", 0).key == "alice\nagent"  # type: ignore[union-attr]
    assert table.match_prefix("alice", (1,)) is not None
    assert table.match_prefix("mallory", (100,)) is None  # a dropped session's prefix
    assert table.homed("e") == 4
    for name in ("alice", "bob", "carol"):
        table.record(f"{name}\nsecond", flow=name, engine="e")
    assert len(table) == 7 and "alice\nagent" in table and "bob\nagent" in table


def test_a_full_table_makes_room_from_the_key_holding_the_most() -> None:
    table = Sessions(4, max_per_flow=3, clock=Clock())
    table.record("alice\nold", flow="alice", engine="e")  # the least recently served
    for n in range(3):
        table.record(f"mallory\n{n}", flow="mallory", engine="e")
    table.record("bob\nnew", flow="bob", engine="e")
    assert "alice\nold" in table and "mallory\n0" not in table and len(table) == 4


def test_a_prefix_matches_only_the_flows_own_sessions() -> None:
    table = Sessions(clock=Clock())
    table.record("a\ns1", flow="a", engine="e", slot=0, prefix=(1, 2, 3))
    match = table.match_prefix("a", (1, 2, 9))
    assert match is not None and match[0].key == "a\ns1" and match[1] == 2
    assert table.match_prefix("b", (1, 2, 3)) is None
    assert table.match_prefix("a", (7,)) is None
    assert table.forget_flow("a") == 1
    assert table.match_prefix("a", (1, 2, 3)) is None


def test_the_table_counts_the_sessions_living_on_each_engine() -> None:
    table = Sessions(max_sessions=3, max_per_flow=3, clock=Clock())
    for key, engine in (("a\n1", "e1"), ("a\n2", "e1"), ("a\n3", "e2")):
        table.record(key, flow="a", engine=engine, slot=0, prompt_tokens=10)
    assert (table.homed("e1"), table.homed("e2")) == (2, 1)
    table.record("a\n1", flow="a", engine="e2", prompt_tokens=20)  # its next turn moved
    assert (table.homed("e1"), table.homed("e2")) == (1, 2)
    table.record("a\n4", flow="a", engine="e1", prompt_tokens=10)  # a\n2 dropped: the oldest
    assert "a\n2" not in table and (table.homed("e1"), table.homed("e2")) == (1, 2)
    table.forget("a\n4")
    table.forget_engine("e2")  # gone with its cache: its sessions live nowhere
    assert (table.homed("e1"), table.homed("e2")) == (0, 0)
    table.record("a\n3", flow="a", engine="e1", prompt_tokens=10)
    assert table.homed("e1") == 1 and len(table) == 2


# --- a title request under the session's name ----------------------------------------------

AGENT = (11, 12, 13)  # the agent's prompt: its system prompt and tools, then the history
TITLE = (71,)  # OpenCode's title request: another system prompt, one short message


def test_a_title_request_after_the_agents_turn_leaves_the_session_where_the_agent_is() -> None:
    table = Sessions(clock=Clock())
    table.record("o\nses", flow="o", engine="e", slot=0, prompt_tokens=5_000,
                 cached_tokens=4_000, prefix=AGENT)
    table.record("o\nses", flow="o", engine="e", slot=1, prompt_tokens=300, prefix=TITLE)
    session = table.where("o\nses")
    assert session is not None
    assert (session.engine, session.slot, session.prefix) == ("e", 0, AGENT)
    assert (session.prompt_tokens, session.cached_tokens, session.turns) == (5_000, 4_000, 1)
    assert table.holder("e", 0) is session and table.holder("e", 1) is None


def test_an_agents_turn_that_ends_after_its_title_request_is_the_sessions_place() -> None:
    table = Sessions(clock=Clock())
    table.record("o\nses", flow="o", engine="e", slot=1, prompt_tokens=300, prefix=TITLE)
    table.record("o\nses", flow="o", engine="e", slot=0, prompt_tokens=5_000, prefix=AGENT)
    session = table.where("o\nses")
    assert session is not None and (session.slot, session.prefix) == (0, AGENT)
    assert table.holder("e", 1) is None  # the title's slot holds nobody's conversation


def test_a_title_request_on_the_agents_own_slot_takes_the_slot_not_the_session() -> None:
    table = Sessions(clock=Clock())
    table.record("o\nses", flow="o", engine="e", slot=0, prompt_tokens=5_000, prefix=AGENT)
    table.record("o\nses", flow="o", engine="e", slot=0, prompt_tokens=300, prefix=TITLE)
    session = table.where("o\nses")
    # Its prefix is in the engine's RAM cache now: not pinned to the slot the title holds.
    assert session is not None and (session.engine, session.slot) == ("e", None)
    assert session.prefix == AGENT and table.holder("e", 0) is None


def test_the_agents_next_turn_after_a_title_request_is_pinned_to_the_agents_slot() -> None:
    engine = Engine("e", [0, 1, 2, 3], kv=KvCapacity.split(16_384, 4), pin_any_slot=True)
    policy = KeepPrefixes(Sessions(), clock=PlacementClock())
    agent = Hint("o\nses", AGENT, "o")
    title = Hint("o\nses", TITLE, "o")
    # Both first requests at once (as OpenCode sends them): two slots, the title ends last.
    first = policy.place(Wanting(hint=agent), [engine])
    assert first is not None and first.slot is not None
    engine.free.remove(first.slot)
    side = policy.place(Wanting(hint=title), [engine])
    assert side is not None and side.slot is not None and side.slot != first.slot
    engine.free.remove(side.slot)
    engine.free.append(first.slot)
    engine.released.append(first.slot)
    told_served(policy.sessions, agent.session, "o", AGENT, first, "this machine", 5_000, 0)
    engine.free.append(side.slot)
    engine.released.append(side.slot)
    told_served(policy.sessions, title.session, "o", TITLE, side, "this machine", 300, 0)
    nxt = policy.place(Wanting(TokenNeed(5_400, 200), agent), [engine])
    assert nxt == Seat(engine, first.slot, pinned=True, cached=5_000)
    # A title request after it is not pinned onto the agent's slot either.
    again = policy.place(Wanting(hint=title), [engine])
    assert again is not None and again.slot != first.slot and again.cached == 0


# --- the cache book: each session's last turns and its figures -------------------------------


def test_the_book_keeps_each_sessions_last_turn_the_least_recent_dropped_first():
    book = Sessions(max_sessions=2, max_per_flow=2, clock=lambda: 0.0)

    def served(session: str | None, body: dict[str, Any], cached: int, computed: int) -> Verdict:
        return book.judge(session, "k", "m", prompt_blocks(body), cached, computed,
                          engine="e1", engine_alive=lambda key: True)[0]

    assert served("k\na", FIRST, 0, 900).reason == "first_turn"
    assert not served("k\na", SECOND, 899, 421).missed  # judged against a's first turn
    served("k\nb", FIRST, 0, 900)
    served("k\nc", FIRST, 0, 900)  # a is dropped: the least recently served of three
    assert [s.session for s in book.caches()] == ["k\nc", "k\nb"]
    assert served("k\na", SECOND, 0, 1320).reason == "first_turn"  # forgotten
    # A prompt with nothing to name its session by is counted, never judged or kept.
    assert served(None, FIRST, 0, 900) == Verdict(0, 900)
    assert len(book.caches()) == 2


def test_a_key_making_a_session_per_request_never_pushes_anothers_out_of_the_book():
    book = Sessions(max_sessions=8, clock=lambda: 0.0)  # a quarter each: 2 sessions

    def served(flow: str, name: str) -> None:
        book.judge(f"{flow}\n{name}", flow, "m", prompt_blocks(FIRST), 0, 900, engine="e1",
                   engine_alive=lambda key: True)

    served("alice", "agent")
    for n in range(50):
        served("mallory", str(n))
    assert [s.session for s in book.caches()] == ["mallory\n49", "mallory\n48", "alice\nagent"]
    # alice's next turn is judged against her first: it was kept.
    verdict, _ = book.judge("alice\nagent", "alice", "m", prompt_blocks(SECOND), 899, 421,
                            engine="e1", engine_alive=lambda key: True)
    assert not verdict.missed
    assert book.forget_flow("mallory") == 2
    assert [s.session for s in book.caches()] == ["alice\nagent"]


def test_the_book_judges_each_turn_against_the_conversation_it_continues():
    book = Sessions(clock=lambda: 0.0)

    def served(body: dict[str, Any], cached: int, computed: int) -> Verdict:
        return book.judge("k\nses_1", "k", "m", prompt_blocks(body), cached, computed,
                          engine="e1", engine_alive=lambda key: True)[0]

    # The agent's first call ran first; the title ended after it.
    assert served(chat_bodies.AGENT, 0, 2340).reason == "first_turn"
    assert served(chat_bodies.TITLE, 12, 648).reason == "first_turn"
    # The agent's next turn continues its own conversation, not the title's.
    assert not served(AGENT_NEXT, 2339, 60).missed
    # A real miss in it is still one, and stays the session's last miss when the title
    # conversation comes again.
    assert served(AGENT_NEXT, 0, 2400).reason == "slot_taken"
    served(chat_bodies.TITLE, 12, 648)
    (summary,) = book.caches()
    assert summary.turns == 5 and summary.last_miss is not None
    assert summary.last_miss.reason == "slot_taken"


def test_the_book_finds_the_answered_turn_a_request_continues_on_the_same_model_only():
    book = Sessions(clock=lambda: 0.0)
    book.judge("k\nses_1", "k", "m", blocks_of(chat_bodies.AGENT), 0, 2340, engine="e1",
               engine_alive=lambda key: True)
    book.judge("k\nses_1", "k", "m", blocks_of(chat_bodies.TITLE), 12, 648, engine="e1",
               engine_alive=lambda key: True)

    found = book.continuation("k\nses_1", "m", blocks_of(AGENT_NEXT))
    assert found is not None and found.prompt_tokens == 2340  # the agent's, not the title's
    assert book.continuation("k\nses_1", "other-model", blocks_of(AGENT_NEXT)) is None
    assert book.continuation("k\nses_2", "m", blocks_of(AGENT_NEXT)) is None
    assert book.continuation(None, "m", blocks_of(AGENT_NEXT)) is None
    # Without a size (a body with images) there is no bound to give.
    assert book.continuation("k\nses_1", "m", prompt_blocks(AGENT_NEXT)) is None


# --- one book: a turn told once, a key forgotten at once ------------------------------------


def test_a_turn_told_once_places_its_session_judges_its_prompt_and_bounds_the_next():
    book = Sessions(clock=lambda: 0.0)

    def ended(body: dict[str, Any], cached: int, computed: int, slot: int) -> Verdict | None:
        return book.turn_ended("k\nses", "k", model="m", prefix=(7,), blocks=blocks_of(body),
                               engine="e1", label="this machine", slot=slot, pinned=True,
                               keeps_slot=True, prompt=(cached + computed, cached),
                               cache=(cached, computed), engine_alive=lambda key: True)

    assert ended(FIRST, 0, 900, slot=1) == Verdict(0, 900, "first_turn")
    place = book.where("k\nses")
    assert place is not None and (place.engine, place.slot, place.prompt_tokens) == ("e1", 1, 900)
    assert book.holder("e1", 1) is place
    next_turn = book.continuation("k\nses", "m", blocks_of(SECOND))
    assert next_turn is not None and next_turn.prompt_tokens == 900
    assert ended(SECOND, 899, 421, slot=0) == Verdict(899, 421)
    (summary,) = book.caches()
    assert (summary.turns, summary.cached, summary.computed) == (2, 899, 1321)
    assert book.holder("e1", 0) is book.where("k\nses") and book.holder("e1", 1) is None
    # A turn stopped before its answer (no figures to judge): placed, not judged.
    assert book.turn_ended("k\nses", "k", model="m", prefix=(7,), blocks=blocks_of(SECOND),
                           engine="e2", label="upstream 1", slot=None, pinned=False,
                           keeps_slot=False, prompt=(1320, 0), cache=None,
                           engine_alive=lambda key: True) is None
    assert book.where("k\nses") is not None and book.homed("e2") == 1
    assert book.caches()[0].turns == 2


def test_a_keys_sessions_go_in_one_call_with_their_figures_and_last_requests():
    book = Sessions(clock=lambda: 0.0)
    for flow in ("alice", "bob"):
        book.turn_ended(f"{flow}\nagent", flow, model="m", prefix=(1,), blocks=blocks_of(FIRST),
                        engine="e1", label="this machine", slot=None, pinned=False,
                        keeps_slot=False, prompt=(900, 0), cache=(0, 900),
                        engine_alive=lambda key: True)
        book.remember(ParkKey("model", flow, f"{flow}\nagent"),
                      SessionRequest("/v1/chat/completions", b"{}", (1,)))
    assert book.keep_flows({"bob"}) == 1
    assert book.flows() == ["bob"] and [s.session for s in book.caches()] == ["bob\nagent"]
    assert book.where("alice\nagent") is None and book.homed("e1") == 1
    assert book.last_request(ParkKey("model", "alice", "alice\nagent")) is None
    assert book.last_request(ParkKey("model", "bob", "bob\nagent")) is not None
    assert book.remembered_bytes == 2
