"""A room shared by flows, without I/O: a flow past its share loses its own oldest, a
full room loses the oldest of the flow holding the most, never a smaller flow's."""

from __future__ import annotations

import pytest

from backend.admission.flow_shares import FlowShares, default_share


def test_a_flow_past_its_share_loses_its_own_least_recently_used():
    room: FlowShares[str] = FlowShares(capacity=10, share=3)
    for name in ("b1", "b2"):
        assert room.put("bob", name) == []
    assert [room.put("mallory", f"m{n}") for n in range(3)] == [[], [], []]
    room.touch("m0")  # used again: m1 is mallory's oldest now
    assert room.put("mallory", "m3") == ["m1"]
    assert room.put("mallory", "m4") == ["m2"]
    assert list(room.keys_of("mallory")) == ["m0", "m3", "m4"]
    assert list(room.keys_of("bob")) == ["b1", "b2"] and len(room) == 5


def test_a_full_room_makes_room_from_the_flow_holding_the_most():
    room: FlowShares[str] = FlowShares(capacity=6, share=4)
    room.put("alice", "a1")  # the least recently used of all
    room.put("bob", "b1")
    for n in range(4):
        room.put("mallory", f"m{n}")
    # Full: alice's next session pushes out mallory's oldest, not alice's nor bob's.
    assert room.put("alice", "a2") == ["m0"]
    assert room.put("bob", "b2") == ["m1"]
    # Even: the flow whose oldest was used longest ago gives.
    assert (room.units_of("alice"), room.units_of("bob"), room.units_of("mallory")) == (2, 2, 2)
    assert room.put("carol", "c1") == ["a1"]
    assert room.units == 6 and "a2" in room and "b1" in room


def test_units_count_bytes_and_a_key_larger_than_a_share_is_not_held():
    room: FlowShares[str] = FlowShares(capacity=1000, share=400)
    room.put("alice", "a1", 300)
    room.put("alice", "a2", 50)
    room.put("alice", "a1", 100)  # a1 again, smaller: what it holds is replaced
    assert room.units_of("alice") == 150
    # A key alone larger than a share: not held, and nothing of its flow goes for it.
    assert room.put("alice", "a3", 401) == ["a3"]
    assert "a3" not in room and room.units_of("alice") == 150
    assert room.put("alice", "a2", 401) == ["a2"]  # forgets what it held before
    assert room.units_of("alice") == 100 and room.units == 100


def test_a_discarded_key_frees_its_units_and_its_flow():
    room: FlowShares[str] = FlowShares(capacity=4)
    assert room.share == default_share(4) == 1
    room.put("alice", "a1")
    room.discard("a1")
    room.discard("never held")
    assert room.units == 0 and room.flows() == [] and list(room.keys_of("alice")) == []


@pytest.mark.parametrize("capacity, share", [(0, None), (4, 0), (True, None), (4.0, None)])
def test_a_room_needs_whole_positive_bounds(capacity, share):
    with pytest.raises(ValueError):
        FlowShares(capacity, share)
