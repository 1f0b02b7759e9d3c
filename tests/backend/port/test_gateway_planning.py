"""How the port plans a request's need through a real engine: a session's next turn,
which continues its last answered one, is planned on that turn's count and what it adds
(its bytes, or the engine's tokens of its text when long), without asking the engine to
count the whole conversation again before it queues."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from backend.app.pool.pool_config import ModelEntry, PoolConfig
from backend.app.service import StudioService
from backend.llama.load import LoadSettings
from backend.port.tokenizer_client import HttpEngineTokenizer
from tests.backend.service_harness import ServiceFactory

CHAT = "/v1/chat/completions"
#: About 7 KB of text, some 1,600 tokens: its byte bound exceeds what the port reserves
#: uncounted on a 4,096-token slot, its count does not.
HEAD = " ".join(f"Rule {i}: keep each change small, and say in one line what it does."
                for i in range(100))


@pytest.fixture
async def service(running_service: ServiceFactory, tiny_model) -> StudioService:
    service = await running_service(queue_timeout=120)
    await service.start_pool(PoolConfig(models=(ModelEntry.for_file(
        str(tiny_model), settings=LoadSettings(parallel="1", ctx_size=4096)),)))
    return service


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The messages of each conversation the engine was asked to count."""
    asked: list[int] = []
    original = HttpEngineTokenizer.count_input_tokens

    async def spy(self: HttpEngineTokenizer, route: str, body: Any) -> int:
        if len(body.get("messages", ())) > 1:  # not the counter's one-message probe
            asked.append(len(body["messages"]))
        return await original(self, route, body)
    monkeypatch.setattr(HttpEngineTokenizer, "count_input_tokens", spy)
    return asked


@pytest.fixture
def tokenized(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The texts the engine was asked to tokenize."""
    asked: list[str] = []
    original = HttpEngineTokenizer.tokenize

    async def spy(self: HttpEngineTokenizer, text: str) -> int:
        asked.append(text)
        return await original(self, text)
    monkeypatch.setattr(HttpEngineTokenizer, "tokenize", spy)
    return asked


async def turn(client: httpx.AsyncClient, messages: list[dict[str, Any]],
               session: str = "thread-1") -> dict[str, Any]:
    answer = await client.post(CHAT, json={"model": "tiny", "messages": messages,
                                           "max_tokens": 4, "prompt_cache_key": session})
    assert answer.status_code == 200, answer.text
    body: dict[str, Any] = answer.json()
    return body


async def test_a_sessions_next_turn_is_not_counted_before_it_queues(service, port_client,
                                                                    counted, tokenized):
    first = [{"role": "system", "content": HEAD}, {"role": "user", "content": "Read main.py."}]
    await turn(port_client, first)
    assert counted == [2]  # its byte bound did not fit: counted before it queued
    second = [*first, {"role": "assistant", "content": "Reading it."},
              {"role": "user", "content": "Now open setup.py."}]
    answer = await turn(port_client, second)
    assert counted == [2], "the next turn was planned on the first one's count"
    # The bound it ran on held the prompt the engine read.
    usage = answer["usage"]["prompt_tokens"]
    assert 1_000 < usage < 4_092
    # Another session's first turn of the same conversation is counted: the bound is a
    # session's own.
    await turn(port_client, second, session="thread-2")
    assert counted == [2, 4]
    # A long addition (a file read back, 1,500 bytes) is not counted whole either: the
    # engine tokenizes what it adds alone (its bound's bytes would read as a long cold
    # prompt to the prefill budget).
    file = "Here is the file:\n" + "x = 1\n" * 250
    third = [*second, {"role": "assistant", "content": "Done."},
             {"role": "user", "content": file}]
    await turn(port_client, third)
    assert counted == [2, 4]
    assert tokenized == ["Done.\n" + file]
