"""What a request will hold of the KV cache, planned before admission: a short one on its
byte bound without counting, a longer one that fits now on its bound and counted while it
runs (then settled to the count), any other counted before it queues.

The engine's tokenizer is an in-test `EngineTokenizer` (the protocol the real counter
asks an engine through): a prompt counts as its words plus a fixed template, so every
figure below is worked out by hand.  The counter, the planner and the tickets are real.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from typing import Any

import pytest

from backend.errors import CountingFull
from backend.llama.kv_capacity import KvCapacity, TokenNeed
from backend.llama.load import Serving
from backend.admission.need_planner import NeedPlanner, OutputPolicy
from backend.admission.hint import Hint
from backend.admission.continued_turn import CONTINUATION_SLACK, Continued
from backend.admission.prompt_tokens import TEXT_SLACK, CountFailed, PromptCounter
from backend.api_paths import CHAT, COMPLETIONS, EMBEDDINGS
from tests.backend.admission_helpers import OLD, kv_queue_of

TEMPLATE = 10  # tokens the template adds to any conversation
PROBE = TEMPLATE + 1  # the counter's probe: one message saying "x"
DEFAULT = 1024  # the operator's default output budget in these tests
WAIT = 10.0


class WordTokenizer:
    """Counts a word as one token (a template adds TEMPLATE); records what it was asked.
    `gate`, while cleared, holds every count but the counter's probe (`held` is set when
    one waits there); `broken` fails them."""

    def __init__(self) -> None:
        self.asked: list[str] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.held = asyncio.Event()
        self.broken = False

    async def count_input_tokens(self, route: str, body: Mapping[str, Any]) -> int:
        self.asked.append(route)
        if body.get("messages") == [{"role": "user", "content": "x"}] and not body.get("tools"):
            return PROBE  # the counter measures the template once, however the engine is
        return await self._answer(TEMPLATE + sum(_words(m.get("content"))
                                                 for m in body.get("messages", [])))

    async def apply_template(self, body: Mapping[str, Any]) -> str:
        raise CountFailed("this engine counts chats itself")

    async def tokenize(self, text: str) -> int:
        self.asked.append("tokenize")
        return await self._answer(len(text.split()))

    async def _answer(self, tokens: int) -> int:
        if not self.gate.is_set():
            self.held.set()
            await self.gate.wait()
        if self.broken:
            raise CountFailed("the engine is gone")
        return tokens


def _words(content: Any) -> int:
    if isinstance(content, list):
        return sum(_words(part.get("text")) for part in content if isinstance(part, dict))
    return len(content.split()) if isinstance(content, str) else 0


def planner_of(kv: KvCapacity, slots: int = 4, *, max_counts: int = 0,
               policy: OutputPolicy = OutputPolicy(default=DEFAULT)
               ) -> tuple[NeedPlanner, WordTokenizer]:
    tokenizer = WordTokenizer()
    counter = PromptCounter(tokenizer, max_counts=max_counts)
    return NeedPlanner(Serving(OLD, slots, kv=kv), counter, policy), tokenizer


def chat(words: int, **fields: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": " ".join(["word"] * words)}], **fields}


def size(body: Mapping[str, Any]) -> int:
    return len(json.dumps(body).encode())


def chat_bound(body: Mapping[str, Any]) -> int:
    """The byte bound of a chat without tools: its bytes, the measured template, slack."""
    return size(body) + PROBE + TEXT_SLACK


# --- the room a request gets without counting ------------------------------------------------

@pytest.mark.parametrize(("kv", "slots", "route", "body", "room"), [
    # A fair share of a shared pool (16,384 / 4) less the default output budget.
    (KvCapacity.shared(16_384), 4, CHAT, {}, 4_096 - DEFAULT),
    # A split cache: each slot's own share, the same figure.
    (KvCapacity.split(16_384, 4), 4, CHAT, {}, 4_096 - DEFAULT),
    # Fewer slots, a larger share.
    (KvCapacity.shared(16_384), 2, CHAT, {}, 8_192 - DEFAULT),
    # A pool capped per request below the fair share: the cap.
    (KvCapacity.shared(16_384, 2_048), 2, CHAT, {}, 2_048 - DEFAULT),
    # The request's own output limit, not the default.
    (KvCapacity.shared(16_384), 4, CHAT, {"max_tokens": 3_000}, 4_096 - 3_000),
    (KvCapacity.shared(16_384), 4, COMPLETIONS, {"max_tokens": 100}, 4_096 - 100),
    # Embeddings generate nothing: the whole share.
    (KvCapacity.shared(16_384), 4, EMBEDDINGS, {}, 4_096),
    # An output limit as large as the share leaves no room: every prompt is counted.
    (KvCapacity.shared(16_384), 4, CHAT, {"max_tokens": 5_000}, 0),
])
def test_uncounted_room_is_a_fair_share_less_the_output_budget(kv: KvCapacity, slots: int,
                                                                route: str, body: dict[str, Any],
                                                                room: int) -> None:
    planner, tokenizer = planner_of(kv, slots)
    assert planner.uncounted_room(route, body) == room
    assert tokenizer.asked == []  # pure: no engine asked


def test_the_operators_cap_bounds_the_budget_and_so_widens_the_room() -> None:
    planner, _ = planner_of(KvCapacity.shared(16_384), policy=OutputPolicy(cap=512, default=DEFAULT))
    assert planner.uncounted_room(CHAT, {}) == 4_096 - 512
    assert planner.uncounted_room(CHAT, {"max_tokens": 3_000}) == 4_096 - 512


def test_a_planner_needs_a_known_cache() -> None:
    with pytest.raises(ValueError):
        NeedPlanner(Serving(OLD, 4), PromptCounter(WordTokenizer()))


# --- chat routes ----------------------------------------------------------------------------------

async def test_a_short_chat_is_reserved_at_its_bound_and_never_counted() -> None:
    planner, tokenizer = planner_of(KvCapacity.shared(16_384))
    body = chat(20)

    plan = await planner.plan(CHAT, body, size(body), fits_now=lambda need: pytest.fail(
        "a short request needs no decision about fitting now"))

    assert plan.need == TokenNeed(chat_bound(body), DEFAULT)
    assert not plan.settle_later
    assert tokenizer.asked == [CHAT]  # the template's probe, once per counter; not the body


async def test_a_long_chat_that_fits_now_runs_on_its_bound_and_settles_to_its_count() -> None:
    planner, tokenizer = planner_of(KvCapacity.shared(16_384))
    body = chat(1_000)  # 5,000 bytes: beyond the uncounted room of 3,072
    bound = TokenNeed(chat_bound(body), DEFAULT)
    offered: list[TokenNeed] = []

    def fits_now(need: TokenNeed) -> bool:
        offered.append(need)
        return True

    plan = await planner.plan(CHAT, body, size(body), fits_now=fits_now)

    assert offered == [bound] and plan.need == bound and plan.settle_later
    assert tokenizer.asked == [CHAT]  # admitted before any count of its own
    queue = kv_queue_of(slots=4, kv=KvCapacity.shared(16_384))
    ticket = queue.request(plan.need)
    assert ticket.admitted and queue.reserved_tokens == bound.total

    await plan.settle(ticket)

    counted = TokenNeed(TEMPLATE + 1_000, DEFAULT)
    assert ticket.need == counted and queue.reserved_tokens == counted.total
    assert tokenizer.asked == [CHAT, CHAT]
    ticket.release()


async def test_a_long_chat_that_does_not_fit_now_is_counted_before_it_queues() -> None:
    planner, tokenizer = planner_of(KvCapacity.shared(16_384))
    body = chat(1_000)

    plan = await planner.plan(CHAT, body, size(body))  # fits_now: never, by default

    assert plan.need == TokenNeed(TEMPLATE + 1_000, DEFAULT) and not plan.settle_later
    assert tokenizer.asked == [CHAT, CHAT]


def continued_at(bound: int) -> Continued:
    """A short continued turn whose bound is `bound`."""
    return Continued(bound - TEXT_SLACK - CONTINUATION_SLACK, 0)


@pytest.mark.parametrize(("continued", "counted_while_running"), [
    (1_200, False),  # within the uncounted room (3,072): reserved, never counted
    (3_500, True),   # beyond it, fitting now: admitted on it and counted while it runs
])
async def test_a_turn_continuing_its_session_is_planned_on_that_bound_and_not_counted_first(
        continued: int, counted_while_running: bool) -> None:
    """A long conversation's next turn, whose byte bound would be counted before it
    queues, is planned on the bound its earlier turn gives (that turn's tokens plus the
    bytes added) when that bound is lower."""
    planner, tokenizer = planner_of(KvCapacity.shared(16_384))
    body = chat(1_000)
    plan = await planner.plan(CHAT, body, size(body), continued=continued_at(continued),
                              fits_now=lambda need: need.prompt == continued)

    assert plan.need == TokenNeed(continued, DEFAULT)
    assert plan.settle_later is counted_while_running
    assert tokenizer.asked == [CHAT]  # the template's probe only: no count before it runs


async def test_a_continued_bound_above_the_byte_bound_is_not_used() -> None:
    planner, tokenizer = planner_of(KvCapacity.shared(16_384))
    body = chat(20)
    plan = await planner.plan(CHAT, body, size(body),
                              continued=continued_at(chat_bound(body) + 1))
    assert plan.need == TokenNeed(chat_bound(body), DEFAULT)


async def test_a_long_addition_is_counted_alone_and_planned_as_counted() -> None:
    """A turn adding 400 words to a 1,000-word conversation: the engine tokenizes the 400
    words, not the conversation, and nothing is counted while it runs, even where the
    request does not fit now (it would be counted before it queues)."""
    planner, tokenizer = planner_of(KvCapacity.shared(16_384))
    body = chat(1_400)
    added = " ".join(["word"] * 400)
    continued = Continued(TEMPLATE + 1_000, len(added) + 40, added)
    plan = await planner.plan(CHAT, body, size(body), continued=continued)

    expected = TEMPLATE + 1_000 + 400 + 40 + TEXT_SLACK + CONTINUATION_SLACK
    assert plan.need == TokenNeed(expected, DEFAULT) and not plan.settle_later
    assert tokenizer.asked == [CHAT, "tokenize"]  # the template's probe, then the addition


async def test_a_chat_with_an_image_has_no_bound_and_is_counted() -> None:
    planner, tokenizer = planner_of(KvCapacity.shared(16_384))
    body = {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}

    assert await planner.bound_need(CHAT, body, size(body)) is None
    plan = await planner.plan(CHAT, body, size(body), fits_now=lambda need: pytest.fail(
        "no bound to admit on"))

    assert plan.need == TokenNeed(TEMPLATE + 3, DEFAULT) and not plan.settle_later
    assert tokenizer.asked == [CHAT]  # the engine counted it (images through its projector)


async def test_the_output_budget_shrinks_to_the_room_a_long_prompt_leaves() -> None:
    planner, _ = planner_of(KvCapacity.shared(16_384, 2_048), slots=2)
    body = chat(1_500)

    need = await planner.counted_need(CHAT, body, size(body))

    assert need == TokenNeed(TEMPLATE + 1_500, 2_048 - TEMPLATE - 1_500)


# --- completions and embeddings -----------------------------------------------------------------

async def test_a_short_completion_is_reserved_at_its_bound_without_asking_the_engine() -> None:
    planner, tokenizer = planner_of(KvCapacity.shared(16_384))
    body = {"prompt": ["one two three", "four five"], "max_tokens": 64}

    plan = await planner.plan(COMPLETIONS, body, size(body))

    assert plan.need == TokenNeed(len("one two three") + len("four five") + 2 * TEXT_SLACK, 64)
    assert not plan.settle_later and tokenizer.asked == []


async def test_a_prompt_given_as_token_ids_is_exact() -> None:
    planner, tokenizer = planner_of(KvCapacity.shared(16_384))
    body = {"prompt": list(range(5_000))}  # beyond the room, yet nothing to count

    plan = await planner.plan(COMPLETIONS, body, size(body))

    assert plan.need == TokenNeed(5_000, DEFAULT) and tokenizer.asked == []


async def test_a_long_embedding_input_is_counted_and_reserves_no_output() -> None:
    planner, tokenizer = planner_of(KvCapacity.shared(16_384))
    body = {"input": " ".join(["word"] * 1_000)}  # 4,999 bytes: beyond the room of 4,096

    plan = await planner.plan(EMBEDDINGS, body, size(body))

    assert plan.need == TokenNeed(1_000, 0) and tokenizer.asked == ["tokenize"]


# --- settling when counting fails or is busy --------------------------------------------------------

async def test_a_count_that_fails_after_admission_keeps_the_bound_reserved() -> None:
    planner, tokenizer = planner_of(KvCapacity.shared(16_384))
    body = chat(1_000)
    plan = await planner.plan(CHAT, body, size(body), fits_now=lambda need: True)
    queue = kv_queue_of(slots=4, kv=KvCapacity.shared(16_384))
    ticket = queue.request(plan.need)
    tokenizer.broken = True

    await plan.settle(ticket)

    assert ticket.need == plan.need and queue.reserved_tokens == chat_bound(body) + DEFAULT
    ticket.release()


async def test_a_busy_engine_refuses_a_count_before_admission_but_not_a_settle() -> None:
    planner, tokenizer = planner_of(KvCapacity.shared(16_384), max_counts=1)
    await planner.bound_need(CHAT, chat(1), size(chat(1)))  # the probe, measured first
    tokenizer.gate.clear()
    body = chat(1_000)
    holding = asyncio.create_task(planner.request_need(CHAT, body, size(body)))
    await asyncio.wait_for(tokenizer.held.wait(), WAIT)  # the engine is counting it

    with pytest.raises(CountingFull):
        await planner.plan(CHAT, body, size(body))
    plan = await planner.plan(CHAT, body, size(body), fits_now=lambda need: True)
    assert plan.count_later is not None
    # A request already running keeps its bound rather than wait for a count or fail.
    assert await plan.count_later() == TokenNeed(chat_bound(body), DEFAULT)

    tokenizer.gate.set()
    assert await holding == TokenNeed(TEMPLATE + 1_000, DEFAULT)


# --- the hint --------------------------------------------------------------------------------------

async def test_every_plan_carries_the_requests_hint_to_its_ticket() -> None:
    planner, _ = planner_of(KvCapacity.shared(16_384))
    hint = Hint(session="flow\nagent", prefix=(1, 2))
    line = kv_queue_of(4, KvCapacity.shared(16_384)).line
    short, long = chat(20), chat(5_000)
    plans = [await planner.plan(CHAT, short, size(short), hint=hint),  # on its bound
             await planner.plan(CHAT, long, size(long), hint=hint,     # admitted, counted later
                                fits_now=lambda need: True),
             await planner.plan(CHAT, long, size(long), hint=hint)]    # counted first
    assert [plan.settle_later for plan in plans] == [False, True, False]
    assert all(plan.hint is hint for plan in plans)
    assert line.request(plans[0].need, hint=plans[0].hint).hint is hint
