"""Fuzzing the port: generated methods, paths, headers and bodies against a running port.

Two targets.  The fake upstream: 1,200 cases in well under a minute, fuzzing the port
itself (routing, access checks, body reading and checking, admission, relaying).  The
real engine (the tiny model under a supervised llama-server, as the product loads it):
1,200 requests aimed at what the engine reads (messages, content, roles, tools, prompts,
inputs, stop, sampling fields, with values of every type, and the non-standard JSON that
Python's reader takes), because only the real engine shows which mistakes of a client it
answers with a 500.  The examples are derandomized (seeded), so CI runs the same cases
every time.

Every answer must be one the port documents (2xx or a 4xx with an OpenAI-style error
body; never a 5xx: the engine's 502/503 would mean its state changed, which the test
checks did not happen), and afterwards the port and the upstream still answer and
nothing is left running or waiting.
"""

from __future__ import annotations

import asyncio
import copy
import json
import time
from typing import Any, Iterator

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from backend.llama.api import engine_headers
from backend.port.gateway import GATED_ROUTES, OPEN_ROUTES
from backend.app.backend_thread import BackendThread
from tests.backend.gateway_harness import open_gateway
from tests.fake_upstream import FakeUpstream

CASES = 1200
#: The answers the port documents (README / backend.errors), for a port with no key.
DOCUMENTED = {200, 204, 400, 403, 404, 405, 408, 413, 415, 426, 429}
ROUTES = [*GATED_ROUTES, *OPEN_ROUTES, "/", "/v1", "/slots", "/props", "/v1/chat/completions/",
          "/v1/../health", "/%2e%2e/metrics"]
METHODS = ["POST", "GET", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]
FIELDS = ["model", "messages", "stream", "max_tokens", "max_completion_tokens",
          "max_output_tokens", "n_predict", "prompt", "input", "temperature", "tools",
          "stream_options", "role", "content"]

json_scalars = (st.none() | st.booleans() | st.integers(-2**63, 2**63)
                | st.floats(allow_nan=False) | st.text(max_size=40))
json_values = st.recursive(
    json_scalars,
    lambda inner: (st.lists(inner, max_size=4)
                   | st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=8), inner,
                                     max_size=4)),
    max_leaves=20)
messages = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant"]) | st.text(max_size=5),
     "content": st.text(max_size=60) | json_values}), max_size=4)
#: Plausible request objects: known fields with values of the right type or not.
objects = st.fixed_dictionaries(
    {}, optional={"model": st.text(max_size=20) | json_values,
                  "messages": messages | json_values,
                  "stream": st.booleans() | json_values,
                  "max_tokens": st.integers(-5, 100_000) | json_values,
                  "n_predict": st.integers(-3, 50) | json_values,
                  "prompt": st.text(max_size=60),
                  "input": st.text(max_size=60)})
bodies = (objects.map(lambda o: json.dumps(o).encode())
          | json_values.map(lambda v: json.dumps(v).encode())
          | st.binary(max_size=200)
          | st.text(max_size=200).map(str.encode))
header_names = st.text(alphabet="abcdefghijklmnopqrstuvwxyz-", min_size=1, max_size=16)
header_values = st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126),
                        max_size=40).map(str.strip)  # h11 refuses padded values itself
content_types = st.sampled_from(["application/json", "application/json; charset=utf-8",
                                 "text/plain", "application/x-www-form-urlencoded",
                                 "multipart/form-data", "APPLICATION/JSON", ""]) | header_values
origins = st.sampled_from(["http://localhost:3000", "http://127.0.0.1", "https://evil.example",
                           "null"]) | header_values
hosts = st.sampled_from(["127.0.0.1", "localhost", "evil.example", "127.0.0.1:1"])


@st.composite
def cases(draw: st.DrawFn) -> dict[str, Any]:
    route = draw(st.sampled_from(ROUTES))
    gated = route in GATED_ROUTES
    method = draw(st.sampled_from(["POST"]) if gated and draw(st.integers(0, 4))
                  else st.sampled_from(METHODS))
    headers = draw(st.dictionaries(header_names.filter(lambda n: n not in {
        "content-length", "transfer-encoding", "host", "connection", "expect", "upgrade"}),
        header_values, max_size=3))
    # Mostly past the access checks, so that most cases reach the body and admission.
    if gated and method == "POST" and draw(st.integers(0, 4)):
        headers["content-type"] = "application/json"
    elif draw(st.booleans()):
        headers["content-type"] = draw(content_types)
    if draw(st.integers(0, 9)) == 0:
        headers["origin"] = draw(origins)
    if draw(st.integers(0, 9)) == 0:
        headers["host"] = draw(hosts)
    body = draw(bodies) if method not in {"GET", "HEAD", "OPTIONS"} or draw(st.booleans()) else b""
    return {"method": method, "route": route, "headers": headers, "body": body}


@pytest.fixture(scope="module")
def port() -> Iterator[tuple[str, FakeUpstream, Any]]:
    """A port in front of the fake upstream, on a loop of its own (hypothesis drives
    plain synchronous calls)."""
    thread = BackendThread("fuzzed-port")
    fake = FakeUpstream(slots=2, n_tokens=3)

    async def open_all() -> Any:
        await fake.start()
        gateway = open_gateway(fake.base_url, fake.slots, queue_timeout=10.0)
        return gateway, await gateway.__aenter__()

    context, gw = thread.submit(open_all()).result(30)
    try:
        yield gw.url, fake, gw
    finally:
        async def close_all() -> None:
            await context.__aexit__(None, None, None)
            await fake.stop()
        thread.submit(close_all()).result(30)
        thread.stop()


def test_generated_requests_get_only_documented_answers_and_leave_the_port_healthy(port):
    url, fake, gw = port
    seen: dict[tuple[str, int], int] = {}
    started = time.perf_counter()
    with httpx.Client(base_url=url, timeout=20.0, trust_env=False) as client:

        @settings(max_examples=CASES, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(case=cases())
        def one(case: dict[str, Any]) -> None:
            response = client.request(case["method"], case["route"], headers=case["headers"],
                                      content=case["body"])
            status = response.status_code
            assert status in DOCUMENTED, (status, case, response.text[:300])
            if status >= 400 and case["method"] != "HEAD":
                error = response.json()["error"]
                assert isinstance(error["message"], str) and isinstance(error["code"], str)
                assert "Traceback" not in response.text and "127.0.0.1:" not in error["message"]
            seen[case["route"], status] = seen.get((case["route"], status), 0) + 1

        one()

        runs = sum(seen.values())
        print(f"\n{runs} generated requests in {time.perf_counter() - started:.1f} s; "
              f"answers by route and status: {sorted(seen.items())}")
        assert runs >= 1000
        assert {route for route, _ in seen} >= set(GATED_ROUTES) | set(OPEN_ROUTES)
        assert any(status == 200 and route in GATED_ROUTES for route, status in seen)
        # The port and the upstream are still up, and nothing is left behind.
        assert client.get("/health").status_code == 200
        assert client.post("/v1/chat/completions", json={"messages": []}).status_code == 200
        deadline = time.monotonic() + 5
        while gw.registry.total_active or gw.registry.total_waiting:
            assert time.monotonic() < deadline, gw.registry
            time.sleep(0.01)  # polling a condition with a deadline
    assert fake.active == 0


# --- against the real engine ------------------------------------------------------------------

#: Values of every JSON type, the wrong ones included, for the fields the engine reads.
anything: st.SearchStrategy[Any] = json_values | st.sampled_from([float("nan"), float("inf"), float("-inf"), 1e300,
                                          2**64, -1, 0, "", [], {}, None])
TOOL = {"type": "function", "function": {"name": "read", "description": "Read a file.",
                                         "parameters": {"type": "object", "properties": {
                                             "path": {"type": "string"}}}}}
#: Requests each route answers, in the shapes real clients send: the fuzz makes one to
#: three mistakes in one of them, so that most requests reach the engine's own reading.
VALID: dict[str, list[dict[str, Any]]] = {
    "/v1/chat/completions": [
        {"messages": [{"role": "user", "content": "hi"}]},
        {"messages": [{"role": "system", "content": "Be brief."},
                      {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
         "stream": True, "stop": ["\n"], "temperature": 0.5},
        {"messages": [{"role": "user", "content": "read a"},
                      {"role": "assistant", "content": None, "tool_calls": [
                          {"id": "c1", "type": "function",
                           "function": {"name": "read", "arguments": '{"path": "a"}'}}]},
                      {"role": "tool", "tool_call_id": "c1", "content": "text"}],
         "tools": [TOOL], "tool_choice": "auto"},
    ],
    # Sampling fields the engine reads and the port does not: mistakes in them reach it.
    "/v1/completions": [{"prompt": "Once upon"}, {"prompt": [1, 450, "time"], "stream": True},
                        {"prompt": "Once upon", "temperature": 0.7, "top_k": 40, "top_p": 0.9,
                         "min_p": 0.05, "stop": ["\n"], "n_probs": 2, "seed": 1,
                         "repeat_penalty": 1.1}],
    "/v1/embeddings": [{"input": "hello"}, {"input": ["a", "b"]},
                       {"input": "hello", "encoding_format": "float", "embd_normalize": 2,
                        "user": "fuzz", "dimensions": 64}],
    "/v1/responses": [
        {"input": "hi"},
        {"instructions": "Be brief.", "input": [
            {"type": "message", "role": "user",
             "content": [{"type": "input_text", "text": "hi"}]}],
         "tools": [{"type": "function", "name": "read", "parameters": {"type": "object"}}],
         "stream": True},
    ],
    "/v1/messages": [
        {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
        {"max_tokens": 4, "system": [{"type": "text", "text": "Be brief."}], "messages": [
            {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
         "tools": [{"name": "read", "input_schema": {"type": "object"}}], "stream": True},
    ],
}
ENGINE_FIELDS = ["model", "messages", "stream", "max_tokens", "temperature", "top_p",
                 "top_k", "seed", "stop", "tools", "tool_choice", "response_format",
                 "stream_options", "reasoning_format", "chat_template_kwargs", "prompt",
                 "input", "instructions", "system", "n_predict", "n_probs", "logit_bias",
                 "role", "content", "type", "text", "tool_calls", "function", "arguments",
                 "name", "parameters", "input_schema", "image_url", "tool_call_id"]


@st.composite
def engine_requests(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    """A valid request of a route with one to three mistakes: a value anywhere in it
    replaced by one of any type, a field dropped, or a known field added."""
    route = draw(st.sampled_from(list(VALID)))
    body = copy.deepcopy(draw(st.sampled_from(VALID[route])))
    for _ in range(draw(st.integers(1, 3))):
        parent: Any = body
        key: Any = None
        while True:  # walk down to a random place
            children = (list(parent) if isinstance(parent, dict)
                        else list(range(len(parent))) if isinstance(parent, list) else [])
            if not children or (key is not None and draw(st.booleans())):
                break
            key = draw(st.sampled_from(children))
            if not isinstance(parent[key], (dict, list)) or draw(st.integers(0, 2)) == 0:
                break
            parent = parent[key]
            key = None
        action = draw(st.integers(0, 4))
        if isinstance(parent, dict) and (key is None or action == 0):
            parent[draw(st.sampled_from(ENGINE_FIELDS))] = copy.deepcopy(draw(anything))
        elif isinstance(parent, dict) and action == 1:
            del parent[key]
        elif key is not None:
            parent[key] = copy.deepcopy(draw(anything))
    return route, body


def encoded(body: dict[str, Any]) -> bytes:
    """JSON as Python writes it: NaN and Infinity included, as some clients send them."""
    return json.dumps(body, allow_nan=True).encode()


@pytest.fixture(scope="module")
def real_port(llama_server_binary, tiny_model, tmp_path_factory) -> Iterator[tuple[str, Any]]:
    """The product's port in front of the tiny model under a supervised llama-server (the
    product's flags, its template, its key), on a loop of its own.  Answers are capped
    at a few tokens: the engine's reading of requests is the point, not its writing."""
    from backend.llama.load import LoadSettings
    from backend.app.service import StudioService
    from backend.settings import Settings

    thread = BackendThread("fuzzed-real-port")
    settings = Settings(port=0, llama_server=str(llama_server_binary), max_output_tokens=4,
                        load_timeout=60, queue_timeout=30, keepalive_interval=1.0)

    async def open_all() -> Any:
        service = StudioService(settings, log_dir=tmp_path_factory.mktemp("fuzz-logs"))
        await service.start_gateway()
        load = LoadSettings(parallel="2", ctx_size=8192,
                            extra_args=("--embeddings", "--pooling", "mean"))
        await service.load(load.to_spec(str(tiny_model)))
        return service

    service = thread.submit(open_all()).result(120)
    try:
        yield f"http://127.0.0.1:{service.gateway_port}", service
    finally:
        thread.submit(service.close()).result(60)
        thread.stop()


#: Of the generated cases of each route (about 240), at least this many must reach the
#: engine (be admitted and forwarded), or the fuzz only exercises the port's own checks.
#: Most mistakes land on a field the port checks itself; 20 to 65 per route reach it.
REACHED_AT_LEAST = 12


def test_requests_aimed_at_the_real_engine_never_get_a_5xx(real_port):
    url, service = real_port
    pid = service.snapshot().pid
    seen: dict[tuple[str, int], int] = {}
    reached: dict[str, int] = dict.fromkeys(VALID, 0)
    started = time.perf_counter()
    with httpx.Client(base_url=url, timeout=60.0, trust_env=False) as client:

        @settings(max_examples=CASES, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(request=engine_requests())
        def one(request: tuple[str, dict[str, Any]]) -> None:
            route, body = request
            admitted_before = _admitted(service)
            response = client.post(route, content=encoded(body),
                                   headers={"content-type": "application/json"})
            status = response.status_code
            assert status < 500, (status, route, body, response.text[:400])
            assert status in DOCUMENTED, (status, route, body, response.text[:300])
            if status >= 400:
                error = response.json()["error"]
                assert isinstance(error["message"], str) and isinstance(error["code"], str)
                assert "json.exception" not in error["message"], (route, body, error)
                assert "Traceback" not in response.text and "127.0.0.1:" not in error["message"]
            seen[route, status] = seen.get((route, status), 0) + 1
            reached[route] += _admitted(service) > admitted_before  # one request at a time

        one()

        runs = sum(seen.values())
        print(f"\n{runs} generated requests to the real engine in "
              f"{time.perf_counter() - started:.1f} s; answers by route and status: "
              f"{sorted(seen.items())}; reached the engine: {reached}")
        assert runs >= 1000
        assert any(status == 200 for _, status in seen)
        few = {route: n for route, n in reached.items() if n < REACHED_AT_LEAST}
        assert not few, f"too few cases reached the engine: {few} (of {reached})"
        snapshot = service.snapshot()
        assert snapshot.pid == pid, "the engine restarted during the fuzz"
        assert client.get("/health").status_code == 200
        answer = client.post("/v1/chat/completions",
                             json={"messages": [{"role": "user", "content": "hi"}]})
        assert answer.status_code == 200, answer.text


#: Requests sent at once per example, some of whose clients go away mid-way.
TOGETHER = 12


def test_requests_sent_together_with_clients_going_away_leave_the_real_engine_clean(real_port):
    """Generated requests, many at once on 2 slots, each client going away (or not) at a
    drawn moment: before admission, while waiting, while the engine generates.  Every
    answer is still a documented one, nothing stays running or waiting at the port or on
    the engine, and the engine never restarted."""
    url, service = real_port
    pid = service.snapshot().pid
    statuses: list[int] = []
    gone = [0]

    async def send_together(requests: list[tuple[str, dict[str, Any]]],
                            cuts: list[float | None]) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=60.0, trust_env=False) as client:
            async def send(route: str, body: dict[str, Any], cut: float | None) -> None:
                call = asyncio.ensure_future(client.post(
                    route, content=encoded(body), headers={"content-type": "application/json"}))
                if cut is not None:
                    # The client's own moment to leave (not a wait for something).
                    done, _ = await asyncio.wait({call}, timeout=cut)
                    if not done:
                        call.cancel()
                        gone[0] += 1
                        await asyncio.gather(call, return_exceptions=True)
                        return
                response = await call
                statuses.append(response.status_code)
                assert response.status_code in DOCUMENTED, (response.status_code, route, body,
                                                            response.text[:300])

            await asyncio.gather(*(send(route, body, cut)
                                   for (route, body), cut in zip(requests, cuts)))
        await _until(lambda: not (service.registry.total_active or service.registry.total_waiting))

    @settings(max_examples=8, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(requests=st.lists(engine_requests(), min_size=TOGETHER, max_size=TOGETHER),
           cuts=st.lists(st.none() | st.floats(0.0, 1.5), min_size=TOGETHER, max_size=TOGETHER))
    def together(requests: list[tuple[str, dict[str, Any]]], cuts: list[float | None]) -> None:
        asyncio.run(send_together(requests, cuts))

    async def leave_while_running() -> None:
        """Clients that go away while the engine generates their answers: the drawn
        moments above may all fall before admission or after the answer when this
        machine is quick or slow."""
        cancelled = service.metrics.value("gguf_studio_cancellations_total")
        async with httpx.AsyncClient(base_url=url, timeout=60.0, trust_env=False) as client:
            calls = [asyncio.ensure_future(client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": f"Count to {n} thousand."}],
                "max_tokens": 256})) for n in range(TOGETHER)]
            await _until(lambda: service.registry.total_active >= 2)
            running = [call for call in calls if not call.done()]
            for call in running:
                call.cancel()
            await asyncio.gather(*calls, return_exceptions=True)
        await _until(lambda: not (service.registry.total_active or service.registry.total_waiting))
        # The port saw them go: the two admitted ones at least.
        left = service.metrics.value("gguf_studio_cancellations_total") - cancelled
        assert len(running) >= 2 and left >= 2, (len(running), left)

    capped = service.settings
    # Answers long enough that a client leaves while its request waits or runs; and no
    # grace for a resend (tests/backend/port/test_resends.py): a client gone before its
    # answer began is cut at once, as a client gone for good is once the grace ends.
    service.settings = capped.replace(max_output_tokens=256, resend_grace=0.0)
    try:
        together()
        asyncio.run(leave_while_running())
    finally:
        service.settings = capped
    assert gone[0] >= 1 and 200 in statuses, (gone, statuses)
    assert service.metrics.value("gguf_studio_cancellations_total") >= 1
    assert service.snapshot().pid == pid, "the engine restarted"
    serving = service.snapshot().serving
    assert serving is not None
    with httpx.Client(headers=engine_headers(serving.api_key), timeout=60.0) as engine:
        deadline = time.monotonic() + 30
        while any(slot.get("is_processing") for slot in engine.get(f"{serving.base_url}/slots").json()):
            assert time.monotonic() < deadline, "the engine still generates for clients gone"
            time.sleep(0.05)  # polling a condition with a deadline
    with httpx.Client(base_url=url, timeout=60.0, trust_env=False) as client:
        answer = client.post("/v1/chat/completions",
                             json={"messages": [{"role": "user", "content": "hi"}]})
        assert answer.status_code == 200, answer.text


def _admitted(service: Any) -> float:
    """Requests admitted to an engine so far (each one observes its wait once)."""
    return service.metrics.value("gguf_studio_queue_wait_seconds_count")


async def _until(condition: Any, timeout: float = 30.0) -> None:
    async def poll() -> None:
        while not condition():
            await asyncio.sleep(0.02)
    await asyncio.wait_for(poll(), timeout)
