"""Codex CLI (`codex exec`) against the port, over the Responses wire.

Codex prints the final answer on stdout only from `response.output_item.done` and counts
a stream without `response.completed` as dropped, so "exit 0 with text on stdout" proves
the port's Responses stream is complete.
"""

from __future__ import annotations

import asyncio

import pytest

from backend.app.snippets import KEY_ENV_VAR, ClientModel, ClientTarget, codex_snippet
from tests.clients.conftest import (API_KEY, CODEX_OFFLINE_ROOT, CODEX_OFFLINE_TABLES, CONTEXT,
                                    KEEPALIVE, MODEL_ID, OUTPUT_CAP, Codex, base_url,
                                    network_connections, occupied, occupied_place, rejections,
                                    responses_count, until)

# A first run installs the clients (scripts/install-clients); each client run is bounded.
pytestmark = pytest.mark.timeout(600)

RESPONSES = "/v1/responses"


async def test_codex_exec_answers_with_the_models_text(start_studio, codex: Codex):
    service = await start_studio(parallel=1)

    run = await codex.run(service, "Say hello.")

    assert run.returncode == 0 and not run.timed_out, run.describe()
    assert run.text, "exit 0 but no text: no response.output_item.done reached Codex\n" + run.describe()
    assert responses_count(service, RESPONSES, 200) == 1


async def test_codex_connects_to_nothing_but_the_port(start_studio, codex: Codex, strace,
                                                     tmp_path):
    """Offline: no login, telemetry, update check or plugin sync reaches out."""
    service = await start_studio(parallel=1)
    trace = tmp_path / "codex.strace"

    run = await codex.run(service, "Say hello.", trace=trace)

    assert run.returncode == 0 and run.text, run.describe()
    connections = network_connections(trace)
    assert connections, "strace saw no connection at all"
    assert set(connections) == {("127.0.0.1", service.gateway_port)}, connections


async def test_codex_waiting_in_line_longer_than_its_idle_timeout_is_kept_alive(
        start_studio, codex: Codex):
    """Codex's stream idle timer ignores SSE comments: the port's response.created /
    response.in_progress events while queued are what keep the request alive.

    A first run puts Codex's ~5k-token prompt in llama-server's prompt cache, so that
    what is measured here is the wait in line (the silence while the engine reads a prompt
    is the next test's)."""
    service = await start_studio(parallel=1)
    warm_up = await codex.run(service, "Say hello.")
    assert warm_up.returncode == 0 and warm_up.text, warm_up.describe()
    idle_timeout = 2.0
    async with occupied(service):
        # No retries: a stream Codex gave up on must fail the run, not be sent again.
        process = await codex.start(service, "Say hello.",
                                    stream_idle_timeout_ms=int(idle_timeout * 1000),
                                    stream_max_retries=0, request_max_retries=0)
        await until(lambda: service.registry.total_waiting == 1, 60, "Codex to wait in line")
        await asyncio.sleep(3 * idle_timeout)
        assert process.running, "Codex gave up while queued\n" + (await process.result()).describe()
        assert service.registry.total_waiting == 1
    # The slot is free: Codex is admitted and answers.
    run = await process.result()

    assert run.returncode == 0 and not run.timed_out, run.describe()
    assert run.text, "exit 0 but no text: no response.output_item.done reached Codex\n" + run.describe()
    assert responses_count(service, RESPONSES, 200) == 2  # warm-up + this one, never re-sent
    assert KEEPALIVE < idle_timeout / 5


async def test_codex_engine_silent_longer_than_the_idle_timeout_is_kept_alive(
        start_studio, codex: Codex):
    """A long prompt keeps the engine silent (prompt processing) for longer than Codex's
    idle timeout, with no queueing at all; a real model on a CPU does this with Codex's
    own growing context (default idle timeout 300 s).  llama-server sends nothing, not even
    response.created, before its first token: the port's events must cover that silence."""
    service = await start_studio(parallel=1)
    long_prompt = "Summarise these words: " + " ".join(f"word{i}" for i in range(3000))

    run = await codex.run(service, long_prompt, stream_idle_timeout_ms=1000,
                          stream_max_retries=0, request_max_retries=0)

    assert run.returncode == 0 and not run.timed_out, run.describe()
    assert run.text, run.describe()


async def test_codex_retries_a_429_and_succeeds_once_a_place_frees(start_studio, codex: Codex):
    """max_queue 1: with the slot busy and the one waiting place taken, Codex's request is
    refused with 429 + Retry-After; Codex retries it and succeeds once the line empties."""
    service = await start_studio(parallel=1, max_queue=1)
    async with occupied(service):
        async with occupied_place(service) as waiting:
            # A few more retries than the default 4, to ride out 429s until the line empties.
            process = await codex.start(service, "Say hello.", request_max_retries=6)
            await until(lambda: rejections(service, "server_is_overloaded") >= 1, 60,
                        "Codex's request to be refused")
            assert process.running
    await waiting

    run = await process.result()

    assert run.returncode == 0 and not run.timed_out, run.describe()
    assert run.text, run.describe()
    assert responses_count(service, RESPONSES, 429) >= 1
    assert responses_count(service, RESPONSES, 200) == 1


async def test_codex_switches_to_another_model_of_the_port_with_the_snippets_profile(
        start_studio, codex: Codex):
    """The Codex snippet of a port with two models, pasted as it is (plus the suite's
    offline switches): --strict-config takes config.toml and the profile file, and
    `codex --profile NAME` asks for that model.  (Which context window Codex then plans
    with shows nowhere outside it: a run with the profile's window left out looks alike.)"""
    service = await start_studio(parallel=1)
    target = ClientTarget(base_url(service), "never-asked-for", API_KEY, context_length=4096,
                          max_output_tokens=OUTPUT_CAP, others=(ClientModel(MODEL_ID, CONTEXT),))
    snippet = codex_snippet(target)
    (profile,) = snippet.files
    root, tables = snippet.text.split("\n\n", 1)
    files = {"config.toml": "\n".join([root, *CODEX_OFFLINE_ROOT, "", tables, *CODEX_OFFLINE_TABLES]),
             profile.where.removeprefix("~/.codex/"): profile.text}

    run = await codex.run(service, "Say hello.", files=files, args=tuple(profile.usage.split()[1:]),
                          env={KEY_ENV_VAR: API_KEY})

    assert run.returncode == 0 and run.text, run.describe()
    assert f"model: {MODEL_ID}\n" in run.stderr, run.describe()  # Codex's header: the profile's
    assert responses_count(service, RESPONSES, 200) == 1, run.describe()  # never re-sent
