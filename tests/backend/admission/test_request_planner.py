"""A request is admitted with one question: its hint, its prompt's blocks and its plan
from one `admit`; a request for a model that is loading gets its plan once an engine
serves, from the same hint; a session's next turn is planned from its answered one; one
need planner per engine, made with the tokenizer the port hands in.

The engine's tokenizer is an in-test `EngineTokenizer` (the protocol the real counter asks
an engine through; the real one over HTTP is exercised by the gateway's planning tests):
a word is a token, a template adds TEMPLATE.  The registry, the lines, the turn book, the
counter and the need planner are real; nothing here does I/O.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from backend.admission.admission_registry import AdmissionRegistry
from backend.admission.continued_turn import CONTINUATION_SLACK
from backend.admission.need_planner import NO_PLAN
from backend.admission.prompt_bytes import prompt_size
from backend.admission.prompt_tokens import TEXT_SLACK, CountFailed
from backend.api_paths import CHAT, MESSAGES
from backend.admission.request_planner import RequestPlanner
from backend.admission.session_book import Sessions
from backend.llama.kv_capacity import KvCapacity, TokenNeed
from backend.llama.load import Serving
from backend.settings import Settings
from tests.backend.admission_helpers import NEW, OLD

TEMPLATE = 10  # tokens the template adds to any conversation
PROBE = TEMPLATE + 1  # the counter's probe: one message saying "x"
DEFAULT = 1024  # the operator's default output budget in these tests
MODEL = "m"
FLOW = "alice"


class WordTokenizer:
    """A word is a token; a template adds TEMPLATE.  Records what it was asked."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.asked: list[str] = []

    async def count_input_tokens(self, route: str, body: Mapping[str, Any]) -> int:
        self.asked.append(route)
        if body.get("messages") == [{"role": "user", "content": "x"}]:
            return PROBE
        return TEMPLATE + sum(len(str(m.get("content", "")).split())
                              for m in body.get("messages", []))

    async def apply_template(self, body: Mapping[str, Any]) -> str:
        raise CountFailed("this engine counts chats itself")

    async def tokenize(self, text: str) -> int:
        self.asked.append("tokenize")
        return len(text.split())


class Port:
    """What the gateway hands a `RequestPlanner`: its registry, the turn book, a
    tokenizer factory (here: word tokenizers, one per engine asked for) and settings."""

    def __init__(self, **settings: Any) -> None:
        self.settings = Settings(default_output_tokens=DEFAULT, **settings)
        self.registry = AdmissionRegistry(max_waiting_for=lambda slots: 64)
        self.book = Sessions(clock=lambda: 0.0)
        self.tokenizers: list[WordTokenizer] = []
        self.planner = RequestPlanner(self.registry, self.book, self._tokenizer,
                                      lambda: self.settings)

    def _tokenizer(self, serving: Serving) -> WordTokenizer:
        tokenizer = WordTokenizer(serving.base_url)
        self.tokenizers.append(tokenizer)
        return tokenizer

    def serve(self, base_url: str = OLD, *, slots: int = 4,
              kv: KvCapacity | None = KvCapacity.shared(16_384)) -> Serving:
        serving = Serving(base_url, slots, kv=kv)
        self.registry.activate(serving, model=MODEL)
        return serving

    def asked(self) -> list[list[str]]:
        return [tokenizer.asked for tokenizer in self.tokenizers]


def chat(*contents: str, **fields: Any) -> dict[str, Any]:
    roles = ("user", "assistant")
    return {"messages": [{"role": roles[i % 2], "content": text}
                         for i, text in enumerate(contents)], **fields}


def words(n: int, word: str = "word") -> str:
    return " ".join([word] * n)


def size(body: Mapping[str, Any]) -> int:
    return len(json.dumps(body).encode())


async def test_a_request_is_admitted_with_its_hint_blocks_and_plan_from_one_question() -> None:
    port = Port()
    port.serve()
    body = chat(words(20), prompt_cache_key="agent-7")

    admission = await port.planner.admit(port.registry.line(MODEL), CHAT, MODEL, FLOW, [],
                                         body, size(body))

    assert admission.hint.session == f"{FLOW}\nagent-7" and admission.hint.flow == FLOW
    # A session's turn: its blocks carry its size, the bound a next turn grows from.
    assert admission.blocks.chars == len(words(20)) and admission.blocks.size == size(body)
    assert admission.plan is not None and admission.plan.hint is admission.hint
    # Short: reserved on its byte bound (bytes, the measured template, slack), not counted.
    assert admission.plan.need == TokenNeed(size(body) + PROBE + TEXT_SLACK, DEFAULT)
    assert port.asked() == [[CHAT]]  # the template's probe only


async def test_a_request_naming_no_session_keeps_no_size_and_one_on_messages_is_not_pinned(
        ) -> None:
    port = Port()
    port.serve()
    line = port.registry.line(MODEL)
    body: dict[str, Any] = {"messages": []}  # no text: nothing to name a session by
    plain = await port.planner.admit(line, CHAT, MODEL, FLOW, [], body, size(body))
    anthropic = await port.planner.admit(line, MESSAGES, MODEL, FLOW,
                                         [(b"x-session-id", b"s1")], chat(words(3)), 60)

    assert plain.hint.session is None and plain.blocks.size == 0
    assert anthropic.hint.session == f"{FLOW}\ns1" and not anthropic.hint.pinnable


async def test_a_request_for_a_loading_model_is_planned_once_an_engine_serves_it() -> None:
    port = Port()
    line = port.registry.line(MODEL)  # its model loads: no engine serves it yet
    body = chat(words(20), prompt_cache_key="agent-7")

    admission = await port.planner.admit(line, CHAT, MODEL, FLOW, [], body, size(body))

    assert admission.plan is None
    assert admission.hint.session == f"{FLOW}\nagent-7" and admission.blocks.chars
    assert port.tokenizers == []  # nothing asked of an engine that does not serve

    port.serve()
    plan = await port.planner.plan_after_load(line, CHAT, MODEL, body, size(body),
                                              admission.hint, admission.blocks)

    assert plan.hint is admission.hint
    assert plan.need == TokenNeed(size(body) + PROBE + TEXT_SLACK, DEFAULT)


async def test_a_model_whose_load_went_away_again_is_planned_on_slots_alone() -> None:
    port = Port()
    line = port.registry.line(MODEL)
    admission = await port.planner.admit(line, CHAT, MODEL, FLOW, [], {"messages": []}, 15)
    plan = await port.planner.plan_after_load(line, CHAT, MODEL, {"messages": []}, 15,
                                              admission.hint, admission.blocks)
    assert plan.need is None and port.tokenizers == []


async def test_a_sessions_next_turn_is_planned_from_its_answered_turn_and_its_addition() -> None:
    """The second turn adds 400 words to a 1,000-word conversation: the engine tokenizes
    what was added, never the conversation, and the plan is the first turn's tokens (as
    the book has them) plus the addition's."""
    port = Port()
    serving = port.serve()
    line = port.registry.line(MODEL)
    first = chat(words(1_000), prompt_cache_key="agent-7")
    admitted = await port.planner.admit(line, CHAT, MODEL, FLOW, [], first, size(first))
    port.book.judge(admitted.hint.session, FLOW, MODEL, admitted.blocks, 0, TEMPLATE + 1_000,
                    engine=serving.key, engine_alive=lambda key: True)
    second = chat(words(1_000), "Done.", words(400, "more"), prompt_cache_key="agent-7")

    admission = await port.planner.admit(line, CHAT, MODEL, FLOW, [], second, size(second))

    added_text = "Done.\n" + words(400, "more")
    added_bytes = size(second) - size(first)
    expected = (TEMPLATE + 1_000 + 401 + (added_bytes - len(added_text)) + TEXT_SLACK
                + CONTINUATION_SLACK)
    assert admission.plan is not None and admission.plan.need == TokenNeed(expected, DEFAULT)
    assert not admission.plan.settle_later
    # The template's probe, then the addition (the first turn fit now: admitted on its
    # bound, it would be counted while it ran).
    assert port.asked() == [[CHAT, "tokenize"]]

    other = await port.planner.admit(line, CHAT, "another-model", FLOW, [], second,
                                     size(second))
    # No turn of the session on that model: its byte bound, counted while it runs.
    assert other.plan is not None and other.plan.settle_later
    assert other.plan.need == TokenNeed(size(second) + PROBE + TEXT_SLACK, DEFAULT)


async def test_one_need_planner_per_engine_kept_until_its_cache_or_the_output_policy_changes(
        ) -> None:
    port = Port()
    port.serve(slots=2)
    queue = port.registry.line(MODEL).planning_engine
    assert queue is not None

    planner = port.planner.planner_for(queue)
    assert planner is not None and port.planner.planner_for(queue) is planner
    assert planner.policy.default == DEFAULT
    assert planner.counter.max_counts == 4  # twice the model's slots, by default

    port.settings = port.settings.replace(default_output_tokens=512, max_prompt_counts=3)
    remade = port.planner.planner_for(queue)
    assert remade is not None and remade is not planner and remade.policy.default == 512
    assert remade.counter is planner.counter and remade.counter.max_counts == 3
    assert len(port.tokenizers) == 1  # the counter (and its measured template) is kept

    port.serve(NEW, slots=2)  # its model's next load replaces this one
    queue = port.registry.line(MODEL).planning_engine
    assert queue is not None
    fresh = port.planner.planner_for(queue)
    assert fresh is not None and fresh.counter is not planner.counter
    assert [t.base_url for t in port.tokenizers] == [OLD, NEW]


async def test_without_a_known_cache_or_with_admission_off_slots_alone_decide() -> None:
    port = Port()
    port.serve(kv=None)
    line = port.registry.line(MODEL)
    body = chat(words(20), prompt_cache_key="agent-7")
    named = await port.planner.admit(line, CHAT, MODEL, FLOW, [], body, size(body))
    unnamed = await port.planner.admit(line, CHAT, MODEL, FLOW, [], {"messages": []}, 15)

    assert named.plan is not None and named.plan.need is None
    assert named.plan.hint is named.hint  # placement still reads it
    assert unnamed.plan is NO_PLAN
    assert port.tokenizers == []

    port.serve(NEW)
    queue = line.planning_engine
    assert queue is not None
    queue.enabled = False
    off = await port.planner.admit(line, CHAT, MODEL, FLOW, [], body, size(body))
    assert off.plan is not None and off.plan.need is None and port.tokenizers == []
