"""The session table: where each session's prefix lives, bounded, one flow's own."""

from __future__ import annotations

import pytest

from backend.admission.sessions import SessionTable


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
    table = SessionTable(2, clock=Clock())
    table.record("a\ns1", flow="a", engine="e", slot=0, prefix=(1,))
    table.record("a\ns2", flow="a", engine="e", slot=1)
    table.record("a\ns1", flow="a", engine="e", slot=0, prefix=(1,))
    table.record("a\ns3", flow="a", engine="e", slot=2)
    assert len(table) == 2 and "a\ns2" not in table
    assert [s.key for s in table.snapshot()] == ["a\ns3", "a\ns1"]
    assert table.holder("e", 1) is None
    with pytest.raises(ValueError):
        SessionTable(0)


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
    table = SessionTable(max_sessions=3, clock=Clock())
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
