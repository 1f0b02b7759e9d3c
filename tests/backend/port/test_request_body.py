"""Request bodies through a real port: parsed off the event loop when large, bounded while
they wait, and never unlimited.  The upstream is the fake one: what is measured here is
the port itself (a real engine would add its own parsing of the same bytes).

One output limit per request: what the port writes into a body is what it reserves, and
against the real llama-server (its own reading of the limit fields) no request generates
more than the port reserved for it, whatever limits it sends."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from backend.app.service import StudioService
from backend.llama.api import engine_headers
from backend.llama.load import LoadSettings
from backend.admission.prompt_tokens import MIN_OUTPUT_TOKENS, output_budget
from backend.port.request_body import PARSE_OFF_LOOP_BYTES, name_model, parse_body
from backend.settings import Settings
from tests.backend.gateway_harness import CHAT, assert_clean_error, chat, open_gateway, until
from tests.backend.service_harness import ServiceFactory
from tests.not_none import not_none

COMPLETIONS = "/v1/completions"
RESPONSES = "/v1/responses"
MESSAGES = "/v1/messages"


def many_small_objects(size: int) -> bytes:
    """A body of `size` bytes or more made of tiny messages (the slowest JSON to parse),
    with a `stream` of the wrong type at the end: parsed in full, then refused (400),
    so nothing is forwarded."""
    message = {"role": "user", "content": "hi"}
    count = size // len(json.dumps(message)) + 1
    body = {"model": "fake-model", "messages": [message] * count, "stream": "yes"}
    return json.dumps(body).encode()


class LoopGaps:
    """The longest time the event loop went without running a 1 ms ticker."""

    def __init__(self) -> None:
        self.longest = 0.0
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> "LoopGaps":
        self._task = asyncio.create_task(self._tick())
        await asyncio.sleep(0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()

    async def _tick(self) -> None:
        last = time.perf_counter()
        while True:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            self.longest = max(self.longest, now - last)
            last = now


def post_raw(port: int, body: bytes) -> bytes:
    """POST `body` from a plain blocking socket (run in a thread: the loop stays free)."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\nContent-Length: %d\r\n"
                     b"Connection: close\r\n\r\n" % len(body) + body)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
        return answer


async def test_a_large_body_is_parsed_without_stalling_the_event_loop(fake):
    body = many_small_objects(24 * 1024 * 1024)
    async with LoopGaps() as on_loop:
        json.loads(body)  # what the port did on its loop before
        await asyncio.sleep(0.01)
    async with open_gateway(fake.base_url, fake.slots) as gw:
        async with LoopGaps() as port:
            answer = await asyncio.to_thread(post_raw, gw.server.port, body)
    print(f"\nlongest loop stall: {on_loop.longest:.3f} s parsing on the loop, "
          f"{port.longest:.3f} s while the port parsed {len(body) >> 20} MiB")
    assert answer.startswith(b"HTTP/1.1 400")
    assert b"'stream' must be true or false" in answer
    # Measured on the test machine: 0.57-0.71 s on the loop, 0.05-0.07 s through the port.
    assert port.longest < on_loop.longest / 2, (port.longest, on_loop.longest)
    assert PARSE_OFF_LOOP_BYTES <= 1024 * 1024


async def test_bodies_held_by_waiting_requests_are_bounded(gw, fake):
    gw.configure(max_waiting_body_bytes=100_000)
    async with gw.client.stream("POST", CHAT, json=chat(True, fake={"hang": True})) as one, \
            gw.client.stream("POST", CHAT, json=chat(True, fake={"hang": True})) as two:
        assert one.status_code == two.status_code == 200  # both slots are held
        waiter = asyncio.create_task(gw.client.post(CHAT, json=chat(padding="x" * 60_000)))
        await until(lambda: gw.registry.total_waiting == 1)
        refused = await gw.client.post(CHAT, json=chat(padding="x" * 60_000))
        assert_clean_error(refused, 429, "server_is_overloaded", gw)
        assert "request bodies" in refused.json()["error"]["message"]
        small = asyncio.create_task(gw.client.post(CHAT, json=chat()))  # still fits
        await until(lambda: gw.registry.total_waiting == 2)
    assert (await waiter).status_code == 200
    assert (await small).status_code == 200


async def test_a_body_limit_of_zero_means_the_default_not_unlimited(gw, fake):
    gw.configure(max_body_bytes=0)
    declared = Settings().max_body_bytes + 1

    def send_head() -> bytes:
        with socket.create_connection(("127.0.0.1", gw.server.port), timeout=10) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                         b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n{"
                         % declared)
            return sock.recv(65536)  # refused by its header, before the body

    answer = await asyncio.to_thread(send_head)
    assert answer.startswith(b"HTTP/1.1 413")


def test_a_body_naming_no_model_is_sent_naming_the_one_it_was_routed_to():
    """For an engine that is another port with several models (it would take a request
    naming none for its own default): the body names the model, the output cap kept."""
    parsed = parse_body("/v1/chat/completions",
                        json.dumps({"messages": [{"role": "user", "content": "héllo"}]}).encode(), 64)
    name_model(parsed, "smol")
    assert parsed.model == "smol"
    assert json.loads(parsed.body) == {"messages": [{"role": "user", "content": "héllo"}],
                                       "max_tokens": 64, "model": "smol"}


# --- one output limit -------------------------------------------------------------------------

#: (route, limit fields sent, cap, limit fields forwarded, output reserved): the one limit
#: the engine obeys, written into every limit field it reads, and reserved.
WRITTEN: list[tuple[str, dict[str, Any], int, dict[str, Any], int]] = [
    (CHAT, {"max_tokens": 1, "n_predict": 40}, 0, {"max_tokens": 40, "n_predict": 40}, 40),
    (CHAT, {"max_tokens": 1, "max_completion_tokens": 40}, 0,
     {"max_tokens": 40, "max_completion_tokens": 40}, 40),
    (COMPLETIONS, {"max_tokens": 90, "n_predict": 40}, 0, {"max_tokens": 40, "n_predict": 40}, 40),
    (RESPONSES, {"max_output_tokens": 16, "n_predict": 40}, 0,
     {"max_output_tokens": 40, "n_predict": 40}, 40),
    # the engine's Anthropic conversion reads max_tokens alone, 4,096 when absent
    (MESSAGES, {"max_tokens": 16, "n_predict": 40}, 0, {"max_tokens": 16, "n_predict": 40}, 16),
    (MESSAGES, {}, 0, {"max_tokens": 4096}, 4096),
    # -1: no limit of its own (the engine's default, which is the cap)
    (CHAT, {"max_tokens": 1, "n_predict": -1}, 0, {"max_tokens": 1, "n_predict": -1}, 64),
    (CHAT, {"max_tokens": 1, "n_predict": -1}, 30, {"max_tokens": 30, "n_predict": 30}, 30),
    (CHAT, {"max_tokens": 1, "n_predict": 50_000}, 30, {"max_tokens": 30, "n_predict": 30}, 30),
    # 0 (evaluate the prompt, generate nothing) is said by n_predict alone
    (CHAT, {"max_tokens": 9, "max_completion_tokens": 5, "n_predict": 0}, 30,
     {"max_tokens": None, "max_completion_tokens": None, "n_predict": 0}, MIN_OUTPUT_TOKENS),
]


@pytest.mark.parametrize("route,limits,cap,forwarded,budget", WRITTEN,
                         ids=[f"{route} {i}" for i, (route, *_) in enumerate(WRITTEN)])
def test_the_limit_the_engine_obeys_is_written_into_every_field_and_reserved(
        route, limits, cap, forwarded, budget):
    parsed = parse_body(route, json.dumps(request_for(route, limits)).encode(), cap)
    sent = json.loads(parsed.body)
    assert {name: sent.get(name) for name in forwarded} == forwarded
    assert output_budget(route, parsed.data, prompt_tokens=10, limit=100_000, cap=cap,
                         default=64) == budget


#: The operator's output cap the port starts with (the engine is started under it).
CAP = 150
#: (route, limit fields, cap, tokens the engine generates; None: until its context ends).
#: The port's default budget is made small (64), so that a request reserved at it while
#: the engine reads a larger limit shows.
CONFLICTS: list[tuple[str, dict[str, Any], int, int | None]] = [
    (CHAT, {"max_tokens": 1, "n_predict": -1}, CAP, CAP),
    (COMPLETIONS, {"max_tokens": 1, "n_predict": 50_000}, CAP, CAP),
    (RESPONSES, {"max_output_tokens": 16, "n_predict": -1}, CAP, CAP),
    (MESSAGES, {"max_tokens": 1000, "n_predict": 1}, CAP, CAP),
    (CHAT, {"max_tokens": 1, "n_predict": 200}, 0, 200),
    (CHAT, {"max_tokens": 1, "max_completion_tokens": 200}, 0, 200),
    (CHAT, {"max_tokens": 1, "n_predict": 50_000}, 0, None),
    (COMPLETIONS, {"max_tokens": 1, "n_predict": 200}, 0, 200),
    (COMPLETIONS, {"max_tokens": 1, "max_completion_tokens": 200}, 0, 200),
    (RESPONSES, {"max_output_tokens": 16, "n_predict": 200}, 0, 200),
    (RESPONSES, {"max_output_tokens": 16, "max_completion_tokens": 200}, 0, 200),
    (MESSAGES, {}, 0, None),  # the engine gives it 4,096: the context's end here
]


@pytest.fixture
async def engine_port(running_service: ServiceFactory, tiny_model: Path) -> StudioService:
    """The product's port (output cap `CAP`) in front of the tiny model (random weights: it
    never stops by itself) under a supervised llama-server of one slot of 1,024 tokens."""
    service = await running_service(keepalive_interval=0.2, default_output_tokens=64,
                                    max_output_tokens=CAP)
    await service.load(LoadSettings(parallel="1", ctx_size=1024).to_spec(str(tiny_model)))
    return service


def request_for(route: str, limits: dict[str, Any]) -> dict[str, Any]:
    bases: dict[str, dict[str, Any]] = {
        CHAT: {"messages": [{"role": "user", "content": "Write a story."}]},
        COMPLETIONS: {"prompt": "Once upon a time"},
        RESPONSES: {"input": "Write a story."},
        MESSAGES: {"messages": [{"role": "user", "content": "Write a story."}]},
    }
    return {**bases[route], "ignore_eos": True, **limits}


def used_tokens(route: str, answer: dict[str, Any]) -> tuple[int, int]:
    """(prompt, generated) tokens, as the engine reports them."""
    usage = answer["usage"]
    if route in (CHAT, COMPLETIONS):
        return usage["prompt_tokens"], usage["completion_tokens"]
    # Anthropic's input_tokens leave out the prompt tokens read from the cache
    cached = usage.get("cache_read_input_tokens", 0) if route == MESSAGES else 0
    return usage["input_tokens"] + cached, usage["output_tokens"]


async def test_no_route_generates_more_than_the_port_reserved_whatever_limits_it_is_sent(
        engine_port):
    service = engine_port
    per_request = 1024  # one slot of the load's context
    # The engine itself holds a request that reaches it without a limit to the cap.
    serving = not_none(service.snapshot().serving)
    async with httpx.AsyncClient(base_url=serving.base_url, timeout=120, trust_env=False,
                                 headers=engine_headers(serving.api_key)) as engine:
        answer = await engine.post(COMPLETIONS, json={"prompt": "Once", "ignore_eos": True})
        assert answer.json()["usage"]["completion_tokens"] == CAP
    reserved: list[int] = []

    def note() -> None:
        if tokens := service.registry.total_reserved_tokens:
            reserved.append(tokens)

    service.registry.add_listener(note)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{service.gateway_port}",
                                 timeout=120, trust_env=False) as client:
        for route, limits, cap, expected in CONFLICTS:
            if cap != service.settings.max_output_tokens:
                await service.apply_settings(service.settings.replace(max_output_tokens=cap))
            reserved.clear()
            response = await client.post(route, json=request_for(route, limits))
            assert response.status_code == 200, (route, limits, response.text)
            await until(lambda: service.registry.total_active == 0)
            prompt, generated = used_tokens(route, response.json())
            case = (route, limits, cap, prompt, generated, reserved)
            # The reservation once settled (the smallest): the prompt and every token the
            # engine generated fit in it.
            assert reserved and prompt + generated <= min(reserved), case
            if expected is not None:
                assert generated == expected, case
            else:  # it went on to its context's end, far beyond the default budget
                assert generated > 64 and prompt + generated >= per_request - 1, case
