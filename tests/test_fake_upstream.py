"""The fake upstream answers llama-server's counting routes, so a port attached to it
(`bench/relay.py`) counts prompts for real: short ones by the byte bound, long ones by
asking it."""

from __future__ import annotations

import json

from backend.llama.kv_capacity import KvCapacity
from backend.llama.load import Serving
from backend.admission.need_planner import NeedPlanner
from backend.admission.prompt_tokens import TEXT_SLACK, PromptCounter
from backend.port.tokenizer_client import HttpEngineTokenizer
from tests.fake_upstream import FakeUpstream
from tests.not_none import not_none

CHAT = "/v1/chat/completions"


def body(content: str) -> dict:
    return {"model": "fake-model", "stream": True,
            "messages": [{"role": "user", "content": content}]}


async def test_a_port_counts_long_prompts_with_the_fake_and_bounds_short_ones():
    slots = 64
    async with FakeUpstream(slots=slots, n_ctx=slots * 4096) as fake:
        tokenizer = HttpEngineTokenizer(fake.base_url)
        counter = PromptCounter(tokenizer)
        kv = KvCapacity.shared(slots * 4096)
        planner = NeedPlanner(Serving(fake.base_url, slots, kv=kv), counter)
        try:
            short, long_ = body("Hello"), body("word " * 3200)
            short_need = await planner.request_need(CHAT, short, len(json.dumps(short)))
            probes = len(fake.counted)  # the template's fixed part, measured once
            long_need = await planner.request_need(CHAT, long_, len(json.dumps(long_)))
        finally:
            await tokenizer.aclose()
    assert probes == 1 and fake.counted[0].body["messages"][0]["content"] == "x"
    assert [r.path for r in fake.counted[probes:]] == ["/v1/chat/completions/input_tokens"]
    assert fake.counted[-1].body == long_
    # ~4 bytes a token: 16,000 bytes of words count as ~4,000 tokens, well under the
    # 16,000+ the byte bound would have reserved; nothing reached the chat route.
    assert 3900 < long_need.prompt < 4100
    # the short one: reserved at its byte bound, without asking
    assert short_need.prompt == len(json.dumps(short)) + not_none(counter.template_base) + TEXT_SLACK
    assert fake.requests == []


async def test_the_fake_tokenizes_and_applies_a_template_like_an_older_engine():
    async with FakeUpstream() as fake:
        tokenizer = HttpEngineTokenizer(fake.base_url)
        try:
            prompt = await tokenizer.apply_template(body("Hello there"))
            tokens = await tokenizer.tokenize(prompt)
        finally:
            await tokenizer.aclose()
    assert prompt.endswith("<|im_start|>assistant\n") and "Hello there" in prompt
    assert tokens == (len(prompt.encode()) + 3) // 4 + 1  # one per 4 bytes, and a BOS


async def _first_content(client, url: str, tokens: int, started, fake: FakeUpstream) -> int | None:
    """Streams one chat; returns how many generations had completed when its first
    content chunk arrived (`started` is set once it is under way)."""
    request = dict(body("Hello"), fake={"n_tokens": tokens, "delay": 0.02})
    async with client.stream("POST", url + CHAT, json=request) as response:
        seen = None
        async for line in response.aiter_lines():
            if '"content":"' in line and seen is None:
                seen = fake.completed
                started.set()
        return seen  # None: no content came


async def test_with_enforced_slots_a_request_beyond_them_waits_for_a_free_one():
    import asyncio

    import httpx

    for enforce in (True, False):
        async with FakeUpstream(slots=1, enforce_slots=enforce) as fake:
            async with httpx.AsyncClient(timeout=10) as client:
                first_running = asyncio.Event()
                first = asyncio.create_task(
                    _first_content(client, fake.base_url, 10, first_running, fake))
                await first_running.wait()
                second = await _first_content(client, fake.base_url, 3, asyncio.Event(), fake)
                await first
        if enforce:
            # the second started only once the first had finished
            assert second is not None and second >= 1 and fake.waited == 1 and fake.peak_active == 1
        else:  # it ran beside the first (10 tokens at 20 ms each)
            assert second == 0 and fake.waited == 0 and fake.peak_active == 2


#: (route, body, tokens llama-server generates for it): it obeys the first limit it reads,
#: not the smallest one given.
LIMITS: list[tuple[str, dict[str, object], int]] = [
    ("/v1/chat/completions", {"max_tokens": 1, "n_predict": 5}, 5),
    ("/v1/chat/completions", {"max_tokens": 1, "max_completion_tokens": 5}, 5),
    ("/v1/chat/completions", {"max_completion_tokens": 5, "n_predict": 2}, 2),
    ("/v1/chat/completions", {"max_tokens": 1, "n_predict": -1}, 8),  # -1: no limit
    ("/v1/completions", {"prompt": "x", "max_tokens": 1, "n_predict": 5}, 5),
    ("/v1/responses", {"input": "x", "max_output_tokens": 1, "n_predict": 5}, 5),
    ("/v1/responses", {"input": "x", "max_output_tokens": 1, "max_tokens": 5}, 1),
    ("/v1/responses", {"input": "x", "max_tokens": 5}, 5),
    ("/v1/messages", {"max_tokens": 5, "n_predict": 1}, 5),  # n_predict never reaches it
]


async def test_the_fake_obeys_the_limit_llama_server_reads_first():
    import httpx

    async with FakeUpstream(n_tokens=8) as fake:
        async with httpx.AsyncClient(base_url=fake.base_url, timeout=10) as client:
            for route, limits, expected in LIMITS:
                request = {"messages": [{"role": "user", "content": "hi"}], "prompt": "hi",
                           "input": "hi", **limits}
                usage = (await client.post(route, json=request)).json()["usage"]
                generated = usage.get("completion_tokens", usage.get("output_tokens"))
                assert generated == expected, (route, limits)
