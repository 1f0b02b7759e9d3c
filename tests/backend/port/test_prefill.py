"""While the engine reads a long prompt, every wire's client keeps getting the port's
keep-alives, which say how far the prompt is read, and never the engine's own progress
events: the real llama-server with SmolLM2 (a prompt of 1,000 tokens is seconds of
work on one thread here), its batch made small so the prompt is read in several steps,
each one a progress event, and asked to ping every second of silence: its pings (SSE
comments, which Codex does not count) no longer end the port's keep-alives."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest

from backend.app.service import StudioService
from backend.llama.load import LoadSettings
from backend.port.prefill import PrefillProgress, progress_of
from tests.backend.service_harness import ServiceFactory, long_text

CONTEXT = 4096
PROMPT_TOKENS = 1000
KEEPALIVE = 0.2
PING = 1  # seconds of silence before llama-server pings (its request field, whole seconds)


@pytest.fixture
async def service(running_service: ServiceFactory, smollm2_model) -> StudioService:
    # One thread and steps of 256 tokens: the prompt takes seconds, in 4 steps, each
    # longer than the engine's ping interval (PING).
    service = await running_service(keepalive_interval=KEEPALIVE, stall_budget_ms=0)
    await service.load(LoadSettings(parallel="1", ctx_size=CONTEXT, threads=1,
                                    extra_args=("-b", "256", "-ub", "64"))
                       .to_spec(str(smollm2_model), model_id="tiny"))
    return service


async def streamed(service: StudioService, path: str, body: dict[str, Any]
                   ) -> list[tuple[float, str]]:
    """Every line of the answer's stream with its arrival time, from the request's start."""
    lines: list[tuple[float, str]] = []
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{service.gateway_port}",
                                 timeout=300) as client:
        started = time.monotonic()
        async with client.stream("POST", path, json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line:
                    lines.append((time.monotonic() - started, line))
    return lines


def body_for(path: str, text: str) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "tiny", "stream": True, "sse_ping_interval": PING}
    if path == "/v1/responses":
        return {**body, "input": text, "max_output_tokens": 4}
    if path == "/v1/completions":
        return {**body, "prompt": text, "max_tokens": 4}
    return {**body, "max_tokens": 4, "messages": [{"role": "user", "content": text}]}


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/responses"])
async def test_keep_alives_say_how_far_a_long_prompt_is_read_and_no_progress_event_is_relayed(
        service: StudioService, path: str) -> None:
    snapshot = service.snapshot()
    text = await long_text(snapshot, PROMPT_TOKENS, {"/v1/chat/completions": 3,
                                                     "/v1/completions": 5}.get(path, 7))
    lines = await streamed(service, path, body_for(path, text))
    content = [i for i, (_, line) in enumerate(lines)
               if line.startswith("data:") and "prompt_progress" not in line
               and '"response.created"' not in line and '"response.in_progress"' not in line]
    first = content[0]
    before = lines[:first]
    assert not any("prompt_progress" in line for _, line in lines), "progress reached the client"
    notes = [line for _, line in before if line.startswith(": keep-alive; prefill ")]
    # The prompt is read in steps over seconds: the keep-alives said so, the count
    # growing, the whole the same, with an ETA once a step was timed.
    assert len(notes) >= 3, before
    counts = [tuple(map(int, note.split()[3].split("/"))) for note in notes]
    assert [done for done, _ in counts] == sorted(done for done, _ in counts)
    assert counts[-1][0] > counts[0][0] and len({whole for _, whole in counts}) == 1
    assert all(", ETA " in note for note in notes[len(notes) // 2:])
    # No silence of the port's reached twice its interval until the answer came.
    times = [at for at, _ in before] + [lines[first][0]]
    assert max(b - a for a, b in zip(times, times[1:])) < 2 * KEEPALIVE + 0.5
    if path == "/v1/responses":
        events = [json.loads(line[5:]) for _, line in lines if line.startswith("data:")]
        assert [e["type"] for e in events].count("response.created") == 1
        ids = {e["response"]["id"] for e in events if "response" in e}
        assert len(ids) == 1, ids
        assert events[-1]["type"] == "response.completed"
    else:
        assert lines[-1][1] == "data: [DONE]"


async def test_the_messages_wire_hears_a_comment_every_interval_while_a_long_prompt_is_read(
        service: StudioService) -> None:
    # llama-server's Anthropic events carry no progress: Claude Code, which counts any
    # bytes (bench/README.md, watchdogs), hears the port's comments until the answer.
    text = await long_text(service.snapshot(), PROMPT_TOKENS, 13)
    lines = await streamed(service, "/v1/messages", body_for("/v1/messages", text))
    first = next(i for i, (_, line) in enumerate(lines) if not line.startswith(":"))
    assert lines[first][1] == "event: message_start"
    assert first >= 3 and all(line.startswith(": keep-alive") for _, line in lines[:first])
    times = [at for at, _ in lines[:first + 1]]
    assert max(b - a for a, b in zip(times, times[1:])) < 2 * KEEPALIVE + 0.5
    assert lines[-1][1].startswith("data:") and "message_stop" in lines[-1][1]


def test_a_progress_event_gives_the_share_read_and_the_time_left_at_its_speed() -> None:
    progress = progress_of({"prompt_progress": {"total": 6000, "cache": 1000,
                                                "processed": 3000, "time_ms": 10_000}}, at=50.0)
    assert progress == PrefillProgress(6000, 1000, 3000, 10.0, 50.0)
    # 2,000 computed in 10 s: the 3,000 left take 15 s, 5 of them gone by 55.
    assert progress.eta() == 15.0 and progress.eta(now=55.0) == 10.0
    assert progress.describe(now=55.0) == "prefill 3000/6000 tokens, ETA 10 s"
    # Told as a share of what is computed, the cache's 1,000 tokens show nowhere.
    assert progress.describe(tokens=False, now=55.0) == "prefill 40%, ETA 10 s"
    unknown = progress_of({"prompt_progress": {"total": 10, "cache": 0, "processed": 0,
                                               "time_ms": 0}})
    assert unknown is not None and unknown.eta() is None
    assert progress_of({"prompt_progress": {"total": "10"}}) is None
    assert progress_of({"choices": []}) is None


async def test_the_inspector_shows_a_request_whose_prompt_is_being_read_with_its_eta(
        service: StudioService) -> None:
    text = await long_text(service.snapshot(), PROMPT_TOKENS, 11)
    seen: list[dict[str, Any]] = []
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{service.gateway_port}",
                                 timeout=300) as client:
        async with client.stream("POST", "/v1/chat/completions",
                                 json=body_for("/v1/chat/completions", text)) as response:
            lines = response.aiter_lines()
            async for line in lines:
                if line.startswith(": keep-alive; prefill ") and ", ETA " in line:
                    break
            listed = (await client.get("/requests")).json()
            seen = listed["in_flight"]
            async for line in lines:
                pass
        after = (await client.get("/requests")).json()
    [row] = seen
    assert row["status"] == 0 and row["route"] == "/v1/chat/completions" and row["stream"]
    assert 0 < row["prefilled"] < row["prompt_tokens"] and row["prefill_eta"] > 0
    assert row["slot"] == 0
    assert after["in_flight"] == []
    record = after["data"][-1]
    assert record["status"] == 200 and record["prefilled"] is None and record["prefill_eta"] is None
    assert record["prompt_tokens"] == row["prompt_tokens"]
