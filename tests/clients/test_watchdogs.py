"""Each real client with its stream watchdog set to seconds completes a turn whose wait in
line plus prefill is three times that watchdog, while other sessions' turns keep arriving
(issue 37): in one attempt, the port's keep-alives being what each counts as life
(bench/README.md, watchdogs: Claude Code any bytes, Codex `response.in_progress` events,
OpenCode any bytes and its headers at once); and the engine reads the client's prompt
once (llama-server's own prompt-token counter against the records' computed tokens).

Figures go to stdout (`-s`): attempts, prompt tokens, seconds."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest

from backend.app.service import StudioService
from backend.llama.api import engine_headers
from tests.clients.conftest import (MODEL_ID, SMOL_ID, ClaudeCode, Codex, OpenCode,
                                    auth_headers, base_url, claude_answered, codex_config,
                                    occupied, opencode_config, until)

pytestmark = pytest.mark.timeout(900)

WORDS = ("river stone maple copper lantern orchard signal harbor velvet quartz meadow "
         "cinder falcon willow ember glacier thistle canyon saffron marble").split()


async def engine_prompt_tokens(service: StudioService) -> float:
    """llama-server's count of the prompt tokens it read (its /metrics)."""
    serving = service.snapshot().serving
    assert serving is not None
    async with httpx.AsyncClient(base_url=serving.base_url,
                                 headers=engine_headers(serving.api_key)) as engine:
        for line in (await engine.get("/metrics")).text.splitlines():
            if line.startswith("llamacpp:prompt_tokens_total "):
                return float(line.split()[1])
    raise AssertionError("llama-server reported no prompt_tokens_total")


async def records(service: StudioService) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(headers=auth_headers()) as client:
        response = await client.get(f"http://127.0.0.1:{service.gateway_port}/requests")
    return list(response.json()["data"])


async def other_turns(service: StudioService, model: str, *, count: int, words: int,
                      every: float) -> None:
    """`count` turns of other sessions, one every `every` seconds, each a prompt of its own
    of `words` words (nothing of it cached), read to their end."""
    async def turn(n: int) -> None:
        text = " ".join(WORDS[(i * (n + 3) + i // 5) % len(WORDS)] for i in range(words))
        body = {"model": model, "stream": True, "max_tokens": 4,
                "messages": [{"role": "user", "content": f"{n} {text}"}]}
        async with httpx.AsyncClient(timeout=600, headers={**auth_headers(),
                                                            "x-session-id": f"other-{n}"}) as c:
            async with c.stream("POST", f"{base_url(service)}/chat/completions",
                                json=body) as response:
                assert response.status_code == 200
                async for _ in response.aiter_lines():
                    pass

    tasks = []
    for n in range(count):
        tasks.append(asyncio.create_task(turn(n)))
        await asyncio.sleep(every)
    await asyncio.gather(*tasks)


def attempts(found: list[dict[str, Any]], route: str) -> list[dict[str, Any]]:
    return [record for record in found if record["route"] == route]


async def test_claude_code_with_a_10_s_watchdog_completes_a_turn_three_times_as_long(
        start_smol_studio, claude: ClaudeCode) -> None:
    service = await start_smol_studio(parallel=1)
    watchdog = 10.0  # Claude Code's floor for its byte watchdog
    read_before = await engine_prompt_tokens(service)
    others = asyncio.create_task(other_turns(service, SMOL_ID, count=3, words=1200, every=2.0))
    await until(lambda: service.registry.total_active == 1, 60, "another session's turn to run")
    started = time.monotonic()

    run = await claude.run(service, "Say hello.", timeout=480, env={
        "CLAUDE_BYTE_STREAM_IDLE_TIMEOUT_MS": str(int(watchdog * 1000)),
        "CLAUDE_STREAM_IDLE_TIMEOUT_MS": str(int(watchdog * 1000))})
    took = time.monotonic() - started
    await others

    found = await records(service)
    assert not run.timed_out, f"{found}\n{run.describe()}"
    claude_answered(run)
    turns = attempts(found, "/v1/messages")
    print("\nClaude Code's requests: " + "; ".join(
        f"{r['status']} joined={r['joined']} wait={r['wait']:.1f}s "
        f"ttft={r['time_to_first_token'] or 0:.1f}s prompt={r['prompt_tokens']} "
        f"computed={r['computed_tokens']} out={r['output_tokens']}" for r in turns)
        + f"; run {took:.1f} s")
    first = turns[0]
    # Its first request waited and read its prompt for three watchdogs, and was never given
    # up: no hang-up, no resend (each later request is one more turn of the run's
    # conversation, Claude Code asking a rambling SmolLM2 to finish).
    assert first["time_to_first_token"] >= 3 * watchdog, first
    assert all(r["status"] == 200 and r["joined"] is None for r in turns), turns
    read = await engine_prompt_tokens(service) - read_before
    assert read == sum(record["computed_tokens"] for record in found)  # each prompt read once


async def test_codex_with_a_3_s_watchdog_completes_a_turn_three_times_as_long(
        start_smol_studio, codex: Codex) -> None:
    service = await start_smol_studio(parallel=1)
    # SmolLM2 answers Codex's instructions at length: a short answer is the turn's end.
    await service.apply_settings(service.settings.replace(max_output_tokens=32))
    watchdog = 3.0
    read_before = await engine_prompt_tokens(service)
    others = asyncio.create_task(other_turns(service, SMOL_ID, count=3, words=600, every=1.0))
    await until(lambda: service.registry.total_active == 1, 60, "another session's turn to run")
    config = codex_config(service, stream_idle_timeout_ms=int(watchdog * 1000),
                          stream_max_retries=0, request_max_retries=0)
    started = time.monotonic()

    # No retries: a stream Codex gave up on fails the run.
    run = await codex.run(service, "Say hello.", timeout=600, files={
        "config.toml": config.replace(f'model = "{MODEL_ID}"', f'model = "{SMOL_ID}"')})
    took = time.monotonic() - started
    await others

    assert run.returncode == 0 and not run.timed_out and run.text, run.describe()
    found = await records(service)
    [turn] = attempts(found, "/v1/responses")
    assert turn["status"] == 200
    assert turn["time_to_first_token"] >= 3 * watchdog, turn  # its wait and prefill
    read = await engine_prompt_tokens(service) - read_before
    assert read == sum(record["computed_tokens"] for record in found)
    print(f"\nCodex: 1 attempt, {turn['prompt_tokens']} prompt tokens "
          f"({turn['computed_tokens']} computed), waited {turn['wait']:.1f} s, first token "
          f"after {turn['time_to_first_token']:.1f} s, run {took:.1f} s")


async def test_opencode_with_3_s_timeouts_completes_a_turn_three_times_as_long(
        start_studio, opencode: OpenCode) -> None:
    service = await start_studio(parallel=1)
    watchdog = 3.0
    config = opencode_config(service)
    config["provider"]["gguf-studio"]["options"].update(
        chunkTimeout=int(watchdog * 1000), headerTimeout=int(watchdog * 1000))
    started = time.monotonic()
    async with occupied(service):  # another session's long turn, then others arriving
        process = await opencode.start(service, "Say hello.", config=config, timeout=300)
        await until(lambda: service.registry.total_waiting >= 1, 60, "OpenCode to wait")
        others = asyncio.create_task(other_turns(service, MODEL_ID, count=2, words=200,
                                                 every=1.0))
        await asyncio.sleep(3 * watchdog)  # the wait under test: three watchdogs long
        assert process.running, (await process.result()).describe()
    run = await process.result()
    took = time.monotonic() - started
    await others

    assert run.returncode == 0 and not run.timed_out and run.text, run.describe()
    found = attempts(await records(service), "/v1/chat/completions")
    theirs = [r for r in found if r["session"] is None or not r["session"].startswith("other-")]
    blocker = max(theirs, key=lambda r: r["output_tokens"] or 0)
    own = [r for r in theirs if r is not blocker]
    # Its title and its turn, once each: nothing resent, nothing given up.
    assert len(own) == 2 and all(r["status"] == 200 and r["joined"] is None for r in own), own
    waited = max(r["wait"] for r in own)
    assert waited >= 3 * watchdog, own
    print(f"\nOpenCode: 2 requests (its title and turn), one attempt each, the longest "
          f"waited {waited:.1f} s, run {took:.1f} s")
