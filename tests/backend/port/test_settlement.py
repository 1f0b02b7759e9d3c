"""A stream's usage reaches its key's books however the client leaves (against the fake
llama-server: only it can hold a stream's end open after its final event)."""

from __future__ import annotations

import asyncio

from tests.backend.gateway_harness import CHAT, chat, until


class Ledger:
    """The usage recorder the port feeds (the app's UsageLedger, minus the file)."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, int, int]] = []

    def record_request(self, key: str, prompt_tokens: int, completion_tokens: int) -> None:
        self.requests.append((key, prompt_tokens, completion_tokens))

    def record_wait(self, key: str, seconds: float) -> None:
        pass

    def record_refusal(self, key: str, reason: str) -> None:
        pass


async def test_a_client_that_hangs_up_after_the_final_event_is_charged_the_engines_usage(gw, fake):
    """Codex closes its connection once it has `response.completed`, before the engine's
    stream has ended: the usage it was sent still counts, not zero tokens."""
    ledger = Ledger()
    gw.ctx.flows.usage = ledger
    fake.end_gate = asyncio.Event()  # the final event goes out, [DONE] does not
    body = chat(True, stream_options={"include_usage": True})
    async with gw.client.stream("POST", CHAT, json=body) as response:
        async for line in response.aiter_lines():
            if '"usage"' in line:
                break  # and hang up
    await until(lambda: bool(ledger.requests))
    fake.end_gate.set()
    # The fake's usage: 3 prompt tokens, one completion token per chunk (8).
    assert [(prompt, completion) for _, prompt, completion in ledger.requests] == [(3, 8)]


async def test_a_client_that_hangs_up_after_the_final_event_has_its_turn_judged_not_cancelled(
        gw, fake):
    """Clients stop reading at the final usage or at [DONE]; the engine's stream ends a
    moment later (through another GGUF Studio port, one write later).  The turn was
    answered: its record says 200, no cancellation is counted, and its session's turn is
    in the cache book, for the next turn to be judged against and planned from."""
    fake.end_gate = asyncio.Event()
    fake.timings = {"cache_n": 0, "prompt_n": 3, "prompt_ms": 1.0}
    body = chat(True, stream_options={"include_usage": True})
    async with gw.client.stream("POST", CHAT, json=body,
                                headers={"x-session-id": "agent-1"}) as response:
        async for line in response.aiter_lines():
            if '"usage"' in line:
                break  # and hang up
    await until(lambda: bool(gw.ctx.requests.records()))
    fake.end_gate.set()
    [record] = gw.ctx.requests.records()
    assert (record.status, record.cache_miss, record.prompt_tokens) == (200, "first turn", 3)
    assert gw.metrics.totals()["cancellations"] == {}
    [session] = gw.registry.sessions.caches()
    assert session.turns == 1 and session.computed == 3
