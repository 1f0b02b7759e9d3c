"""Fuzzing the port: generated methods, paths, headers and bodies against a running port.

The port fronts the fake upstream, not the real engine: 1,200 cases must run in well
under a minute on a shared 2-core machine, and a real llama-server spends tens of
milliseconds per accepted request generating tokens (and answers some odd bodies with
its own 500s, which would be the engine's behaviour, not the port's).  What is fuzzed
here is the port itself: routing, access checks, body reading and checking, admission,
relaying.  The examples are derandomized, so CI runs the same cases every time.

Every answer must be one the port documents (2xx or a 4xx with an OpenAI-style error
body; never a 500), and afterwards the port and the upstream still answer and nothing
is left running or waiting.
"""

from __future__ import annotations

import json
import time
from typing import Any, Iterator

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from backend.port.gateway import GATED_ROUTES, OPEN_ROUTES
from backend.app.service import BackendThread
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
