"""The default placement and a request's hint, without I/O: engines here are plain values."""

from __future__ import annotations

from dataclasses import dataclass, field

from backend.llama.kv_capacity import TokenNeed
from backend.admission.placement import (NO_HINT, PREFIX_BLOCK_CHARS, Hint, MostFreeSlots, Seat,
                                    request_hint)


@dataclass(eq=False)
class Engine:
    """An engine as placement reads it: its free slot ids and the most one request may hold."""

    name: str
    free: list[int]
    room: int = 10_000
    seats: dict[int | None, Seat[Engine]] = field(default_factory=dict)

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

    def slot_free(self, slot: int) -> bool:
        return slot in self.free


@dataclass(frozen=True)
class Wanting:
    need: TokenNeed | None = None
    hint: Hint = NO_HINT


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


# --- the hint --------------------------------------------------------------------------------

def chat(*contents: str, **fields: object) -> dict[str, object]:
    return {"messages": [{"role": "user", "content": c} for c in contents], **fields}


def test_a_session_key_is_the_clients_prompt_cache_key_scoped_to_its_flow():
    body = chat("hi", prompt_cache_key="agent-7")
    assert request_hint("key alice", [], body).session == "key alice\nagent-7"
    assert request_hint("key bob", [], body).session != request_hint("key alice", [], body).session


def test_a_session_header_names_the_session_when_the_body_does_not():
    headers = [(b"Content-Type", b"application/json"), (b"X-Claude-Code-Session-Id", b"c1"),
               (b"x-session-id", b"s1")]
    assert request_hint("f", headers, chat("hi")).session == "f\ns1"  # the preferred header
    assert request_hint("f", headers[:2], chat("hi")).session == "f\nc1"
    assert request_hint("f", headers, chat("hi", prompt_cache_key="k")).session == "f\nk"
    assert request_hint("f", [], chat("hi")).session is None


def test_the_prefix_digest_names_the_blocks_two_prompts_share():
    system = "You are a coding agent. " * 200  # ~4.8 KB: more than the digest reads
    first = request_hint("f", [], {"system": "s", "messages": [{"role": "user", "content": "a" * 2_500}]})
    second = request_hint("f", [], {"system": "s", "messages": [{"role": "user", "content": "a" * 2_000 + "b" * 500}]})
    assert len(first.prefix) == 3  # 2,500 characters and a role mark: three blocks
    assert first.prefix[:1] == second.prefix[:1] and first.prefix[2] != second.prefix[2]
    long = request_hint("f", [], chat(system, "then"))
    assert len(long.prefix) == 4 and len(set(long.prefix)) == 4
    assert request_hint("f", [], chat(system, "other")).prefix == long.prefix  # beyond the digest
    assert request_hint("f", [], {"prompt": "x" * PREFIX_BLOCK_CHARS}).prefix != ()
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hello"}]}]}
    assert request_hint("f", [], parts).prefix == request_hint("f", [], chat("hello")).prefix


def test_a_request_without_session_or_prompt_text_has_no_hint():
    assert request_hint("f", [], {"input": [{"type": "image"}]}) is NO_HINT
    assert request_hint("f", [], {}) is NO_HINT
