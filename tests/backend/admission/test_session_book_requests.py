"""The session book's memory of each session's last request (what brings a prefix back from
the engine's RAM cache before a planned loss): side turns do not replace the
conversation, and the bodies stay within their byte bound.  No I/O."""

from __future__ import annotations

from backend.admission.session_book import SessionRequest, Sessions
from backend.llama.slot_parking import ParkKey

ALICE = ParkKey("model", "alice", "alice\nthread-1")
BOB = ParkKey("model", "bob", "bob\nthread-1")
CAROL = ParkKey("model", "carol", "carol\nthread-1")
#: The digests of two prompts' first blocks: the agent's head, a title request's.
HEAD, TITLE = (11,), (22,)


def turn(n: int, begins: tuple[int, ...] = HEAD, size: int = 1000) -> SessionRequest:
    return SessionRequest("/v1/chat/completions", b"x" * (size * n), begins)


def test_each_turn_of_a_conversation_replaces_the_one_before():
    last = Sessions()
    assert last.remember(ALICE, turn(1)) and last.remember(ALICE, turn(2))
    assert last.last_request(ALICE) == turn(2)
    assert len(last) == 1 and last.remembered_bytes == len(turn(2).body)


def test_a_side_turn_does_not_replace_the_conversation_it_interrupts():
    last = Sessions()
    last.remember(ALICE, turn(3))
    # A title request: another first block, and shorter than the conversation.
    assert not last.remember(ALICE, turn(1, begins=TITLE))
    assert last.last_request(ALICE) == turn(3)
    assert last.remember(ALICE, turn(4))  # the conversation goes on
    assert last.last_request(ALICE) == turn(4)


def test_a_rewritten_head_longer_than_before_is_the_conversation_now():
    last = Sessions()
    last.remember(ALICE, turn(2))
    # Another first block but longer: the client rewrote its head and went on.
    assert last.remember(ALICE, turn(3, begins=TITLE))
    assert last.last_request(ALICE) == turn(3, begins=TITLE)


def test_requests_without_a_first_block_are_never_taken_for_side_turns():
    last = Sessions()
    last.remember(ALICE, turn(3, begins=()))
    assert last.remember(ALICE, turn(1, begins=HEAD))
    assert last.last_request(ALICE) == turn(1)


def test_the_least_recently_kept_sessions_go_first_past_the_byte_bound():
    last = Sessions(request_bytes=5000, request_bytes_per_flow=5000)
    last.remember(ALICE, turn(2))
    last.remember(BOB, turn(2))
    last.remember(ALICE, turn(2))  # alice answered again: bob is now the oldest
    last.remember(CAROL, turn(2))  # 6,000 bytes: one must go
    assert last.last_request(BOB) is None
    assert last.last_request(ALICE) == turn(2) and last.last_request(CAROL) == turn(2)
    assert last.remembered_bytes == 4000 <= last.request_bytes


def test_a_body_larger_than_the_bound_is_not_kept_and_costs_no_one_else_theirs():
    last = Sessions(request_bytes=5000, request_bytes_per_flow=5000)
    last.remember(BOB, turn(2))
    assert not last.remember(ALICE, turn(6))
    assert last.last_request(ALICE) is None and last.last_request(BOB) == turn(2)
    assert last.remembered_bytes == 2000


def test_a_key_past_its_share_of_the_bytes_loses_its_own_oldest_requests_only():
    last = Sessions(request_bytes=10_000)  # a quarter a key: 2,500 bytes
    last.remember(ALICE, turn(2))
    mallory = [ParkKey("model", "mallory", f"mallory\n{n}") for n in range(20)]
    for key in mallory:
        last.remember(key, turn(1))
    assert last.last_request(ALICE) == turn(2)
    assert [k for k in mallory if last.last_request(k) is not None] == mallory[-2:]
    # A body larger than a key's whole share is not kept, and costs its key nothing else.
    assert not last.remember(mallory[0], turn(3))
    assert [k for k in mallory if last.last_request(k) is not None] == mallory[-2:]
    assert last.forget_flow("mallory") == 2 and last.remembered_bytes == 2000 and len(last) == 1
