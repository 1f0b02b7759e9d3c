"""The session table: where each session's prefix lives, bounded, one flow's own."""

from __future__ import annotations

import pytest

from backend.admission.hint import Hint
from backend.admission.placement import KeepPrefixes, Seat
from backend.admission.session_book import SessionTable
from backend.llama.kv_capacity import KvCapacity, TokenNeed
from tests.backend.admission.test_placement import Clock as PlacementClock, Engine, Wanting


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def test_a_served_turn_says_where_the_session_lives() -> None:
    table = SessionTable(clock=Clock())
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
    table = SessionTable(clock=Clock())
    table.record("a\ns1", flow="a", engine="e1", slot=0, prompt_tokens=10)
    table.record("a\ns2", flow="a", engine="e1", slot=0, prompt_tokens=10)
    first = table.where("a\ns1")
    assert first is not None and first.engine == "e1" and first.slot is None
    assert table.holder("e1", 0).key == "a\ns2"  # type: ignore[union-attr]
    assert [s.key for s in table.resident("e1")] == ["a\ns1", "a\ns2"]
    assert table.vacate("e1", 0).key == "a\ns2"  # type: ignore[union-attr]
    assert table.holder("e1", 0) is None


def test_an_engine_that_goes_leaves_its_sessions_homeless() -> None:
    table = SessionTable(clock=Clock())
    table.record("a\ns1", flow="a", engine="e1", slot=0)
    table.record("a\ns2", flow="a", engine="e2", slot=0)
    assert [s.key for s in table.forget_engine("e1")] == ["a\ns1"]
    gone = table.where("a\ns1")
    assert gone is not None and not gone.resident and gone.slot is None
    assert table.holder("e1", 0) is None
    assert table.holder("e2", 0).key == "a\ns2"  # type: ignore[union-attr]


def test_the_table_is_bounded_least_recently_served_first() -> None:
    table = SessionTable(2, max_per_flow=2, clock=Clock())
    table.record("a\ns1", flow="a", engine="e", slot=0, prefix=(1,))
    table.record("a\ns2", flow="a", engine="e", slot=1)
    table.record("a\ns1", flow="a", engine="e", slot=0, prefix=(1,))
    table.record("a\ns3", flow="a", engine="e", slot=2)
    assert len(table) == 2 and "a\ns2" not in table
    assert [s.key for s in table.snapshot()] == ["a\ns3", "a\ns1"]
    assert table.holder("e", 1) is None
    with pytest.raises(ValueError):
        SessionTable(0)


def test_a_key_making_a_session_per_request_never_pushes_out_anothers() -> None:
    table = SessionTable(8, clock=Clock())  # a key may hold a quarter: 2 sessions
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
    table = SessionTable(4, max_per_flow=3, clock=Clock())
    table.record("alice\nold", flow="alice", engine="e")  # the least recently served
    for n in range(3):
        table.record(f"mallory\n{n}", flow="mallory", engine="e")
    table.record("bob\nnew", flow="bob", engine="e")
    assert "alice\nold" in table and "mallory\n0" not in table and len(table) == 4


def test_a_prefix_matches_only_the_flows_own_sessions() -> None:
    table = SessionTable(clock=Clock())
    table.record("a\ns1", flow="a", engine="e", slot=0, prefix=(1, 2, 3))
    match = table.match_prefix("a", (1, 2, 9))
    assert match is not None and match[0].key == "a\ns1" and match[1] == 2
    assert table.match_prefix("b", (1, 2, 3)) is None
    assert table.match_prefix("a", (7,)) is None
    assert table.forget_flow("a") == 1
    assert table.match_prefix("a", (1, 2, 3)) is None


def test_the_table_counts_the_sessions_living_on_each_engine() -> None:
    table = SessionTable(max_sessions=3, max_per_flow=3, clock=Clock())
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
    table = SessionTable(clock=Clock())
    table.record("o\nses", flow="o", engine="e", slot=0, prompt_tokens=5_000,
                 cached_tokens=4_000, prefix=AGENT)
    table.record("o\nses", flow="o", engine="e", slot=1, prompt_tokens=300, prefix=TITLE)
    session = table.where("o\nses")
    assert session is not None
    assert (session.engine, session.slot, session.prefix) == ("e", 0, AGENT)
    assert (session.prompt_tokens, session.cached_tokens, session.turns) == (5_000, 4_000, 1)
    assert table.holder("e", 0) is session and table.holder("e", 1) is None


def test_an_agents_turn_that_ends_after_its_title_request_is_the_sessions_place() -> None:
    table = SessionTable(clock=Clock())
    table.record("o\nses", flow="o", engine="e", slot=1, prompt_tokens=300, prefix=TITLE)
    table.record("o\nses", flow="o", engine="e", slot=0, prompt_tokens=5_000, prefix=AGENT)
    session = table.where("o\nses")
    assert session is not None and (session.slot, session.prefix) == (0, AGENT)
    assert table.holder("e", 1) is None  # the title's slot holds nobody's conversation


def test_a_title_request_on_the_agents_own_slot_takes_the_slot_not_the_session() -> None:
    table = SessionTable(clock=Clock())
    table.record("o\nses", flow="o", engine="e", slot=0, prompt_tokens=5_000, prefix=AGENT)
    table.record("o\nses", flow="o", engine="e", slot=0, prompt_tokens=300, prefix=TITLE)
    session = table.where("o\nses")
    # Its prefix is in the engine's RAM cache now: not pinned to the slot the title holds.
    assert session is not None and (session.engine, session.slot) == ("e", None)
    assert session.prefix == AGENT and table.holder("e", 0) is None


def test_the_agents_next_turn_after_a_title_request_is_pinned_to_the_agents_slot() -> None:
    engine = Engine("e", [0, 1, 2, 3], kv=KvCapacity.split(16_384, 4), pin_any_slot=True)
    policy = KeepPrefixes(SessionTable(), clock=PlacementClock())
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
    policy.served(agent.session, "o", AGENT, first, "this machine", 5_000, 0)
    engine.free.append(side.slot)
    engine.released.append(side.slot)
    policy.served(title.session, "o", TITLE, side, "this machine", 300, 0)
    nxt = policy.place(Wanting(TokenNeed(5_400, 200), agent), [engine])
    assert nxt == Seat(engine, first.slot, pinned=True, cached=5_000)
    # A title request after it is not pinned onto the agent's slot either.
    again = policy.place(Wanting(hint=title), [engine])
    assert again is not None and again.slot != first.slot and again.cached == 0
