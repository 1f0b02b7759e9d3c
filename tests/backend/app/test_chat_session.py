"""The chat playground's conversation against the real SmolLM2 through a running port:
an answer streams with real figures, stop ends it and keeps what arrived (and frees the
engine's slot), regenerate replaces the last answer, clear empties; the port's own
errors reach the person as its sentence; a proxy the environment names never sees the
conversation nor the Chat tab's secret."""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path
from typing import Any

import pytest

from backend.app.chat_session import (SESSION_PREFIX, AnswerState, ChatOptions, ChatSession,
                                      ChatState)
from backend.app.service import StudioService
from backend.keys.key_store import CHAT_NAME
from backend.llama.load import LoadSettings
from tests.backend.app.pool.test_pool import until
from tests.backend.service_harness import ServiceFactory

OWNER_KEY = "owner-key-0123456789abcdef"
QUESTION = "What is the capital of France? Answer in one sentence."
STORY = "Write a very long story about a dragon who learns to cook. Use many chapters."


@pytest.fixture
async def service(running_service: ServiceFactory, smollm2_model: Path) -> StudioService:
    service = await running_service(api_key=OWNER_KEY, queue_timeout=120)
    await service.load(LoadSettings(parallel="1", ctx_size=4096, extra_args=("--no-repack",)).to_spec(str(smollm2_model)))
    return service


@pytest.fixture
def seen() -> list[ChatState]:
    return []


@pytest.fixture
def chat(service: StudioService, seen: list[ChatState]) -> ChatSession:
    session: ChatSession = ChatSession.of_service(service, on_change=lambda: seen.append(session.state))
    return session


@pytest.fixture
def options(service: StudioService) -> ChatOptions:
    models = [status.name for status in service.pool.statuses()]
    assert len(models) == 1
    return ChatOptions(model=models[0], system_prompt="You are a helpful assistant.",
                       temperature=0.0, max_tokens=64)


async def test_an_answer_streams_through_the_port_with_real_figures(service, chat, seen, options):
    answer = await asyncio.wait_for(chat.send(QUESTION, options), 120)

    assert answer.state is AnswerState.DONE, answer.error
    assert "Paris" in answer.text
    assert [turn.role for turn in chat.state.turns] == ["user", "assistant"]
    assert chat.state.turns[0].text == QUESTION and not chat.state.streaming
    # It came piece by piece, not in one block at the end.
    partial = {state.turns[-1].text for state in seen
               if state.turns and state.turns[-1].state is AnswerState.STREAMING}
    assert len(partial) >= 3
    figures = answer.figures
    assert figures is not None
    assert figures.first_token_seconds is not None and figures.first_token_seconds > 0
    assert figures.tokens_per_second is not None and figures.tokens_per_second > 0
    assert figures.output_tokens > 1 and figures.prompt_tokens and figures.prompt_tokens > 10
    # The owner's key sees the engine's cache figures; the next turn of the same
    # conversation finds its prefix kept.
    assert figures.cached_tokens is not None
    follow_up = await asyncio.wait_for(chat.send("And of Italy?", options), 120)
    assert follow_up.state is AnswerState.DONE, follow_up.error
    assert follow_up.figures is not None and follow_up.figures.cached_tokens is not None
    assert follow_up.figures.cached_tokens >= figures.prompt_tokens
    assert chat.request_body(options)["prompt_cache_key"].startswith(SESSION_PREFIX)
    # Its own flow: booked apart from the owner's agents, and named so in the inspector
    # (booked once the port has settled the request, which may be just after the client
    # read its last event).
    await until(lambda: service.usage.usage(CHAT_NAME).requests == 2, timeout=10)
    assert service.usage.usage("owner").requests == 0
    assert [r.key for r in service.requests.records()][-2:] == [CHAT_NAME, CHAT_NAME]


async def test_stop_ends_the_answer_keeps_what_arrived_and_frees_the_slot(service, chat, options):
    long = ChatOptions(options.model, temperature=0.8, max_tokens=3000)
    sending = asyncio.create_task(chat.send(STORY, long))
    await until(lambda: len(chat.state.turns) == 2 and len(chat.state.turns[1].text) > 20)
    arrived = chat.state.turns[1].text

    await chat.stop()
    answer = await asyncio.wait_for(sending, 10)

    assert answer.state is AnswerState.STOPPED
    assert answer.text.startswith(arrived) and answer.figures is not None
    assert 0 < answer.figures.output_tokens < 3000
    assert not chat.state.streaming
    # What the cache held for its prompt survives the stop (each chunk carries it).
    assert answer.figures.prompt_tokens is not None and answer.figures.cached_tokens is not None
    assert "cut at Max tokens" not in answer.figures.describe()
    await until(lambda: service.registry.total_active == 0, timeout=10)  # the engine let go
    # The stopped answer is part of the conversation, and the next turn works.
    assert chat.request_body(options)["messages"][-1] == {"role": "assistant", "content": answer.text}
    after = await asyncio.wait_for(chat.send(QUESTION, options), 120)
    assert after.state is AnswerState.DONE and after.text


async def test_regenerate_replaces_the_last_answer(service, chat, options, monkeypatch):
    loads: list[object] = []
    load_verify_locations = ssl.SSLContext.load_verify_locations

    def counted(context: ssl.SSLContext, *args: Any, **kwargs: Any) -> None:
        loads.append(context)
        load_verify_locations(context, *args, **kwargs)
    monkeypatch.setattr(ssl.SSLContext, "load_verify_locations", counted)
    first = await asyncio.wait_for(chat.send(QUESTION, options), 120)
    assert first.state is AnswerState.DONE and first.figures is not None

    again = await asyncio.wait_for(chat.regenerate(options), 120)

    assert again is not None and again.state is AnswerState.DONE and again.text
    assert [turn.role for turn in chat.state.turns] == ["user", "assistant"]
    assert chat.state.turns[1] is again and again is not first
    # The same question was asked again, without the dropped answer: the same prompt,
    # this time all but its last token found in the engine's cache.
    assert again.figures is not None and again.figures.prompt_tokens == first.figures.prompt_tokens
    assert again.figures.cached_tokens is not None and again.figures.cached_tokens > 0
    # The certificates are read once a process, not once a message (each read held the
    # port's loop 50-120 ms).
    assert len(loads) <= 1


async def test_clear_empties_the_conversation_and_stops_an_answer(service, chat, options):
    await asyncio.wait_for(chat.send(QUESTION, options), 120)
    session = chat.state.session
    sending = asyncio.create_task(chat.send(STORY, ChatOptions(options.model, max_tokens=3000)))
    await until(lambda: len(chat.state.turns) == 4 and chat.state.turns[3].text)

    await chat.clear()

    assert chat.state.turns == () and not chat.state.streaming
    assert chat.state.session != session  # the next turn is a new conversation
    await asyncio.wait_for(sending, 10)
    assert chat.state.turns == ()
    await until(lambda: service.registry.total_active == 0, timeout=10)
    assert await chat.regenerate(options) is None  # nothing to ask again


async def test_an_answer_cut_at_max_tokens_says_so(service, chat, options):
    short = ChatOptions(options.model, temperature=0.0, max_tokens=5)
    answer = await asyncio.wait_for(chat.send(STORY, short), 120)
    assert answer.state is AnswerState.DONE and answer.figures is not None
    assert answer.figures.cut_at_limit and answer.figures.describe().startswith("cut at Max tokens")
    finished = await asyncio.wait_for(chat.send(QUESTION, options), 120)
    assert finished.figures is not None and not finished.figures.cut_at_limit


async def test_a_cleared_conversation_comes_back_until_the_next_turn(service, chat, options):
    first = await asyncio.wait_for(chat.send(QUESTION, options), 120)
    session = chat.state.session
    await chat.clear()
    assert chat.state.turns == () and chat.state.can_undo_clear
    await chat.undo_clear()
    assert chat.state.turns[-1] is first and chat.state.session == session
    assert not chat.state.can_undo_clear
    await chat.clear()
    await asyncio.wait_for(chat.send(QUESTION, options), 120)  # a new conversation began
    assert not chat.state.can_undo_clear
    await chat.undo_clear()  # nothing to bring back: the new one stays
    assert len(chat.state.turns) == 2 and chat.state.session != session


async def test_the_ports_refusal_is_told_as_its_sentence(service, chat, options):
    answer = await asyncio.wait_for(chat.send(QUESTION, ChatOptions("no-such-model")), 30)

    assert answer.state is AnswerState.FAILED
    assert "404" in answer.error and "no-such-model" in answer.error
    # A failed answer is not sent back to the model with the next turn.
    assert chat.request_body(options)["messages"][-1] == {"role": "user", "content": QUESTION}


async def test_a_proxy_named_by_the_environment_never_sees_the_chat(service, chat, options,
                                                                    monkeypatch):
    """`HTTP_PROXY` on the owner's desktop (a company proxy, or a hostile one) would get
    every conversation and the Chat tab's owner-rights secret: the chat goes straight to
    this machine's port instead."""
    connections = []

    async def proxy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(await reader.read(65536))
        writer.close()  # a proxy that answers nothing: a chat sent through it fails fast

    listening = await asyncio.start_server(proxy, "127.0.0.1", 0)
    address = "http://127.0.0.1:%d" % listening.sockets[0].getsockname()[1]
    for name in ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy", "ALL_PROXY",
                 "all_proxy"):
        monkeypatch.setenv(name, address)
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    try:
        answer = await asyncio.wait_for(
            chat.send(QUESTION, ChatOptions(options.model, temperature=0.0, max_tokens=8)), 120)
    finally:
        listening.close()
        await listening.wait_closed()

    assert answer.state is AnswerState.DONE, answer.error
    assert answer.text
    assert connections == []
    await until(lambda: service.usage.usage(CHAT_NAME).requests == 1, timeout=10)


async def test_plain_completion_continues_the_text_of_a_model_without_a_chat_template(
        running_service: ServiceFactory, gemma3_model: Path):
    """Gemma 3 270M has no chat template: its chats are refused (the person reads why),
    and plain completion continues the conversation's text through /v1/completions."""
    service = await running_service(api_key=OWNER_KEY, queue_timeout=120)
    await service.load(LoadSettings(parallel="1", ctx_size=2048, threads=1).to_spec(
        str(gemma3_model), own_template=False))
    name = service.pool.statuses()[0].name
    chat = ChatSession.of_service(service)

    refused = await asyncio.wait_for(chat.send("Hello", ChatOptions(name, max_tokens=8)), 120)
    assert refused.state is AnswerState.FAILED
    assert refused.error.startswith(f"The port answered HTTP 400: The model {name} has no chat "
                                    "template") and "/v1/completions" in refused.error
    await chat.clear()

    plain = ChatOptions(name, temperature=0.0, max_tokens=12, completion=True)
    first = await asyncio.wait_for(chat.send("The capital of France is", plain), 120)
    assert first.state is AnswerState.DONE, first.error
    assert first.text.strip() and first.figures is not None
    assert first.figures.output_tokens > 1 and first.figures.prompt_tokens
    # The next turn continues the whole text: the answer after the prompt, the new text
    # on a line of its own.
    body = chat.request_body(plain)
    assert body["prompt"] == "The capital of France is" + first.text
    assert "messages" not in body and body["prompt_cache_key"].startswith(SESSION_PREFIX)
    second = await asyncio.wait_for(chat.send("The capital of Italy is", plain), 120)
    assert second.state is AnswerState.DONE, second.error
    new_line = "" if first.text.endswith("\n") else "\n"
    assert chat.request_body(plain)["prompt"] == (
        f"The capital of France is{first.text}{new_line}The capital of Italy is{second.text}")
    assert second.figures is not None and second.figures.cached_tokens  # the text before was kept
