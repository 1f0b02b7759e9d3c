"""A long prompt on an idle port is forwarded on its byte bound without waiting for its
count, and its reservation shrinks to the count when that returns; when the bound does
not fit now, the count still comes first.

The fake upstream is used because only it can hold a count's answer open
deterministically (`count_gate`): the real engine answers too fast to see the order.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import httpx
import pytest

from backend.llama.kv_capacity import KvCapacity
from backend.admission.prompt_tokens import DEFAULT_OUTPUT_TOKENS
from tests.backend.gateway_harness import CHAT, Gateway, cancel, chat, open_gateway, stream, until
from tests.fake_upstream import FakeUpstream

SLOTS = 4
KV = KvCapacity.shared(SLOTS * 4096)
LONG = "word " * 3200  # 16 KB: its byte bound is far above its fair share of 4,096


@pytest.fixture
async def counting() -> AsyncIterator[tuple[FakeUpstream, Gateway]]:
    async with FakeUpstream(slots=SLOTS, n_ctx=KV.total) as fake:
        async with open_gateway(fake.base_url, SLOTS, kv=KV) as gw:
            # A short request on its byte bound: measures the template once, ungated.
            response = await gw.client.post(CHAT, json=chat())
            assert response.status_code == 200
            fake.count_gate = asyncio.Event()
            yield fake, gw
            fake.count_gate.set()


def long_chat(**fake: object) -> dict:
    return chat(True, messages=[{"role": "user", "content": LONG}], fake=fake)


async def engine_count(fake: FakeUpstream, body: dict) -> int:
    async with httpx.AsyncClient(trust_env=False) as client:
        answer = await client.post(f"{fake.base_url}/v1/chat/completions/input_tokens",
                                   json=body)
    return answer.json()["input_tokens"]


def counting_long(fake: FakeUpstream) -> bool:
    return bool(fake.counted) and fake.counted[-1].body["messages"][0]["content"] == LONG


def settle_tasks() -> list[asyncio.Task]:
    return [t for t in asyncio.all_tasks() if "Plan.settle" in repr(t.get_coro())]


async def test_a_long_prompt_on_an_idle_port_is_forwarded_before_its_count_returns(counting):
    fake, gw = counting
    body = long_chat(hang=True)
    task = asyncio.create_task(stream(gw.client, CHAT, body))
    try:
        # Forwarded, while its count reached the engine and waits for the gate.
        await until(lambda: len(fake.requests) == 2 and counting_long(fake))
        assert not fake.count_gate.is_set()
        queue = gw.registry.current
        bound = queue.reserved_tokens
        assert queue.active == 1 and bound > len(LONG)  # reserved at the byte bound

        fake.count_gate.set()
        counted = await engine_count(fake, body) + DEFAULT_OUTPUT_TOKENS
        await until(lambda: queue.reserved_tokens == counted)
        assert counted < bound / 2  # ~4 bytes a token, against the bound's one
    finally:
        await cancel(task)
    await until(lambda: gw.registry.total_reserved_tokens == 0)


async def test_a_long_prompt_counts_first_when_its_bound_does_not_fit_now(counting):
    fake, gw = counting
    queue = gw.registry.current
    # Three running requests of 1,000 tokens leave 13,384 free: the 16 KB bound does not fit.
    holders = [asyncio.create_task(stream(gw.client, CHAT, chat(
        True, messages=[{"role": "user", "content": "x" * 600}], max_tokens=100,
        fake={"hang": True}))) for _ in range(3)]
    try:
        await until(lambda: queue.active == 3)
        held = queue.reserved_tokens
        task = asyncio.create_task(stream(gw.client, CHAT, long_chat(n_tokens=2)))
        await until(lambda: counting_long(fake))
        # Counting: no ticket yet, nothing reserved, not forwarded.
        assert queue.active == 3 and queue.waiting == 0 and queue.reserved_tokens == held
        assert len(fake.requests) == 1 + 3

        fake.count_gate.set()
        response, _ = await asyncio.wait_for(task, 10)
        assert response.status_code == 200 and len(fake.requests) == 1 + 4
    finally:
        await cancel(*holders)
    await until(lambda: gw.registry.total_reserved_tokens == 0)


async def test_a_client_that_leaves_while_its_prompt_is_counted_frees_everything(counting):
    fake, gw = counting
    task = asyncio.create_task(stream(gw.client, CHAT, long_chat(hang=True)))
    await until(lambda: len(fake.requests) == 2 and counting_long(fake))
    assert len(settle_tasks()) == 1
    await cancel(task)  # the client leaves; the count is still held by the engine

    await until(lambda: gw.registry.total_active == 0 and not settle_tasks())
    assert gw.registry.total_reserved_tokens == 0
    fake.count_gate.set()  # the count's answer comes too late to change anything
    response = await gw.client.post(CHAT, json=chat())
    assert response.status_code == 200
    assert gw.registry.total_reserved_tokens == 0
