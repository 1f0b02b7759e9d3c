"""Counting prompt tokens before admission, against the real llama-server and tiny model.

Every count is compared with what the engine itself reports as the prompt of a real
request (`usage` of a one-token completion): the same template, tokenizer and special
tokens, or the admission's arithmetic would be wrong.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from backend.llama.kv_capacity import KvCapacity
from backend.llama.load import Serving
from backend.admission.engine_queue import AdmissionQueue
from backend.errors import ContextLengthExceeded
from backend.admission.need_planner import NeedPlanner
from backend.admission.prompt_tokens import (
    DEFAULT_OUTPUT_TOKENS,
    MIN_OUTPUT_TOKENS,
    TEXT_SLACK,
    PromptCount,
    PromptCounter,
    output_budget,
    token_need,
)
from backend.admission.prompt_bytes import IMAGE_TOKENS, prompt_size
from backend.admission.prompt import prompt_blocks, text_after
from backend.admission.continued_turn import Continued
from backend.port.tokenizer_client import HttpEngineTokenizer
from backend.llama.supervisor import pick_free_port

CHAT, COMPLETIONS, RESPONSES, MESSAGES, EMBEDDINGS = (
    "/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages",
    "/v1/embeddings")

TOOL: dict[str, Any] = {"type": "function", "function": {
    "name": "read_file", "description": "Read a file of the project and return its text.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                   "required": ["path"]}}}
ENGINE_KEY = "engine-only-key"
LONG_SYSTEM = "You are a careful coding agent. " * 40


#: A template that renders tools and tool calls as JSON indented by 4 (as Llama 3.1's and
#: Granite's do), with tool-use instructions: the tiny model's own ignores tools.
TOOLS_TEMPLATE = (
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\nYou can call these tools. To call one, answer with "
    "<tool_call>{\"name\": NAME, \"arguments\": ARGS}</tool_call>.\\n\\n' -}}"
    "{%- for tool in tools -%}{{- tool | tojson(indent=4) + '\\n\\n' -}}{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message.tool_calls -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- for call in message.tool_calls -%}"
    "{{- '<tool_call>' + (call.function | tojson(indent=4)) + '</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


@contextlib.contextmanager
def running_engine(binary: Path, model: Path, folder: Path, *extra: str) -> Iterator[str]:
    """A real llama-server started with the product's flags that matter for counting
    (--jinja renders the chat template, and a key that the tokenizer must send, as GGUF
    Studio's engines require); its URL."""
    port = pick_free_port()
    (folder / "key").write_text(ENGINE_KEY + "\n")
    log = (folder / "llama-server.log").open("wb")
    child = subprocess.Popen(
        [str(binary), "-m", str(model), "--host", "127.0.0.1",
         "--port", str(port), "-np", "2", "-c", "8192", "--jinja", "--no-webui",
         "--embeddings", "--pooling", "mean", "-t", "1",
         "--api-key-file", str(folder / "key"), *extra], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert child.poll() is None, "llama-server exited during load"
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "llama-server did not become healthy"
            time.sleep(0.05)  # polling a real condition, with a deadline
        yield url
    finally:
        child.terminate()
        child.wait(10)
        log.close()


@pytest.fixture(scope="module")
def engine_url(llama_server_binary: Path, tiny_model: Path,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One real llama-server for the module, with the tiny model's own template."""
    with running_engine(llama_server_binary, tiny_model, tmp_path_factory.mktemp("engine")) as url:
        yield url


@pytest.fixture(scope="module")
def tools_engine_url(llama_server_binary: Path, tiny_model: Path,
                     tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The same, with a template that renders tools (`TOOLS_TEMPLATE`)."""
    folder = tmp_path_factory.mktemp("tools-engine")
    (folder / "tools.jinja").write_text(TOOLS_TEMPLATE)
    with running_engine(llama_server_binary, tiny_model, folder,
                        "--chat-template-file", str(folder / "tools.jinja")) as url:
        yield url


@pytest.fixture
async def counter(engine_url: str) -> AsyncIterator[PromptCounter]:
    tokenizer = HttpEngineTokenizer(engine_url, api_key=ENGINE_KEY)
    yield PromptCounter(tokenizer)
    await tokenizer.aclose()


@pytest.fixture
async def tools_counter(tools_engine_url: str) -> AsyncIterator[PromptCounter]:
    tokenizer = HttpEngineTokenizer(tools_engine_url, api_key=ENGINE_KEY)
    yield PromptCounter(tokenizer)
    await tokenizer.aclose()


@pytest.fixture
def dead_url() -> Iterator[str]:
    """An address where nothing listens: bound, so no one else takes it, never listening."""
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{closed.getsockname()[1]}"


async def engine_prompt_tokens(engine_url: str, route: str, body: dict) -> int:
    """The prompt size llama-server reports for a real one-token request of `body`."""
    body = dict(body, stream=False)
    if route == RESPONSES:
        body["max_output_tokens"] = 1
    elif route != EMBEDDINGS:
        body["max_tokens"] = 1
    async with httpx.AsyncClient(timeout=60, headers={"authorization": f"Bearer {ENGINE_KEY}"}) as client:
        response = await client.post(engine_url + route, json=body)
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    if route == MESSAGES:  # Anthropic splits off what came from the prompt cache
        return (usage["input_tokens"] + usage.get("cache_read_input_tokens", 0)
                + usage.get("cache_creation_input_tokens", 0))
    return usage.get("prompt_tokens", usage.get("input_tokens"))


async def counted(counter: PromptCounter, route: str, body: dict,
                  fits_below: int = 0) -> PromptCount:
    return await counter.count(route, body, len(json.dumps(body).encode()),
                               fits_below=fits_below)


CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "chat with system prompt and tools": (CHAT, {
        "messages": [{"role": "system", "content": LONG_SYSTEM},
                     {"role": "user", "content": "Open README.md and summarise it."}],
        "tools": [TOOL]}),
    "chat with a tool call and its result": (CHAT, {
        "messages": [
            {"role": "user", "content": "What is in a.txt?"},
            {"role": "assistant", "content": "", "tool_calls": [{
                "id": "call_1", "type": "function",
                "function": {"name": "read_file", "arguments": "{\"path\":\"a.txt\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "hello from a"}],
        "tools": [TOOL]}),
    "completions prompt string": (COMPLETIONS, {"prompt": "def fib(n):\n    return"}),
    "completions token array": (COMPLETIONS, {"prompt": [1, 450, 4996, 17354, 1701]}),
    "responses with instructions, items and tools": (RESPONSES, {
        "instructions": LONG_SYSTEM,
        "input": [{"type": "message", "role": "user",
                   "content": [{"type": "input_text", "text": "List the files."}]}],
        "tools": [{"type": "function", "name": "read_file",
                   "description": "Read a file.", "parameters": TOOL["function"]["parameters"]}]}),
    "responses with a plain input string": (RESPONSES, {"input": "Say hello."}),
    "messages with system, blocks and tools": (MESSAGES, {
        "system": LONG_SYSTEM,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Fix the bug."}]}],
        "tools": [{"name": "read_file", "description": "Read a file.",
                   "input_schema": TOOL["function"]["parameters"]}]}),
    "embeddings input": (EMBEDDINGS, {"input": "the quick brown fox"}),
}


@pytest.mark.parametrize("case", CASES)
async def test_count_matches_the_prompt_tokens_the_engine_reports(counter, engine_url, case):
    route, body = CASES[case]
    count = await counted(counter, route, body)
    assert count.how in ("engine", "exact")
    assert count.tokens == await engine_prompt_tokens(engine_url, route, body)


async def test_short_request_is_bounded_by_its_bytes_without_asking_the_engine(
        counter, engine_url):
    body = {"messages": [{"role": "user", "content": "Hi!"}]}
    first = await counted(counter, CHAT, body, fits_below=4096)  # measures the template
    real = await engine_prompt_tokens(engine_url, CHAT, body)
    asks = []
    original = counter.tokenizer.count_input_tokens

    async def spy(route, body):
        asks.append(route)
        return await original(route, body)
    counter.tokenizer.count_input_tokens = spy

    again = await counted(counter, CHAT, body, fits_below=4096)

    assert first.how == again.how == "bound" and asks == []
    assert real <= again.tokens <= real + len(json.dumps(body)) + 2 * TEXT_SLACK
    assert counter.template_base is not None


SHORT_BODIES: list[tuple[str, dict[str, Any]]] = [
    (CHAT, {"messages": [{"role": "user", "content": "x"}] * 40}),  # many tiny messages
    (CHAT, {"messages": [{"role": "system", "content": "Réponds en français, s'il te plaît."},
                         {"role": "user", "content": "Привет, как дела? 你好 🙂"}]}),
    (RESPONSES, {"input": [{"role": "user", "content": "a"},
                           {"type": "message", "role": "assistant",
                            "content": [{"type": "output_text", "text": "b"}]}] * 10}),
    (MESSAGES, {"system": "Be brief.", "messages": [{"role": "user", "content": "?"}] * 20}),
    (COMPLETIONS, {"prompt": "   \n\n\t  spaces    and\ttabs  \n" * 5}),
    (CHAT, {"messages": CASES["chat with a tool call and its result"][1]["messages"] * 3}),
    # tools (agents send them with every request), and tool calls whose arguments a
    # template may re-indent
    (CHAT, CASES["chat with system prompt and tools"][1]),
    (CHAT, CASES["chat with a tool call and its result"][1]),
    (CHAT, {"messages": [{"role": "user", "content": "x"}], "tools": [
        {"type": "function", "function": {
            "name": f"tool_{i}", "description": "Tröpfchen, 水, 🙂 " * 3,
            "parameters": {"type": "object", "properties": {
                "deep": {"type": "object", "properties": {"a": {"type": "object", "properties": {
                    "b": {"type": "array", "items": {"type": "string", "enum": ["x", "y"]}}}}}},
                "n": {"type": "integer", "minimum": 0}}}}} for i in range(8)]}),
    (CHAT, {"messages": [{"role": "user", "content": "go"}, {
        "role": "assistant", "content": None, "tool_calls": [{
            "id": "c1", "type": "function", "function": {
                "name": "read_file", "arguments": json.dumps({"a": {"b": {"c": [1, 2, {"d": 3}]}}})}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}], "tools": [TOOL]}),
    (RESPONSES, CASES["responses with instructions, items and tools"][1]),
    (MESSAGES, CASES["messages with system, blocks and tools"][1]),
    (MESSAGES, {"messages": [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "read_file",
                                           "input": {"path": {"deep": ["a", {"b": 1}]}}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                      "content": "done"}]}],
        "tools": CASES["messages with system, blocks and tools"][1]["tools"]}),
]


@pytest.mark.parametrize("index", range(len(SHORT_BODIES)))
async def test_the_byte_bound_is_never_below_the_engines_count(counter, engine_url, index):
    route, body = SHORT_BODIES[index]
    bound = await counted(counter, route, body, fits_below=1 << 20)
    assert bound.how == "bound"
    assert bound.tokens >= await engine_prompt_tokens(engine_url, route, body)


@pytest.mark.parametrize("index", range(len(SHORT_BODIES) + 1))
async def test_a_bound_from_the_size_read_by_the_planner_is_the_counters_own(counter, index):
    """The request planner reads a body's `prompt_size` once and hands it on: the bound
    is the one the counter reads for itself (None with an image)."""
    route, body = (SHORT_BODIES + [(CHAT, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]})])[index]
    body_bytes = len(json.dumps(body).encode())
    own = await counter.bound(route, body, body_bytes)
    assert await counter.bound(route, body, body_bytes,
                               size=prompt_size(body, body_bytes)) == own
    assert (own is None) == (index == len(SHORT_BODIES))


TOOL_BODIES = [(route, body) for route, body in SHORT_BODIES
               if body.get("tools") and route == CHAT]


@pytest.mark.parametrize("index", range(len(TOOL_BODIES)))
async def test_the_byte_bound_of_tools_holds_where_the_template_renders_them(
        tools_counter, tools_engine_url, index):
    """Tools and tool calls rendered as JSON indented by 4, with instructions: the bound
    (with the tools' costs measured on this engine) still holds."""
    route, body = TOOL_BODIES[index]
    bound = await counted(tools_counter, route, body, fits_below=1 << 20)
    assert bound.how == "bound"
    real = await engine_prompt_tokens(tools_engine_url, route, body)
    print(f"\n{len(body['tools'])} tools: bound {bound.tokens}, engine {real}, "
          f"{tools_counter.tool_costs}")
    assert bound.tokens >= real
    assert tools_counter.tool_costs is not None and tools_counter.tool_costs.fixed > 0


async def test_what_tools_cost_is_measured_once_and_shared(tools_counter):
    counter = tools_counter
    body = TOOL_BODIES[0][1]
    asks = []
    original = counter.tokenizer.count_input_tokens

    async def spy(route, body):
        asks.append(route)
        return await original(route, body)
    counter.tokenizer.count_input_tokens = spy
    first = await asyncio.gather(*(counted(counter, CHAT, body, fits_below=1 << 20)
                                   for _ in range(5)))
    assert {count.how for count in first} == {"bound"}
    assert len(asks) == 4  # the template's base, then no tool, one and two probe tools
    await counted(counter, CHAT, body, fits_below=1 << 20)
    assert len(asks) == 4
    costs = counter.tool_costs
    assert costs is not None and costs.fixed > 0 and costs.per_tool > 0


async def test_a_request_above_the_bound_threshold_is_counted_by_the_engine(counter):
    body = {"messages": [{"role": "user", "content": "word " * 300}]}
    count = await counted(counter, CHAT, body, fits_below=100)
    assert count.how == "engine"


async def test_an_engine_without_the_counting_route_is_asked_for_template_and_tokens(
        engine_url):
    class OlderEngine(HttpEngineTokenizer):
        """A real engine whose counting route does not exist (404), as on older builds."""

        async def count_input_tokens(self, route, body):
            return len(await self._post("/v1/no-such-route", body))

    tokenizer = OlderEngine(engine_url, api_key=ENGINE_KEY)
    route, body = CASES["chat with system prompt and tools"]
    try:
        count = await counted(PromptCounter(tokenizer), route, body)
    finally:
        await tokenizer.aclose()
    assert count.how == "engine"
    assert count.tokens == await engine_prompt_tokens(engine_url, route, body)


async def test_unreachable_engine_falls_back_to_a_conservative_estimate_logged_once(
        engine_url, dead_url, caplog):
    tokenizer = HttpEngineTokenizer(dead_url)
    counter = PromptCounter(tokenizer)
    caplog.set_level(logging.WARNING, "backend.admission.prompt_tokens")
    estimates = {}
    for case in ("chat with system prompt and tools", "responses with instructions, "
                 "items and tools", "messages with system, blocks and tools",
                 "completions prompt string"):
        route, body = CASES[case]
        estimates[case] = (await counted(counter, route, body), route, body)
    await tokenizer.aclose()

    for case, (estimate, route, body) in estimates.items():
        assert estimate.how == "estimate", case
        assert estimate.tokens >= await engine_prompt_tokens(engine_url, route, body), case
    warnings = [r for r in caplog.records if "could not count" in r.getMessage()]
    assert len(warnings) == 1


async def test_an_engine_that_does_not_answer_in_time_falls_back(engine_url):
    accepted: list[asyncio.StreamWriter] = []

    async def silent(reader, writer):  # accepts, reads, never answers
        accepted.append(writer)

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    tokenizer = HttpEngineTokenizer(f"http://127.0.0.1:{port}")
    counter = PromptCounter(tokenizer, timeout=0.2)
    route, body = CASES["chat with system prompt and tools"]
    try:
        started = time.monotonic()
        estimate = await counted(counter, route, body)
        short = await counted(counter, CHAT, {"messages": [{"role": "user", "content": "hi"}]},
                              fits_below=4096)  # the template probe times out too
        elapsed = time.monotonic() - started
    finally:
        await tokenizer.aclose()
        for writer in accepted:
            writer.close()
        server.close()
        await server.wait_closed()
    assert estimate.how == short.how == "estimate"
    assert elapsed < 3  # two timeouts of 0.2 s, never the default 10 s
    assert estimate.tokens >= await engine_prompt_tokens(engine_url, route, body)


async def test_images_are_estimated_at_image_tokens_each_not_by_their_bytes(dead_url):
    tokenizer = HttpEngineTokenizer(dead_url)
    counter = PromptCounter(tokenizer, timeout=2)
    picture = "data:image/png;base64," + "A" * 200_000
    body = {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": picture}}]}]}
    try:
        estimate = await counted(counter, CHAT, body)
    finally:
        await tokenizer.aclose()
    assert estimate.how == "estimate"
    assert IMAGE_TOKENS <= estimate.tokens < IMAGE_TOKENS + 2_000


# --- output budget --------------------------------------------------------------------


@pytest.mark.parametrize("route, body, expected", [
    (CHAT, {"max_tokens": 300}, 300),
    (CHAT, {"max_completion_tokens": 500}, 500),
    (RESPONSES, {"max_output_tokens": 700}, 700),
    (COMPLETIONS, {"n_predict": 900}, 900),
    (COMPLETIONS, {"n_predict": -1}, DEFAULT_OUTPUT_TOKENS),
    (RESPONSES, {}, DEFAULT_OUTPUT_TOKENS),  # Codex sends no limit
    (EMBEDDINGS, {"max_tokens": 50}, 0),
])
def test_output_budget_is_the_requests_own_limit_or_the_default(route, body, expected):
    assert output_budget(route, body, prompt_tokens=100, limit=32_768) == expected


@pytest.mark.parametrize("route, body, expected", [
    # llama-server obeys the first limit it reads, not the smallest
    (CHAT, {"max_tokens": 1, "n_predict": 400}, 400),
    (CHAT, {"max_tokens": 1, "max_completion_tokens": 400}, 400),
    (COMPLETIONS, {"max_tokens": 900, "n_predict": 40}, 40),
    (RESPONSES, {"max_output_tokens": 16, "n_predict": 400}, 400),
    (RESPONSES, {"max_output_tokens": 16, "max_completion_tokens": 400}, 400),
    (RESPONSES, {"max_tokens": 400}, 400),  # its chat form reads it
    (RESPONSES, {"max_tokens": 400, "max_output_tokens": None}, DEFAULT_OUTPUT_TOKENS),
    (MESSAGES, {"max_tokens": 300, "n_predict": 40}, 300),  # n_predict never reaches it
    (MESSAGES, {}, 4096),  # what the engine's Anthropic conversion gives
    (CHAT, {"max_tokens": 300, "n_predict": -1}, DEFAULT_OUTPUT_TOKENS),  # no limit
])
def test_output_budget_is_the_limit_the_engine_obeys(route, body, expected):
    assert output_budget(route, body, prompt_tokens=100, limit=32_768) == expected


def test_output_budget_is_capped_by_the_operator_and_by_the_room_left():
    assert output_budget(CHAT, {"max_tokens": 9_000}, prompt_tokens=10, limit=32_768,
                         cap=2_000) == 2_000
    assert output_budget(CHAT, {}, prompt_tokens=10, limit=32_768, cap=1_000,
                         default=8_192) == 1_000
    assert output_budget(CHAT, {"max_tokens": 9_000}, prompt_tokens=30_000,
                         limit=32_768) == 2_768
    assert output_budget(CHAT, {}, prompt_tokens=32_760, limit=32_768) == MIN_OUTPUT_TOKENS
    # with a cap, "-1" (the engine's default, which is the cap) and 50,000 are the cap
    for n_predict in (-1, 50_000):
        assert output_budget(CHAT, {"max_tokens": 1, "n_predict": n_predict}, prompt_tokens=10,
                             limit=32_768, cap=1_000) == 1_000


def test_a_prompt_that_leaves_no_room_for_a_reply_is_refused_by_admission():
    queue = AdmissionQueue(Serving("http://127.0.0.1:1", 4, kv=KvCapacity.shared(32_768)))
    fits = token_need(CHAT, {}, PromptCount(31_000, "engine"), limit=32_768)
    too_long = token_need(CHAT, {}, PromptCount(32_760, "engine"), limit=32_768)

    assert fits.total == 32_768 and queue.request(need=fits).admitted
    with pytest.raises(ContextLengthExceeded) as refused:
        queue.request(need=too_long)
    assert "32,760 prompt tokens" in str(refused.value)


async def test_four_short_requests_fit_a_unified_cache_on_four_slots_without_counting(
        counter, engine_url):
    kv = KvCapacity.shared(16_384)
    queue = AdmissionQueue(Serving(engine_url, 4, kv=kv))
    body = {"messages": [{"role": "system", "content": "You are a coding agent."},
                         {"role": "user", "content": "Rename foo to bar in main.py."}]}
    real = await engine_prompt_tokens(engine_url, CHAT, body)

    planner = NeedPlanner(Serving(engine_url, 4, kv=kv), counter)
    needs = [await planner.request_need(CHAT, body, len(json.dumps(body))) for _ in range(4)]

    assert all(need.prompt > real and need.output == DEFAULT_OUTPUT_TOKENS
               for need in needs)  # the byte bound: more than the exact count
    assert counter.template_base is not None  # bounded, not counted: the template probe
    assert all(queue.request(need=need).admitted for need in needs)


async def test_a_long_request_is_counted_exactly_and_its_budget_fits_the_room(
        counter, engine_url):
    kv = KvCapacity.shared(8_192)
    body = {"messages": [{"role": "user", "content": "lorem ipsum dolor " * 600}]}
    real = await engine_prompt_tokens(engine_url, CHAT, body)

    planner = NeedPlanner(Serving(engine_url, 2, kv=kv), counter)
    need = await planner.request_need(CHAT, body, len(json.dumps(body)))

    assert need.prompt == real
    assert need.total == min(8_192, real + DEFAULT_OUTPUT_TOKENS)


# --- a turn that continues an earlier one ------------------------------------------------------

class RecordingTokenizer(HttpEngineTokenizer):
    """The real engine's tokenizer, noting what it was asked."""

    def __init__(self, url: str) -> None:
        super().__init__(url, api_key=ENGINE_KEY)
        self.asked: list[str] = []

    async def count_input_tokens(self, route: str, body: Any) -> int:
        self.asked.append("count_input_tokens")
        return await super().count_input_tokens(route, body)

    async def tokenize(self, text: str) -> int:
        self.asked.append("tokenize")
        return await super().tokenize(text)


async def test_a_long_continued_turn_is_planned_from_its_addition_alone_near_its_count(
        engine_url):
    """An agent's next turn (a 2,000-token conversation, 330 new words): the engine
    tokenizes the added text only, never the whole conversation, and the plan holds
    within 200 tokens of the engine's own count, without a count later.  The byte bound
    of the addition alone would hold about a thousand tokens more."""
    common = ("the file line code test value read write change open close path name "
              "error return list string number call function module class import").split()
    words = [common[(i * 7) % len(common)] for i in range(1100)]
    head = [{"role": "system", "content": " ".join(words)},
            {"role": "user", "content": " ".join(words[:330])},
            {"role": "assistant", "content": "Done: the file is read."}]
    body = {"messages": [*head, {"role": "user", "content": " ".join(words[400:730])}]}
    earlier = {"messages": head[:2]}
    real = await engine_prompt_tokens(engine_url, CHAT, body)

    def size(of: dict[str, Any]) -> int:
        found = prompt_size(of, len(json.dumps(of).encode()))
        assert found is not None
        return found

    blocks = prompt_blocks(earlier, size(earlier))
    continued = Continued(await engine_prompt_tokens(engine_url, CHAT, earlier),
                          size(body) - size(earlier), text_after(body, blocks.chars))
    tokenizer = RecordingTokenizer(engine_url)
    planner = NeedPlanner(Serving(engine_url, 2, kv=KvCapacity.shared(16_384)),
                          PromptCounter(tokenizer))
    await planner.bound_need(CHAT, body, len(json.dumps(body)))  # the template, once a load
    tokenizer.asked.clear()
    plan = await planner.plan(CHAT, body, len(json.dumps(body)), continued=continued)
    await tokenizer.aclose()

    assert tokenizer.asked == ["tokenize"]
    assert plan.need is not None and not plan.settle_later
    assert real <= plan.need.prompt <= real + 200
    assert continued.bound() - real > 1000


async def test_a_continued_turn_keeps_its_byte_bound_when_the_engine_cannot_tokenize(
        dead_url):
    continued = Continued(3000, 4000, "w1x " * 800)
    tokenizer = HttpEngineTokenizer(dead_url)
    counted = await continued.count(PromptCounter(tokenizer))
    await tokenizer.aclose()
    assert counted == PromptCount(continued.bound(), "bound")


def _turns_before(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The earlier turns of a conversation: its messages up to each one a client sends a
    turn after (a user's message or a tool's result, not an assistant's)."""
    field = "messages" if "messages" in body else "input"
    messages = body.get(field)
    if not isinstance(messages, list):
        return []
    return [{**body, field: messages[:k]} for k in range(1, len(messages))
            if not (isinstance(messages[k - 1], dict) and messages[k - 1].get("role") == "assistant")]


CONVERSATIONS = [(route, body) for route, body in [*SHORT_BODIES, *CASES.values()]
                 if route != COMPLETIONS and _turns_before(body)]


@pytest.mark.parametrize("index", range(len(CONVERSATIONS)))
async def test_a_continued_turns_bound_is_never_below_the_engines_count(
        engine_url, tools_engine_url, index):
    """The bound a turn gets from the one it continues (that turn's tokens as the engine
    counted them, plus the bytes added), and its count from the engine's tokens of the
    added text alone, on the tiny model's template and on one that renders tools and
    re-indents tool calls."""
    route, body = CONVERSATIONS[index]
    urls = [engine_url, tools_engine_url] if route == CHAT else [engine_url]

    def size(of: dict[str, Any]) -> int:
        found = prompt_size(of, len(json.dumps(of).encode()))
        assert found is not None
        return found

    for url in urls:
        later = await engine_prompt_tokens(url, route, body)
        tokenizer = HttpEngineTokenizer(url, api_key=ENGINE_KEY)
        for earlier in _turns_before(body):
            blocks = prompt_blocks(earlier, size(earlier))
            assert prompt_blocks(body, size(body)).continues(blocks)
            prior = await engine_prompt_tokens(url, route, earlier)
            added = text_after(body, blocks.chars)
            continued = Continued(prior, size(body) - size(earlier), added)
            assert continued.bound() >= later
            assert continued.counted(await tokenizer.tokenize(added)) >= later
        await tokenizer.aclose()
